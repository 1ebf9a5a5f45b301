"""A turn that forwards no generated token (max_tokens 1, or a stop as its first token) leaves
the rows at the prompt's end, off the grid; the next turn's prefill resumes there, so its chunk
to the next line is not a cold prefill's and nothing it writes from that row on is bit-exact.
Taint marks that row: an anchor above it holds the greedy gate, one at or below it is still a
cold grid prefill's bit for bit. Gates: torch.equal where a resume is reported bit-exact (a grid
anchor at or below taint), identical greedy tokens above taint."""

import pytest
import torch

from resident_rig import CHUNK, Rig, assert_bit_exact, cold, tokens
from tandem.engine import Engine, SamplingParams
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

FIRST = 7  # the first token the turns that end at once are made to pick (logit_bias)


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def _no_token_turn(rig: Rig, prompt: list[int], ending: str):
    """A turn that forwards no generated token: one token wanted, or a first token that is a
    stop (its greedy pick is forced by logit_bias)."""
    if ending == "max_tokens":
        params = SamplingParams(max_tokens=1)
    else:
        params = SamplingParams(max_tokens=16, logit_bias=((FIRST, 100.0),),
                                stop_token_ids=(FIRST,))
    resume = rig.resident.begin(prompt, params.max_tokens)
    result = rig.engine.generate(prompt, params, on_chunk=rig.resident.on_chunk)
    rig.resident.finish(prompt + result.token_ids)
    rig.resident.check_invariants()
    assert rig.engine.length == len(prompt)  # nothing generated was forwarded
    return resume, result


def _prefill_checked(rig: Rig, model, prompt: list[int]):
    """begin and prefill; a resume reported bit-exact (a grid anchor at or below taint) must be
    a cold prefill's logits, state and rows, bit for bit."""
    resume = rig.resident.begin(prompt, 16)
    taint = rig.engine.taint
    exact = resume.source in ("resident", "pin") and (taint is None or taint >= resume.start)
    logits = rig.engine.prefill(prompt, on_chunk=rig.resident.on_chunk)
    rig.resident.finish()
    rig.resident.check_invariants()
    if exact:
        engine, want = cold(model, prompt)
        assert torch.equal(logits, want)
        assert_bit_exact(rig.engine, engine, len(prompt))
    return resume, logits, exact


@pytest.mark.parametrize("ending", ["max_tokens", "stop"])
def test_a_resume_at_a_prompts_end_off_the_grid_marks_taint_there(model, ending):
    v = model.vocab_size
    rig = Rig(model)
    p1 = tokens(v, 130, 1)
    _, r1 = _no_token_turn(rig, p1, ending)
    assert r1.finish_reason == ("length" if ending == "max_tokens" else "stop")
    assert rig.engine.taint is None  # a cold prefill's rows, every one
    p2 = p1 + tokens(v, 90, 2)
    resume, _ = _no_token_turn(rig, p2, ending)
    assert (resume.source, resume.start) == ("end", 130)
    assert rig.engine.taint == 130  # 130 is no grid line: [130, 192) is not a cold chunk
    assert sorted(rig.resident.anchors) == [64, 128, 192]

    # The third prompt parts from the rows after line 192: resumed at the anchor there, which
    # the off-grid chunk wrote, so it is above taint and held to the greedy gate.
    p3 = p2[:200] + tokens(v, 60, 3)
    resume, logits, exact = _prefill_checked(rig, model, p3)
    assert (resume.source, resume.start) == ("resident", 3 * CHUNK)
    assert not exact and rig.engine.taint == 130
    plain = Engine(model, window=2048, prefix_chunk=CHUNK)  # the same chunks, uninterrupted
    plain.prefill(p1)
    plain.prefill(p2[:3 * CHUNK])
    assert torch.argmax(logits) == torch.argmax(plain.prefill(p3))

    # A prompt parting below taint resumes at the grid anchor under it, a cold prefill's.
    p4 = p2[:150] + tokens(v, 40, 4)
    resume, _, exact = _prefill_checked(rig, model, p4)
    assert (resume.source, resume.start) == ("resident", 2 * CHUNK)
    assert exact and rig.engine.taint is None


def test_an_off_grid_anchor_is_not_a_cold_prefills(qwen3_5_dir):
    """Why taint must be set: on the hybrid the anchor the off-grid chunk took differs from a
    cold prefill's state at that line (which a resume reported bit-exact would have to equal;
    the third model's arithmetic happens not to depend on where a chunk starts)."""
    model = HybridModel.load(qwen3_5_dir)
    v = model.vocab_size
    rig = Rig(model)
    p1 = tokens(v, 130, 1)
    _no_token_turn(rig, p1, "max_tokens")
    p2 = p1 + tokens(v, 90, 2)
    _no_token_turn(rig, p2, "max_tokens")
    engine, _ = cold(model, p2[:3 * CHUNK])
    anchor = rig.resident.anchors[3 * CHUNK].tensors
    live = engine.cache_state().sections
    assert any(not torch.equal(anchor[name], live[name]) for name in live)


def test_a_resume_on_a_grid_line_leaves_taint_unset(model):
    v = model.vocab_size
    rig = Rig(model)
    p1 = tokens(v, 2 * CHUNK, 1)
    _no_token_turn(rig, p1, "max_tokens")
    p2 = p1 + tokens(v, 90, 2)
    resume, _ = _no_token_turn(rig, p2, "max_tokens")
    assert (resume.source, resume.start) == ("end", 2 * CHUNK)
    assert rig.engine.taint is None
    p3 = p2[:200] + tokens(v, 60, 3)
    _, _, exact = _prefill_checked(rig, model, p3)
    assert exact


def test_a_pin_swapped_in_over_off_grid_rows_puts_its_own_rows_back(model):
    """The pin comes back over rows in place that share its tokens but were written after an
    off-grid resume (taint 130): those rows, and the anchor over them, are not its cold rows,
    so the pin's copies replace them from the grid line under taint, and a resume reported
    bit-exact there is a cold prefill's."""
    v = model.vocab_size
    rig = Rig(model)
    x = tokens(v, 300, 1)
    rig.prefill(x, session="a")  # cold, anchors up to 256
    rig.prefill(tokens(v, 100, 9), session="a")  # a compaction: the head up to 256 is pinned
    assert rig.resident.pinned is not None and 4 * CHUNK in rig.resident.pinned.anchors
    for prompt in (x[:130], x[:200]):  # one token each: the second resumes at 130, off grid
        resume = rig.resident.begin(prompt, 1, "a")
        rig.engine.generate(prompt, SamplingParams(max_tokens=1), on_chunk=rig.resident.on_chunk)
        rig.resident.finish()
    assert (resume.source, rig.engine.taint) == ("end", 130)
    resume, _, exact = _prefill_checked(rig, model, x[:280] + tokens(v, 20, 3))
    assert (resume.source, resume.start) == ("pin", 4 * CHUNK)
    assert exact or rig.engine.taint is not None
    # The anchor at 192 the off-grid chunk took went with those rows.
    resume, _, exact = _prefill_checked(rig, model, x[:195] + tokens(v, 20, 4))
    assert resume.start != 3 * CHUNK or exact
