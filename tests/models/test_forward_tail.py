"""A short prefill over rows that hold the greedy gate only, run as decode runs its tokens
(HybridModel.forward_tail, Engine.prefill_steps, TAIL_ROWS). Gates: the rows, conv tails and
recurrent states it writes, and its last row's logits, are torch.equal to decoding the same
tokens one by one (the arithmetic the greedy gate holds such rows to); a resumed turn through
it gives the same greedy tokens as through the chunk's layer path; a prefill the grid gate
holds (untainted, on the grid) never takes it, so a grid resume stays bit for bit a cold run.
On the small hybrid with long recurrent memory (decay near 0.98: a row that lost or skipped
state shows in the next)."""

import pytest
import torch

from small_hybrid import make_small_hybrid
import tandem.engine as engine_mod
from tandem.engine import Engine, SamplingParams, run_steps
from tandem.kernels import native
from tandem.models.base import HeadRow, ModelState, View
from tandem.models.hybrid import HybridModel

# decode on the native kernels (conftest's native_on), where the library builds
pytestmark = [pytest.mark.skipif(not native.available(), reason="no native library here"),
              pytest.mark.usefixtures("native_on")]

WINDOW = 512


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> HybridModel:
    """The small hybrid with long recurrent memory, its tokenizer left out."""
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("tail"), tokenizer=False))


def _clone(state: ModelState) -> ModelState:
    return ModelState({k: t.clone() for k, t in state.sections.items()},
                      {k: View(v.tensor.clone(), v.token_axis) for k, v in state.views.items()})


def _prefilled(model, n: int, seed: int) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    state = model.new_state(WINDOW)
    model.forward(state, torch.randint(0, model.vocab_size, (n,), generator=gen), 0)
    return state


@pytest.mark.parametrize("tail", [1, 3, 16])
def test_a_tail_writes_the_bits_decoding_its_tokens_one_by_one_writes(small, tail):
    start = 37
    base = _prefilled(small, start, tail)
    ids = torch.randint(0, small.vocab_size, (tail,),
                        generator=torch.Generator().manual_seed(100 + tail)).tolist()
    fast, slow = _clone(base), _clone(base)
    with torch.inference_mode():
        row = small.forward_tail(fast, ids, start)
        decoded = [small.forward(slow, torch.tensor([t]), start + j, decode=True)
                   for j, t in enumerate(ids)]
    assert isinstance(row, HeadRow)
    for name in base.sections:
        assert torch.equal(fast.sections[name], slow.sections[name]), name
    for name, view in base.views.items():
        assert torch.equal(fast.views[name].tensor, slow.views[name].tensor), name
    assert torch.equal(row.logits(), decoded[-1].reshape(-1))
    chosen = row.choose()  # the screen's token where it takes the row: the logits' argmax
    token = chosen.token if hasattr(chosen, "token") else int(torch.argmax(chosen))
    assert token == int(torch.argmax(decoded[-1]))


def _turns(model, tail_rows: int, monkeypatch) -> tuple[list[list[int]], int]:
    """Three turns of one conversation, each resumed at the last one's end (its answer sent
    back, then a few new tokens): every turn's greedy tokens, and forward_tail's calls."""
    monkeypatch.setattr(engine_mod, "TAIL_ROWS", tail_rows)
    calls = []
    real = HybridModel.forward_tail

    def counted(self, *args, **kwargs):
        calls.append(len(args[1]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HybridModel, "forward_tail", counted)
    engine = Engine(model, window=WINDOW, prefix_chunk=64)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.vocab_size, (90,), generator=gen).tolist()
    outs = []
    for turn in range(3):
        result = run_steps(engine.generate_steps(prompt, SamplingParams(max_tokens=6)))
        outs.append(result.token_ids)
        prompt = prompt + result.token_ids + torch.randint(
            0, model.vocab_size, (3 + turn,), generator=gen).tolist()
    return outs, len(calls)


def test_resumed_turns_take_the_tail_and_answer_as_the_layer_path_does(small, monkeypatch):
    fast, taken = _turns(small, engine_mod.TAIL_ROWS, monkeypatch)
    slow, none = _turns(small, 0, monkeypatch)
    assert taken >= 2 and none == 0
    assert fast == slow


