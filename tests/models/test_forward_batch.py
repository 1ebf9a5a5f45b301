"""forward_batch: one decode step for B sequences, each sequence's logits, rows and sections the
same bits as decoding it alone, whatever the batch around it (issue 14, part 3): on the small
hybrid with long recurrent memory (decay near 0.98), Qwen3-Next's grouped projections and heads
repeated to the values', Qwen3.5-MoE and the test-only third architecture."""

import random

import pytest
import torch

from small_hybrid import make_small_hybrid
from tandem.kernels.decode import TORCH_BLOCK
from tandem.models.base import ModelState, View
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

WINDOW = 256
SEQUENCES = 11  # a batch of all of them runs its matmuls in blocks, the last reaching back
STEPS = 6


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(params=["small", "qwen3_next_dir", "qwen3_5_moe_dir", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    if request.param == "small":
        return request.getfixturevalue("small")
    return HybridModel.load(request.getfixturevalue(request.param))


def _clone(state: ModelState) -> ModelState:
    return ModelState({k: t.clone() for k, t in state.sections.items()},
                      {k: View(v.tensor.clone(), v.token_axis) for k, v in state.views.items()})


def _prefilled(model) -> list[tuple[ModelState, int, int]]:
    """(state, length, first greedy token) for sequences of different lengths and contents."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(SEQUENCES):
        n = 3 + 13 * i
        ids = torch.randint(0, model.vocab_size, (n,), generator=gen)
        state = model.new_state(WINDOW)
        logits = model.forward(state, ids, 0)
        out.append((state, n, int(torch.argmax(logits))))
    return out


def _alone(model, seqs) -> tuple[list[list[torch.Tensor]], list[list[int]], list[ModelState]]:
    logits, tokens, states = [], [], []
    for state, n, tok in seqs:
        state, rows, toks = _clone(state), [], []
        for step in range(STEPS):
            toks.append(tok)
            row = model.forward(state, torch.tensor([tok]), n + step, decode=True)
            rows.append(row)
            tok = int(torch.argmax(row))
        logits.append(rows)
        tokens.append(toks)
        states.append(state)
    return logits, tokens, states


def test_a_sequence_decodes_the_same_bits_alone_and_in_any_batch(model, decode_matmuls):
    seqs = _prefilled(model)
    with torch.inference_mode():
        want_logits, want_tokens, want_states = _alone(model, seqs)
        states = [_clone(s) for s, _, _ in seqs]
        done = [0] * SEQUENCES
        next_tok = [tok for _, _, tok in seqs]
        got_tokens: list[list[int]] = [[] for _ in seqs]
        rng = random.Random(3)
        sizes = [SEQUENCES, 1, TORCH_BLOCK, TORCH_BLOCK + 1, 4, 5, 7]
        while any(d < STEPS for d in done):
            live = [i for i in range(SEQUENCES) if done[i] < STEPS]
            size = min(len(live), sizes[sum(done) % len(sizes)])
            batch = rng.sample(live, size)  # any sequences, in any order
            logits = model.forward_batch([states[i] for i in batch],
                                         [next_tok[i] for i in batch],
                                         [seqs[i][1] + done[i] for i in batch])
            assert logits.shape == (size, model.vocab_size) and logits.dtype == torch.float32
            for row, i in zip(logits, batch):
                assert torch.equal(row, want_logits[i][done[i]]), (i, done[i], size)
                got_tokens[i].append(next_tok[i])
                next_tok[i] = int(torch.argmax(row))
                done[i] += 1
    assert got_tokens == want_tokens
    assert len({t for toks in want_tokens for t in toks}) > 4, "a degenerate run proves little"
    for got, want in zip(states, want_states):
        for name in want.sections:
            assert torch.equal(got.sections[name], want.sections[name]), name
        for name in want.views:
            assert torch.equal(got.views[name].tensor, want.views[name].tensor), name


def test_fused_projections_alias_the_checkpoints_bytes_and_copy_none(small):
    fused = {key: f for key, f in small._fused.items() if f[2] is not None}
    # a saved checkpoint stores a layer's tensors in name order: in_proj_a/_b/_qkv/_z and
    # gate_proj/up_proj lie end to end; k/q/v do not (o_proj and q_norm lie between)
    assert {k.rsplit(".", 1)[1] for k in fused} == {"in_proj", "gate_up"}
    assert len(fused) == 3 + 4
    for names, sizes, weight in fused.values():
        assert weight.data_ptr() == small.w[names[0]].data_ptr()  # no byte copied
        for part, name in zip(torch.split(weight, sizes), names):
            assert part.data_ptr() == small.w[name].data_ptr()
            assert torch.equal(part, small.w[name])


def test_the_native_step_is_torchs_to_its_rounding_with_the_same_greedy_tokens(model):
    """Gate: states written by decoding, identical greedy tokens. The native kernels (matmuls,
    row ops, attention; tandem.kernels.native) round otherwise than torch's ops, so the two
    paths' logits agree to within 5e-5 of the largest, not in their bits."""
    from tandem.kernels import decode, native

    if not native.available():
        pytest.skip("the native kernel does not build on this machine")
    seqs = _prefilled(model)[:4]
    before = decode.block() == 1
    try:
        with torch.inference_mode():
            runs = {}
            for on in (True, False):
                decode.set_native(on)
                runs[on] = _alone(model, seqs)
    finally:
        decode.set_native(before)
    (fast, fast_tokens, _), (slow, slow_tokens, _) = runs[True], runs[False]
    assert fast_tokens == slow_tokens
    for rows_fast, rows_slow in zip(fast, slow):
        for a, b in zip(rows_fast, rows_slow):
            assert float((a - b).abs().max() / b.abs().max()) < 5e-5
