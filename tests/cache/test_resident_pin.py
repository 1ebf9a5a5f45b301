"""The pinned head: a compaction (same session, shares nothing, too long to be a guest) pins the
head of the old prompt; the next turn that shares more with it gets the rows and the largest
pinned anchor back, bit for bit a cold prefill's (gate 1)."""

import pytest
import torch

from resident_rig import Rig, assert_bit_exact, cold, tokens
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def _compact(rig, model, head):
    v = model.vocab_size
    turn1 = head + tokens(v, 300, 11)
    rig.turn(turn1, session="s")
    compaction = tokens(v, 400, 12)  # shares nothing, 400 > 916 / 4: not a guest
    resume, _ = rig.turn(compaction, session="s")
    return turn1, resume


def test_a_compaction_pins_the_head_with_its_anchors_every_four_lines(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1, resume = _compact(rig, model, tokens(v, 600, 10))
    assert resume.source == "cold"
    stats = rig.resident.statistics()
    assert stats["pins"] == 1
    assert stats["pinned_anchors"] == [256, 512, 768]
    assert stats["pinned"] == 768


def test_the_turn_after_a_compaction_gets_the_pinned_head_back_bit_for_bit(model):
    v = model.vocab_size
    rig = Rig(model)
    head = tokens(v, 600, 10)
    _compact(rig, model, head)
    after = head + tokens(v, 100, 13)  # the same system text and tools as every turn before
    resume, logits = rig.prefill(after, session="s")
    assert (resume.source, resume.start) == ("pin", 512)
    engine, want = cold(model, after)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(after))
    assert rig.resident.stats.pin_hits == 1


def test_a_pin_is_only_as_long_as_its_budget_holds(model):
    v = model.vocab_size
    probe = Rig(model)
    state = probe.engine.cache_state()
    one_anchor = state.section_nbytes()
    budget = state.row_nbytes() * 300 + 2 * one_anchor  # room for the head up to 256 only
    rig = Rig(model, pin=budget)
    _compact(rig, model, tokens(v, 600, 10))
    assert rig.resident.statistics()["pinned_anchors"] == [256]
    assert rig.memory.held["pin"] <= budget