def test_a_prefill_the_grid_gate_holds_never_takes_the_tail(small, monkeypatch):
    """A cold prompt and one resumed on the grid (untainted): the chunk's layer path, so the
    resumed run's last logits are bit for bit the cold run's."""
    calls = []
    monkeypatch.setattr(HybridModel, "forward_tail",
                        lambda self, *a, **k: calls.append(1) or None)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, small.vocab_size, (64 + 5,), generator=gen).tolist()
    cold = Engine(small, window=WINDOW, prefix_chunk=64)
    cold_row = run_steps(cold.prefill_steps(prompt, row=True))
    warm = Engine(small, window=WINDOW, prefix_chunk=64)
    run_steps(warm.prefill_steps(prompt[:64], row=True))
    assert warm.taint is None
    warm_row = run_steps(warm.prefill_steps(prompt, row=True))  # 5 rows past the line
    assert not calls
    assert isinstance(warm_row, HeadRow)
    assert torch.equal(cold_row.logits(), warm_row.logits())
    for name in cold.state.sections:
        assert torch.equal(cold.state.sections[name], warm.state.sections[name]), name


def test_a_tail_across_a_grid_line_takes_the_chunks(small, monkeypatch):
    calls = []
    real = HybridModel.forward_tail
    monkeypatch.setattr(HybridModel, "forward_tail",
                        lambda self, *a, **k: calls.append(len(a[1])) or real(self, *a, **k))
    engine = Engine(small, window=WINDOW, prefix_chunk=64)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, small.vocab_size, (60,), generator=gen).tolist()
    result = run_steps(engine.generate_steps(prompt, SamplingParams(max_tokens=2)))
    assert engine.taint is not None
    # the rows end at 61 (the last token not yet forwarded): 8 more cross the line at 64
    crossing = prompt + result.token_ids + [5] * 8
    run_steps(engine.generate_steps(crossing, SamplingParams(max_tokens=1)))
    assert not calls
    # the same turn with 2 new tokens stays inside the cell: the tail
    engine = Engine(small, window=WINDOW, prefix_chunk=64)
    run_steps(engine.generate_steps(prompt, SamplingParams(max_tokens=2)))
    run_steps(engine.generate_steps(prompt + result.token_ids + [5] * 2,
                                    SamplingParams(max_tokens=1)))
    assert calls == [3]


