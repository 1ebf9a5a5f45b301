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
