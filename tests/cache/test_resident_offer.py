"""ResidentPrefix.offer (what begin would do, with no side effect), adopt (an outside restore
replaced the rows in place) and shed (the governor takes a level's copies back)."""

import pytest
import torch

from resident_rig import Rig, Uninterrupted, assert_bit_exact, cold, tokens
from tandem.models.third import ThirdModel


@pytest.fixture
def model():
    return ThirdModel()


def _state(rig):
    r = rig.resident
    return (list(rig.engine.token_ids), sorted(r.anchors), r.end and r.end.length,
            dict(rig.memory.held), r.statistics())


def test_offer_says_what_begin_does_and_changes_nothing(model):
    v = model.vocab_size
    rig = Rig(model)
    first = tokens(v, 300, 1)
    _, out = rig.turn(first, session="a")
    cases = [first + out + tokens(v, 20, 2),  # the end anchor
             first[:200] + tokens(v, 90, 3),  # a grid anchor
             tokens(v, 40, 4),  # a guest
             tokens(v, 300, 5)]  # cold
    for prompt in cases:
        before = _state(rig)
        offer = rig.resident.offer(prompt)
        assert _state(rig) == before
        rig_b = Rig(model)
        rig_b.turn(first, session="a")
        assert rig_b.resident.begin(prompt, 16, "a") == offer
        # ...and what begin restored is the state at the offer's row: the prefill that
        # follows has the bits of an engine that never left the conversation (the end) or
        # of a cold prefill (a grid anchor, a guest, cold).
        logits = rig_b.engine.prefill(prompt, on_chunk=rig_b.resident.on_chunk)
        if offer.source == "end":
            plain = Uninterrupted(model)
            plain.turn(first)
            want = plain.engine.prefill(prompt)
            reference = plain.engine
        else:
            reference, want = cold(model, prompt)
        assert torch.equal(logits, want)
        assert_bit_exact(rig_b.engine, reference, len(prompt))
        rig_b.resident.finish()
        if offer.guest:  # the stash put the conversation back: the first rig's state
            assert rig_b.engine.token_ids == rig.engine.token_ids
            assert_bit_exact(rig_b.engine, rig.engine, rig.engine.length)
    assert [rig.resident.offer(p).source for p in cases] == ["end", "resident", "cold", "cold"]
    assert rig.resident.offer(cases[2]).guest


def test_adopt_keeps_anchors_up_to_the_shared_rows_and_drops_the_end(model):
    v = model.vocab_size
    rig = Rig(model)
    first = tokens(v, 300, 1)
    rig.turn(first)
    assert sorted(rig.resident.anchors) == [64, 128, 192, 256] and rig.resident.end
    restored = first[:150] + tokens(v, 100, 2)
    rig.resident.adopt(250, restored)
    assert sorted(rig.resident.anchors) == [64, 128] and rig.resident.end is None
    rig.resident.check_invariants()


def test_adopt_keeps_no_anchor_above_the_restored_rows_taint(model):
    v = model.vocab_size
    rig = Rig(model)
    first = tokens(v, 300, 1)
    rig.turn(first)
    rig.resident.adopt(290, first[:290], taint=100)
    assert sorted(rig.resident.anchors) == [64]


def test_shed_gives_back_a_level_and_keeps_the_others(model):
    v = model.vocab_size
    rig = Rig(model)
    rig.turn(tokens(v, 300, 1))
    held = dict(rig.memory.held)
    one = rig.engine.cache_state().section_nbytes()
    assert rig.resident.shed("anchors", one) == one
    assert len(rig.resident.anchors) == 3 and rig.memory.held["end"] == held["end"]
    assert rig.resident.shed("end", 1) == held["end"] and rig.resident.end is None
    assert rig.resident.shed("anchors", 10 * one) == 3 * one and not rig.resident.anchors
    rig.resident.check_invariants()