def _engine_at(model, n: int, seed: int) -> Engine:
    """An engine holding ``n`` prompt rows and two decoded ones (its rows tainted: a tail may
    run over them), nothing pending."""
    engine = Engine(model, window=WINDOW, prefix_chunk=64)
    prompt = torch.randint(0, model.vocab_size, (n,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    run_steps(engine.generate_steps(prompt, SamplingParams(max_tokens=3)))
    engine.settle()
    return engine


def _twin(engine: Engine) -> Engine:
    twin = Engine(engine.model, window=WINDOW, prefix_chunk=64)
    state = _clone(engine.state)
    for name, t in state.sections.items():
        twin.state.sections[name].copy_(t)
    for name, view in state.views.items():
        twin.state.views[name].tensor.copy_(view.tensor)
    twin.resume_at(engine.length, engine.token_ids, taint=engine.taint)
    return twin


def _token(got) -> int:
    return got.token if hasattr(got, "token") else int(torch.argmax(got.reshape(-1)))


@pytest.mark.parametrize("greedy", [True, False])
def test_a_tail_in_a_decode_batch_writes_and_reads_what_it_does_alone(small, greedy):
    """A TailStep between other sequences' decode steps and a verify block (its rows with no
    head lie between rows whose greedy token the step screens): its rows, sections and last
    row are the bits Engine.tail writes alone (decoding's, above), its greedy token and logits
    the same, and each neighbour gets the bits it gets alone."""
    from tandem.engine import DecodeStep, TailStep, VerifyStep, decode_batch

    batched = [_engine_at(small, 40 + 7 * i, 30 + i) for i in range(4)]
    alone = [_twin(e) for e in batched]
    ids = (17, 400, 23, 9, 311)
    steps = [DecodeStep(batched[0], 5, greedy=True), TailStep(batched[1], ids, greedy=greedy),
             DecodeStep(batched[2], 6, greedy=False), VerifyStep(batched[3], (7, 8, 9), True)]
    got = decode_batch(steps)
    want = [alone[0].decode(5, greedy=True), alone[1].tail(ids), alone[2].decode(6),
            alone[3].verify((7, 8, 9), greedy=True)]
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids and b.length == a.length
        for name in a.state.sections:
            assert torch.equal(b.state.sections[name], a.state.sections[name]), name
        for name in a.state.views:
            assert torch.equal(b.state.views[name].tensor, a.state.views[name].tensor), name
    head, head_alone = got[1], want[1]
    assert isinstance(head, HeadRow) and torch.equal(head.row, head_alone.row)
    assert _token(head.choose()) == _token(head_alone.choose())
    assert torch.equal(head.logits(), head_alone.logits())
    assert _token(got[0]) == _token(want[0])
    assert torch.equal(got[2], want[2])
    assert [_token(r) for r in got[3]] == [_token(r) for r in want[3]]


def test_a_resumed_turn_yields_its_tail_to_the_scheduler_and_answers_the_same(small):
    """generate_steps with ``batch_tail``: a resumed turn's tail is a TailStep (forwarded here
    beside another sequence's decode steps, as the engine actor's scheduler does), and its
    greedy tokens are those of the tail run inline."""
    from tandem.engine import DecodeStep, TailStep, decode_batch, forward_step

    def turn(engine: Engine, prompt: list[int], batch_tail: bool, beside: Engine | None):
        steps = engine.generate_steps(prompt, SamplingParams(max_tokens=5),
                                      batch_tail=batch_tail)
        kinds, value = [], None
        try:
            while True:
                step = steps.send(value)
                kinds.append(type(step).__name__)
                if beside is not None and isinstance(step, (TailStep, DecodeStep)):
                    value = decode_batch([DecodeStep(beside, 3, greedy=True), step])[1]
                else:
                    value = forward_step(step)
        except StopIteration as done:
            return done.value.token_ids, kinds

    base = _engine_at(small, 70, 41)
    prompt = base.token_ids + [12, 13, 14]
    inline, kinds = turn(_twin(base), prompt, False, None)
    assert "TailStep" not in kinds
    batched, kinds = turn(_twin(base), prompt, True, _engine_at(small, 50, 42))
    assert kinds[0] == "TailStep"
    assert batched == inline


def test_a_tail_whose_last_row_the_screen_does_not_take_reads_the_logits_the_step_wrote(
        small, monkeypatch):
    """Where the step's screen gives a row up (-1: an input it does not take), the step writes
    that row's logits; a tail's HeadRow then holds them, the bits the head gives the row alone
    (and no second pass over the head when read)."""
    from tandem.engine import DecodeStep, TailStep, decode_batch
    from tandem.kernels.step import NativeStep

    real = NativeStep.ragged

    def refusing(self, x, states, ragged, positions, cos, sin, choose=None, h_out=None):
        asked = [c is True for c in choose] if choose is not None else None
        wants = None if choose is None else [False if c is True else c for c in choose]
        got = real(self, x, states, ragged, positions, cos, sin, wants, h_out=h_out)
        if asked is None or not isinstance(got, tuple):
            return got
        logits, tokens = got
        return logits, [-1 if a else t for a, t in zip(asked, tokens)]

    monkeypatch.setattr(NativeStep, "ragged", refusing)
    batched = [_engine_at(small, 45, 51), _engine_at(small, 52, 52)]
    alone = [_twin(e) for e in batched]
    ids = (8, 90, 7)
    got = decode_batch([DecodeStep(batched[0], 4, greedy=True), TailStep(batched[1], ids, True)])
    head, want = got[1], alone[1].tail(ids)
    heads = []
    monkeypatch.setattr(type(small), "_prefill_head",
                        lambda self, v: heads.append(1) or torch.zeros(1))
    read = head.logits()
    assert not heads  # the step's logits, not a second pass
    monkeypatch.undo()
    assert torch.equal(read, want.logits())
    assert int(torch.argmax(got[0])) == _token(alone[0].decode(4, greedy=True))
