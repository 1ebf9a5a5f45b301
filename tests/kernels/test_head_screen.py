"""The head's screen (tandem/kernels/screen.py, csrc/rows.c's tandem_head_argmax_rows_f32):
greedy's token from int8 rows and the rows it cannot rule out computed exactly.

Gate: the token is the full head's argmax (numpy's, over tandem_rows_f32's logits: the native
decode's own bits) for every input, ties and NaN included; every screened logit lies within its
bound of the exact one; a chosen step leaves the other rows' logits, the states and the rows
the bits of a step without the screen (torch.equal); greedy generation gives the same tokens
with the screen as without, on the small hybrid with long recurrent memory."""

import numpy as np
import pytest
import torch

from small_hybrid import make_small_hybrid
from tandem.engine import Engine, SamplingParams, decode_batch, DecodeStep, run_steps
from tandem.kernels import native, screen, step as native_step
from tandem.models.base import Chosen
from tandem.models.hybrid import HybridModel

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")


@pytest.fixture(autouse=True)
def _native(native_on):
    yield


def _head(n=3000, k=80, seed=0) -> torch.Tensor:
    """A head with the rows a screen must get right: exact duplicates (ties), rows one ulp
    apart, a zero row, rows a thousand times larger and smaller than the rest, subnormal
    weights, and the same row again far below."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[10] = w[7]                       # a tie with an earlier row
    w[n - 100] = w[7]                  # and a later one
    w[11] = torch.nextafter(w[7], torch.full_like(w[7], 1.0))  # one ulp above, every weight
    w[12] = 0.0
    w[13] *= 1000.0
    w[14] *= 1e-3
    w[15] = torch.full((k,), 1e-40)    # subnormal weights
    w[16] = w[13]                      # the large row's tie
    return w.contiguous()


def _full_argmax(x: torch.Tensor, w: torch.Tensor) -> int:
    logits = native.rows_f32(x[None], w)[0]
    return int(logits.numpy().argmax())


def _inputs(k, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        x = torch.randn(k, generator=g) * (10.0 ** (i % 7 - 3))
        if i % 5 == 0:
            x[: k // 2] = 0.0
        yield x


def test_the_screened_token_is_the_full_heads_argmax_ties_and_extremes_included():
    w = _head()
    s = screen.build(w)
    exact_total = 0
    for x in _inputs(w.shape[1], 60):
        token, approx, exact, _ = screen.argmax(x, w, s)
        assert token == _full_argmax(x, w)
        exact_total += exact
    # the screen rules rows out: most of the head is never computed in fp32
    assert exact_total < 60 * w.shape[0] // 10


def test_up_to_four_rows_at_once_each_get_their_own_argmax():
    """The native step screens up to 4 rows reading the screen once: each row's token is its
    own argmax, a row the screen does not take answers -1 and leaves the others theirs."""
    w = _head(seed=8)
    s = screen.build(w)
    xs = torch.stack(list(_inputs(w.shape[1], 12, seed=9)))
    for r in (1, 2, 3, 4):
        for start in range(0, 12 - r + 1, 3):
            rows = xs[start:start + r].clone()
            tokens = screen.argmax_rows(rows, w, s).tokens
            assert tokens == [_full_argmax(x, w) for x in rows]
    rows = xs[:4].clone()
    rows[2, 0] = float("nan")
    tokens = screen.argmax_rows(rows, w, s).tokens
    assert tokens[2] == -1
    assert [t for i, t in enumerate(tokens) if i != 2] == [_full_argmax(rows[i], w)
                                                          for i in (0, 1, 3)]


def test_every_screened_logit_lies_within_its_bound():
    w = _head(seed=3)
    s = screen.build(w)
    for x in _inputs(w.shape[1], 20, seed=4):
        token, approx, _, d = screen.argmax(x, w, s)
        exact = native.rows_f32(x[None], w)[0].double()
        bound = x.double().abs().sum() * s.radius.double() + d * s.rq.double()
        gap = (approx.double() - exact).abs()
        finite = torch.isfinite(s.radius)
        assert bool((gap[finite] <= bound[finite] + 1e-40).all())


def test_the_inputs_own_int16_error_is_inside_the_bound():
    """A head whose rows int8 holds exactly (integers, each row reaching 127: no quantisation
    error of the weights) and inputs with one large entry: the screen's error is then the
    input's int16 rounding alone, which the |x|_1 term does not cover, and the d rq term
    must."""
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-127, 128, (4000, 24), generator=g).float()
    w[:, 5] = 127.0
    w[2000:2010] = w[1000]  # ties, to be broken as argmax breaks them
    s = screen.build(w.contiguous())
    beyond = 0
    for i in range(40):
        x = torch.randn(24, generator=g) * 0.01
        x[i % 24] = 50.0
        x[5] = 0.0  # the column every row shares adds nothing
        token, approx, _, d = screen.argmax(x, w, s)
        assert token == _full_argmax(x, w)
        exact = native.rows_f32(x[None], w)[0].double()
        gap = (approx.double() - exact).abs()
        within = x.double().abs().sum() * s.radius.double()
        assert d > 0 and bool((gap <= within + d * s.rq.double() + 1e-40).all())
        beyond += int((gap > within).sum())
    assert beyond > 0  # the case this test is for: the |x|_1 term alone falls short


def _screened_reference(x: torch.Tensor, w: torch.Tensor, s) -> torch.Tensor:
    """Pass 1's screened logits as csrc/rows.c defines them, computed here row after row from
    the screen's unpacked rows: scale (t S), S = sum_k q[k] xq[k] in integers."""
    n, k = w.shape
    X = 32767 if k <= 2147483647 // (127 * 32767) else 2147483647 // (127 * k)
    t = x.abs().max() / torch.tensor(float(X))
    xq = torch.round(x / t).clamp(-X, X).long() if t > 0 else torch.zeros(k, dtype=torch.long)
    sums = screen.unpack(s.q, n, k).long() @ xq
    return s.scale * (t * sums.float())


