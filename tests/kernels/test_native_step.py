"""The whole decode step as one native call (tandem/kernels/step.py, csrc/step.c) against the
layer-by-layer native step it replaces. Gate: the same bits (torch.equal) on every logit, conv
tail, recurrent state and key/value row, step after step, for batches of sequences of different
lengths and windows, on the small hybrid with long recurrent memory (decay near 0.98: a state
read from the wrong slot or a neighbour's row shows within a step); with the projections as
the checkpoint lays them (attention's k, q, v apart) and fused into one matrix; and a model it
does not take (Qwen3-Next's interleaved in_proj, MoE blocks) keeps the layer path."""

import pytest
import torch

import json

from safetensors.torch import save_file

from small_hybrid import SMALL_CONFIG, _long_memory, make_small_hybrid
from tandem.models.tiny import _weights
from tandem.kernels import decode, native, step as native_step
from tandem.models.base import ModelState, View
from tandem.models.hybrid import HybridModel

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

STEPS = 5


@pytest.fixture(autouse=True)
def _native(native_on):
    yield
    native_step.set_enabled(True)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> HybridModel:
    """The small hybrid with two attention layers of two key/value heads each and GDN key heads
    repeated to the values' (every slot and head stride of a sequence's sections in use)."""
    config = dict(SMALL_CONFIG, num_hidden_layers=8, layer_types=SMALL_CONFIG["layer_types"] * 2,
                  num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                  linear_num_value_heads=4)
    path = tmp_path_factory.mktemp("wide")
    (path / "config.json").write_text(json.dumps(config))
    save_file(_long_memory(_weights(config)), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return HybridModel.load(path)


@pytest.fixture(params=["small", "wide"])
def model(request) -> HybridModel:
    return request.getfixturevalue(request.param)


def _prefilled(model, lengths, windows):
    gen = torch.Generator().manual_seed(5)
    out = []
    for n, window in zip(lengths, windows):
        state = model.new_state(window)
        logits = model.forward(state, torch.randint(0, model.vocab_size, (n,), generator=gen), 0)
        out.append((state, n, int(torch.argmax(logits))))
    return out


def _clone(state: ModelState) -> ModelState:
    return ModelState({k: t.clone() for k, t in state.sections.items()},
                      {k: View(v.tensor.clone(), v.token_axis) for k, v in state.views.items()})


def _decode(model, seqs, whole: bool, batches):
    """Greedy decode of every sequence over STEPS steps in the given batches of indices, with
    the whole-step call on or off; the logits by sequence and the states after."""
    native_step.set_enabled(whole)
    states = [_clone(s) for s, _, _ in seqs]
    tokens = [t for _, _, t in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        for _ in range(STEPS):
            for batch in batches:
                rows = model.forward_batch([states[i] for i in batch], [tokens[i] for i in batch],
                                           [seqs[i][1] + done[i] for i in batch])
                for row, i in zip(rows, batch):
                    logits[i].append(row.clone())
                    tokens[i] = int(torch.argmax(row))
                    done[i] += 1
    return logits, states


def _assert_same(a, b):
    (la, sa), (lb, sb) = a, b
    for rows_a, rows_b in zip(la, lb):
        for x, y in zip(rows_a, rows_b):
            assert torch.equal(x, y)
    for x, y in zip(sa, sb):
        for name in x.sections:
            assert torch.equal(x.sections[name], y.sections[name]), name
        for name in x.views:
            assert torch.equal(x.views[name].tensor, y.views[name].tensor), name


def _calls(monkeypatch):
    """A counter of the whole-step calls made."""
    calls = []
    real = native_step.NativeStep.__call__
    monkeypatch.setattr(native_step.NativeStep, "__call__",
                        lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    return calls


@pytest.mark.parametrize("batches", [[[0], [1], [2], [3], [4]], [[0, 1, 2, 3, 4]],
                                     [[3, 0], [4, 2, 1]]])
def test_the_whole_step_is_the_layer_steps_bits_alone_and_in_any_batch(model, batches,
                                                                       monkeypatch):
    seqs = _prefilled(model, [3, 17, 40, 9, 64], [128] * 5)
    layered = _decode(model, seqs, False, batches)
    calls = _calls(monkeypatch)
    whole = _decode(model, seqs, True, batches)
    assert len(calls) == STEPS * len(batches), "the whole-step call did not run"
    _assert_same(whole, layered)
    tokens = {int(torch.argmax(r)) for rows in whole[0] for r in rows}
    assert len(tokens) > 3, "a degenerate run proves little"


def test_sequences_of_different_windows_share_a_step_with_their_own_bits(wide, monkeypatch):
    """A key row's head and slot strides are its own sequence's (attn.c and step.c read them by
    row): on the whole step and on the layer path, a batch of windows 40, 128 and 300 gives
    each its bits alone."""
    seqs = _prefilled(wide, [5, 30, 21], [40, 128, 300])
    for whole in (False, True):
        alone = _decode(wide, seqs, whole, [[0], [1], [2]])
        batched = _decode(wide, seqs, whole, [[2, 0, 1]])
        _assert_same(batched, alone)
    calls = _calls(monkeypatch)
    _decode(wide, seqs, True, [[0, 1, 2]])
    assert calls == [3] * STEPS


def test_a_fused_attention_projection_takes_one_matrix_and_gives_the_same_bits(small,
                                                                                monkeypatch):
    """The checkpoint lays attention's k, q and v apart, so the plan runs them as three calls
    into one row; a model whose k|q|v lie end to end runs them as one. Same bits."""
    seqs = _prefilled(small, [12, 33], [96, 96])
    apart = _decode(small, seqs, True, [[0, 1]])
    fused = dict(small._fused)
    for key, (names, sizes, weight) in small._fused.items():
        if weight is None:
            fused[key] = (names, sizes, torch.cat([small.w[n] for n in names]))
    assert fused != small._fused, "no projection was apart"
    monkeypatch.setattr(small, "_fused", fused)
    monkeypatch.delitem(small.__dict__, "_native_plan", raising=False)
    plan = small._native_step()
    assert plan is not None
    assert all(layer.in_.parts == 1 and layer.gate_up.parts == 1 for layer in plan._layers)
    _assert_same(_decode(small, seqs, True, [[0, 1]]), apart)


@pytest.mark.parametrize("name", ["qwen3_next_dir", "qwen3_5_moe_dir"])
def test_a_model_the_step_does_not_take_keeps_the_layer_path(request, name):
    model = HybridModel.load(request.getfixturevalue(name))
    assert model._native_step() is None
    seqs = _prefilled(model, [7, 19], [64, 64])
    _assert_same(_decode(model, seqs, True, [[0, 1]]), _decode(model, seqs, True, [[0], [1]]))


def test_the_small_model_takes_the_step_only_with_the_native_kernels(small):
    small.__dict__.pop("_native_plan", None)
    assert small._native_step() is not None
    decode.set_native(False)
    assert small._native_step() is None
    native_step.set_enabled(False)
    decode.set_native(True)
    assert small._native_step() is None


def test_a_position_past_the_window_is_refused_before_the_kernel_writes(small):
    """The kernels write a key row at its position unchecked: forward_batch refuses a position
    outside the window on the whole step and on the layer path (as torch's indexing does) and
    leaves the state as it was."""
    seqs = _prefilled(small, [10], [16])
    state = seqs[0][0]
    before = _clone(state)
    for whole in (True, False):
        native_step.set_enabled(whole)
        with torch.inference_mode(), pytest.raises(IndexError):
            small.forward_batch([state], [3], [16])
        _assert_same(([], [state]), ([], [before]))


def _ragged(model, seqs, whole: bool, blocks, verify):
    """One forward_ragged over clones of ``seqs`` with the whole-step call on or off: the
    logits, the steps and the states after."""
    native_step.set_enabled(whole)
    states = [_clone(s) for s, _, _ in seqs]
    with torch.inference_mode():
        logits, steps = model.forward_ragged(states, blocks, [n for _, n, _ in seqs],
                                             verify=verify)
    return [t.clone() for t in logits], steps, states


@pytest.mark.parametrize("shape", ["mixed", "verify only", "one block"])
def test_a_ragged_step_of_decodes_and_verify_blocks_is_the_layer_paths_bits(model, shape,
                                                                           monkeypatch):
    """Speculation's verify blocks beside decodes in one native call (tandem_step_f32, in waves):
    every row's logits, every verify row's steps (the state after each position, in its own
    copy: the sections in place untouched by a block) and every sequence's sections and key
    and value rows after are the layer path's bits (torch.equal), whose verify rows are in turn
    decoding's one by one (tests/models/test_forward_batch.py)."""
    seqs = _prefilled(model, [3, 17, 40, 9], [128] * 4)
    gen = torch.Generator().manual_seed(9)
    draft = lambda k: torch.randint(0, model.vocab_size, (k,), generator=gen).tolist()
    firsts = [t for _, _, t in seqs]
    if shape == "mixed":
        blocks = [[firsts[0]], [firsts[1]] + draft(3), [firsts[2]], [firsts[3]] + draft(1)]
        verify, use = [False, True, False, True], seqs
    elif shape == "verify only":
        blocks = [[firsts[1]] + draft(4), [firsts[2]] + draft(2), [firsts[3]]]
        verify, use = [True, True, True], seqs[1:]
    else:
        blocks, verify, use = [[firsts[2]] + draft(5)], [True], seqs[2:3]
    layered = _ragged(model, use, False, blocks, verify)
    calls = []
    real = native_step.NativeStep.ragged
    monkeypatch.setattr(native_step.NativeStep, "ragged",
                        lambda self, *a: calls.append(len(a[2].rows)) or real(self, *a))
    whole = _ragged(model, use, True, blocks, verify)
    assert calls == [sum(map(len, blocks))], "the native ragged step did not run"
    for a, b in zip(whole[0], layered[0]):
        assert a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(whole[1], layered[1]):
        assert (a is None) == (b is None)
        for name in a or {}:
            assert torch.equal(a[name], b[name]), name
    for x, y in zip(whole[2], layered[2]):
        for name in x.sections:
            assert torch.equal(x.sections[name], y.sections[name]), name
        for name in x.views:
            assert torch.equal(x.views[name].tensor, y.views[name].tensor), name
    for (s, _, _), after, v in zip(use, whole[2], verify):
        if v:  # a verify block leaves its sequence's sections as they were
            for name in s.sections:
                assert torch.equal(after.sections[name], s.sections[name]), name


def test_the_native_steps_rotary_rows_are_step_ropes_bits_from_any_block(small, monkeypatch):
    """Gate: torch.equal. The native step's cos and sin rows come from blocks of ROPE_BLOCK
    positions (HybridModel._native_rope): each row is the bits _step_rope gives it in the
    step's own rows, for one row and for a batch across blocks, at block edges, far out, and
    after older blocks were let go."""
    from tandem.models import hybrid

    monkeypatch.setattr(hybrid, "ROPE_BLOCKS_KEPT", 2)
    small.__dict__.pop("_rope_blocks", None)
    b = hybrid.ROPE_BLOCK
    for turns in ([0], [b - 1], [b], [5, b - 1, b, 3 * b + 7], [40000], [7, 7], [2 * b + 1]):
        want = small._step_rope(turns, len(turns), len(turns))
        got = small._native_rope(turns)
        for w, g in zip(want, got):
            assert g.is_contiguous() and g.dtype == torch.float32
            assert torch.equal(g, w.contiguous()), turns
    assert len(small._rope_blocks) <= 2
