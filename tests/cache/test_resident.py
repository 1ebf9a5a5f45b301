"""Grid anchors (gate 1, bit-exact) and guests between turns (greedy gate for the end anchor
they leave intact)."""

import pytest
import torch

from resident_rig import Rig, assert_bit_exact, assert_uninterrupted, cold, tokens
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def test_an_anchor_is_taken_at_every_grid_line_the_prefill_passes(model):
    rig = Rig(model)
    rig.prefill(tokens(model.vocab_size, 300, 1))
    assert sorted(rig.resident.anchors) == [64, 128, 192, 256]


def test_a_prompt_parting_from_the_rows_resumes_at_the_largest_anchor_below_bit_for_bit(model):
    rig = Rig(model)
    first = tokens(model.vocab_size, 300, 1)
    rig.prefill(first)
    second = first[:200] + tokens(model.vocab_size, 150, 2)
    resume, logits = rig.prefill(second)
    assert (resume.start, resume.source) == (192, "resident")
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(second))


def test_a_prompt_extending_the_rows_in_place_forwards_only_what_is_new(model):
    rig = Rig(model)
    first = tokens(model.vocab_size, 130, 1)
    rig.prefill(first)
    second = first + tokens(model.vocab_size, 90, 3)
    resume, logits = rig.prefill(second)
    assert resume.start == 130
    engine, want = cold(model, second)
    # 130 is no grid line: the extension forwards [130, 192) where a cold run forwards [128,
    # 192), so this resume is held to the greedy gate, not to bits.
    assert torch.argmax(logits) == torch.argmax(want)


def test_the_anchor_budget_keeps_the_newest_four_and_the_pin_keepers(model):
    rig = Rig(model)
    nbytes = rig.engine.cache_state().section_nbytes()
    rig = Rig(model, anchors=7 * nbytes)
    rig.prefill(tokens(model.vocab_size, 64 * 12 + 10, 4))
    lines = sorted(rig.resident.anchors)
    assert len(lines) == 7
    assert lines[-4:] == [64 * 9, 64 * 10, 64 * 11, 64 * 12]
    assert {256, 512} <= set(lines)  # every 4 lines up to 32: kept for a pin
    assert rig.resident.stats.anchor_evictions == 5


def test_a_guest_between_two_turns_costs_the_conversation_nothing(model):
    v = model.vocab_size
    turn1 = tokens(v, 600, 5)
    guest = tokens(v, 40, 6)
    rig = Rig(model)
    _, out1 = rig.turn(turn1, session="a")
    resume_g, _ = rig.turn(guest)
    assert resume_g.guest and rig.resident.stats.guests == 1
    turn2 = turn1 + out1 + tokens(v, 30, 7)
    resume, out2 = rig.turn(turn2, session="a")
    assert (resume.source, resume.start) == ("end", len(turn1) + len(out1) - 1)
    # Greedy gate, and the bits of a run with no guest at all: the guest's rows and sections
    # were put back whole.
    assert_uninterrupted(rig.engine, model, [turn1, turn2], [out1, out2])
    assert rig.memory.held["stash"] == 0


def test_a_refused_stash_cuts_the_rows_at_the_guests_start(model):
    v = model.vocab_size
    rig = Rig(model, stash=1)
    turn1 = tokens(v, 600, 5)
    rig.turn(turn1, session="a")
    resume, _ = rig.turn(tokens(v, 40, 6))
    assert resume.source == "cold" and rig.resident.stats.guest_refused == 1
    assert rig.memory.refused["stash"] == 1