@pytest.mark.parametrize("n,k", [(3000, 80), (1007, 81), (5, 3), (16, 1)])
def test_the_packed_screen_holds_each_rows_weights_and_its_sums_are_the_rows(n, k):
    """Gate: torch.equal. The screen's rows are packed 16 to a block, two columns a lane
    (screen.BLOCK): unpacked they are round(W / s) row after row, the padding (rows past N, an
    odd K's last column) is 0, and the screened logits of 1 to 4 inputs at once are the bits
    of each row's own integer sum, at every row count and an odd K alike."""
    w = _head(n=max(n, 200), k=k, seed=11)[:n].contiguous()
    s = screen.build(w)
    assert s.q.shape == (-(-n // screen.BLOCK), (k + 1) // 2, screen.BLOCK, 2)
    scale = (w.abs().amax(dim=1) / 127.0)
    rows = torch.where(scale[:, None] > 0, torch.round(w / scale[:, None]), 0.0)
    assert torch.equal(screen.unpack(s.q, n, k), rows.clamp(-127, 127).to(torch.int8))
    padded = s.q.permute(0, 2, 1, 3).reshape(-1, s.q.shape[1] * 2)
    assert not padded[n:].any() and not padded[:, k:].any()
    xs = torch.stack(list(_inputs(k, 4, seed=12)))
    for r in range(1, 5):
        got = screen.argmax_rows(xs[:r], w, s).approx
        for b in range(r):
            assert torch.equal(got[b], _screened_reference(xs[b], w, s))


def test_a_tie_goes_to_the_first_row_as_argmax_has_it():
    w = torch.zeros(64, 32)
    w[5] = 1.0
    w[9] = 1.0
    w[40] = 1.0
    s = screen.build(w.contiguous())
    x = torch.ones(32)
    assert screen.argmax(x, w, s)[0] == 5 == _full_argmax(x, w)


def test_rows_that_are_not_finite_are_always_computed_and_answer_as_argmax():
    w = _head(n=500, seed=5)
    w[30, 3] = float("inf")
    w[31, 0] = float("nan")
    w[400, 2] = float("nan")  # a later NaN, in another of the kernel's chunks: the first wins
    s = screen.build(w)
    assert s.radius[30] == float("inf") and s.radius[31] == float("inf")
    for x in _inputs(w.shape[1], 10, seed=6):
        token = screen.argmax(x, w, s)[0]
        assert token == _full_argmax(x, w)


def test_an_input_the_bound_does_not_cover_gets_the_full_head():
    w = _head(n=200)
    s = screen.build(w)
    x = torch.randn(w.shape[1])
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[4] = bad
        assert screen.argmax(y, w, s)[0] == -1
    assert screen.argmax(x * 1e35, w, s)[0] == -1  # a sum could overflow


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


def _plan(model):
    plan = model._native_step()
    assert plan is not None and plan.screen is not None
    return plan


def test_a_chosen_step_leaves_every_other_bit_as_without_the_screen(small):
    """Two sequences, one choosing its token: the other's logits, both states and rows are the
    bits of the same step with logits for both; the chosen token is their argmax."""
    _plan(small)
    g = torch.Generator().manual_seed(7)
    states, tokens = [], []
    for n in (9, 23):
        st = small.new_state(64)
        logits = small.forward(st, torch.randint(0, small.vocab_size, (n,), generator=g), 0)
        states.append(st)
        tokens.append(int(torch.argmax(logits)))
    twins = [type(st)({k: t.clone() for k, t in st.sections.items()},
                      {k: type(v)(v.tensor.clone(), v.token_axis) for k, v in st.views.items()})
             for st in states]
    full = small.forward_batch(twins, tokens, [9, 23])
    out = small.forward_batch(states, tokens, [9, 23], choose=[True, False])
    assert isinstance(out[0], Chosen)
    assert out[0].token == int(full[0].numpy().argmax())
    assert torch.equal(out[1], full[1])
    for a, b in zip(states, twins):
        for k in a.sections:
            assert torch.equal(a.sections[k], b.sections[k])
        for k in a.views:
            assert torch.equal(a.views[k].tensor, b.views[k].tensor)


def _states(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    states, tokens = [], []
    for n in lengths:
        st = model.new_state(64)
        logits = model.forward(st, torch.randint(0, model.vocab_size, (n,), generator=g), 0)
        states.append(st)
        tokens.append(int(torch.argmax(logits)))
    return states, tokens


def _twin(st):
    return type(st)({k: t.clone() for k, t in st.sections.items()},
                    {k: type(v)(v.tensor.clone(), v.token_axis) for k, v in st.views.items()})


def test_up_to_32_rows_are_chosen_four_a_read_and_a_33rd_gets_every_rows_logits(small):
    """A step screens its greedy rows four to a read of the screen, up to STEP_ROWS_MAX (eight
    reads of the packed screen stay under the fp32 head's one): each row's token is the argmax
    of the logits the same step gives without the screen; one row more and every row gets its
    logits."""
    _plan(small)
    assert screen.STEP_ROWS_MAX == 32 and screen.ROWS_MAX == 4
    for b, seed in ((4, 21), (5, 23), (12, 24), (32, 25)):
        lengths = [5 + 2 * (i % 20) for i in range(b)]
        states, tokens = _states(small, lengths, seed)
        twins = [_twin(st) for st in states]
        full = small.forward_batch(twins, tokens, lengths)
        out = small.forward_batch(states, tokens, lengths, choose=[True] * b)
        assert [c.token for c in out] == [int(row.numpy().argmax()) for row in full]
        for a, t in zip(states, twins):
            for k in a.sections:
                assert torch.equal(a.sections[k], t.sections[k])
    lengths = [5 + 2 * (i % 20) for i in range(33)]
    states, tokens = _states(small, lengths, 22)
    twins = [_twin(st) for st in states]
    full = small.forward_batch(twins, tokens, lengths)
    out = small.forward_batch(states, tokens, lengths, choose=[True] * 33)
    assert all(torch.equal(a, b) for a, b in zip(out, full))  # over STEP_ROWS_MAX: the logits


def _generate(model, prompt, params, screened: bool, **kw):
    plan = _plan(model)
    kept = plan.screen
    if not screened:
        plan.set_screen(None)
    try:
        engine = Engine(model, window=256, prefix_chunk=16)
        return run_steps(engine.generate_steps(prompt, params, **kw))
    finally:
        plan.set_screen(kept)


def test_greedy_generation_gives_the_same_tokens_with_the_screen_as_without(small):
    """Gate: identical greedy tokens (states written by decoding), with no drafts, with drafts
    that are the answer (verify blocks accepted whole: up to 4 rows are screened, longer
    blocks read the full head) and with drafts that are wrong (every block rejected)."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, small.vocab_size, (40,), generator=g).tolist()
    params = SamplingParams(max_tokens=48)
    off = _generate(small, prompt, params, False)
    assert len(off.token_ids) == 48
    assert _generate(small, prompt, params, True).token_ids == off.token_ids
    answer = off.token_ids

    def right(context, k):
        done = len(context) - len(prompt)
        return answer[done:done + k]

    def wrong(context, k):
        return [(t + 1) % small.vocab_size for t in right(context, k)]

    for draft in (right, wrong):
        for k in (2, 3, 8):
            on = _generate(small, prompt, params, True, draft=draft, draft_max=k)
            assert on.token_ids == answer
            assert on.drafted > 0
            assert on.accepted == (on.drafted if draft is right else 0)


def test_a_position_that_wants_logits_is_sent_them(small):
    """Logprobs, a sampled request and a penalty keep the full head: the steps are not
    greedy-only, and what they return equals the run without the screen."""
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, small.vocab_size, (30,), generator=g).tolist()
    for params in (SamplingParams(max_tokens=12, logprobs=2),
                   SamplingParams(max_tokens=12, temperature=0.8, seed=3),
                   SamplingParams(max_tokens=12, frequency_penalty=0.5)):
        on = _generate(small, prompt, params, True)
        off = _generate(small, prompt, params, False)
        assert on.token_ids == off.token_ids
        assert on.logprobs == off.logprobs


def test_a_greedy_verify_block_of_up_to_32_rows_is_sent_its_tokens(small):
    """A verify block asking for its tokens alone gets each row's argmax of the logits the
    same block gets on a copy of the sequence (four rows a read of the screen); a block of
    33 gets the logits."""
    from tandem.choices import fork

    _plan(small)
    g = torch.Generator().manual_seed(14)
    e = Engine(small, window=128, prefix_chunk=16)
    run_steps(e.generate_steps(torch.randint(0, small.vocab_size, (10,), generator=g).tolist(),
                               SamplingParams(max_tokens=1)))
    for block in ([3, 4, 5], [6, 7, 8, 9, 10], list(range(11, 43)), list(range(11, 44))):
        twin = fork(e, 128)
        full = twin.verify(block)
        out = fork(e, 128).verify(block, greedy=True)
        if len(block) <= screen.STEP_ROWS_MAX:
            assert [c.token for c in out] == [int(r.numpy().argmax()) for r in full]
        else:
            assert torch.equal(out, full)


def test_decode_batch_sends_a_greedy_step_its_token_and_the_others_their_logits(small):
    _plan(small)
    g = torch.Generator().manual_seed(13)
    engines = []
    for n in (12, 20, 7):
        e = Engine(small, window=128, prefix_chunk=16)
        run_steps(e.generate_steps(torch.randint(0, small.vocab_size, (n,), generator=g).tolist(),
                                   SamplingParams(max_tokens=1)))
        engines.append(e)
    out = decode_batch([DecodeStep(engines[0], 5, True), DecodeStep(engines[1], 6, False),
                        DecodeStep(engines[2], 7, True)])
    assert isinstance(out[0], Chosen) and isinstance(out[2], Chosen)
    assert isinstance(out[1], torch.Tensor) and out[1].shape == (small.vocab_size,)


def test_a_prefills_head_row_gives_its_logits_bits_and_its_greedy_token_without_them(small):
    """forward(logits="row"): the HeadRow's logits are torch.equal to the logits forward gives
    (computed when read); its greedy token through the screen is their argmax, found without
    computing them; the row's state and rows are the logits forward's."""
    from tandem.models.base import HeadRow

    _plan(small)
    g = torch.Generator().manual_seed(31)
    for n in (1, 7, 33):
        ids = torch.randint(0, small.vocab_size, (n,), generator=g)
        st, twin = small.new_state(64), small.new_state(64)
        head = small.forward(st, ids, 0, logits="row")
        want = small.forward(twin, ids, 0)
        assert isinstance(head, HeadRow) and head.row.shape == (1, small.config.hidden_size)
        before = dict(small.screen_counts)
        chosen = head.choose()
        assert isinstance(chosen, Chosen) and chosen.token == int(want.numpy().argmax())
        assert small.screen_counts["screened"] == before["screened"] + 1
        assert head._logits is None  # the full head was not read
        assert torch.equal(head.logits(), want)
        assert torch.equal(head.clone().logits(), want)
        for k in st.sections:
            assert torch.equal(st.sections[k], twin.sections[k])


def test_a_head_rows_copies_take_its_screened_token_while_their_bits_are_its(small):
    """Gate: identical greedy tokens. A HeadRow's copies (an anchor's buffer, a resume's
    clone) share what the screen answered for the row: a copy with the very bits takes that
    token without screening the head again; a copy whose buffer was written since (other
    bits, a -0.0 for a 0.0 among them) screens its own, the argmax of its own logits."""
    from tandem.models.base import HeadRow

    _plan(small)
    g = torch.Generator().manual_seed(33)
    ids = torch.randint(0, small.vocab_size, (9,), generator=g)
    head = small.forward(small.new_state(64), ids, 0, logits="row")
    first = head.choose()
    buffer = head.row.clone()
    kept = head.with_row(buffer)
    before = small.screen_counts["screened"]
    assert kept.choose() == first and kept.clone().choose() == first
    assert small.screen_counts["screened"] == before  # the screen was not read again
    other = small.forward(small.new_state(64), ids.flip(0), 0, logits="row")
    buffer.copy_(other.row)  # the buffer now holds another prompt's row
    assert kept.choose().token == int(other.logits().numpy().argmax())
    assert small.screen_counts["screened"] == before + 1
    zero = HeadRow(torch.zeros_like(head.row), head._head, head._screen)
    zero.choose()
    signed = zero.with_row(torch.full_like(head.row, -0.0))
    signed.choose()
    assert small.screen_counts["screened"] == before + 3  # -0.0 is other bits than 0.0


def test_greedy_generation_takes_its_first_token_from_the_screen_and_keeps_the_row(small):
    """A greedy-only generation's first token comes through the screen (the prefill's head is
    never read) and is the tokens without the screen; the prompt-end anchor keeps the row, K
    floats rather than vocab; a sampled request from that anchor reads the logits, the cold
    prefill's bits."""
    from tandem.cache.tiers.ends import Ends
    from tandem.cache.memory import MemoryAccountant
    from tandem.models.base import HeadRow, prompt_logits

    g = torch.Generator().manual_seed(32)
    prompt = torch.randint(0, small.vocab_size, (37,), generator=g).tolist()
    params = SamplingParams(max_tokens=6)
    off = _generate(small, prompt, params, False)
    calls = []
    real = small._prefill_head
    small._prefill_head = lambda rows: calls.append(rows.shape[0]) or real(rows)
    kept = []
    try:
        on = _generate(small, prompt, params, True, on_prefill=kept.append)
    finally:
        del small._prefill_head
    assert on.token_ids == off.token_ids and calls == []
    assert len(kept) == 1 and isinstance(kept[0], HeadRow)
    ends = Ends(MemoryAccountant({"prompt_end": 1 << 30, "end": 1 << 30}))
    engine = Engine(small, window=256, prefix_chunk=16)
    want = engine.prefill(prompt)
    ends.keep_prompt_end(prompt, engine.cache_state(), kept[0])
    assert ends.memory.held["prompt_end"] < ends.prompt_end.copy.nbytes + want.numel() * 4
    assert ends.prompt_end.logits.row.numel() == small.config.hidden_size
    assert torch.equal(prompt_logits(ends.prompt_end.logits.clone()), want)
    ends.keep_prompt_end(prompt, engine.cache_state(), want)  # logits where a row was
    assert torch.equal(ends.prompt_end.logits, want)
    ends.check_invariants(prompt, False)
