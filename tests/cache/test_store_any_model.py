"""The caches know no model (state-store part): the made-up third architecture, whose two
sections and three views have other shapes and token axes than the hybrid's, goes through the
state store's prefix snapshot (torch.equal with a cold prefill) and session snapshot (greedy
gate) with no edit in the cache code."""

import torch

from resident_rig import assert_bit_exact, cold, tokens, uninterrupted
from store_rig import StoreRig
from tandem.models.third import ThirdModel


def test_the_state_store_serves_the_third_architecture():
    model = ThirdModel()
    v = model.vocab_size
    rig = StoreRig(model)
    state = rig.engine.cache_state()
    assert sorted(state.sections) == ["mix.m", "rnn.h", "tail.x"]
    # prefix snapshot, bit for bit
    first = tokens(v, 300, 1)
    rig.prefill(first)
    rig.prefill(tokens(v, 300, 2))
    second = first[:270] + tokens(v, 50, 3)
    resume, logits = rig.prefill(second)
    assert (resume.source, resume.start) == ("store", 256)
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(second))
    # session snapshot, greedy gate
    turn1 = tokens(v, 150, 4)
    _, out1 = rig.turn(turn1, session="a")
    rig.turn(tokens(v, 200, 5), session="b")
    turn2 = turn1 + out1 + tokens(v, 30, 6)
    resume, out2 = rig.turn(turn2, session="a")
    assert resume.source == "store"
    assert [out1, out2] == uninterrupted(model, [turn1, turn2])
    rig.planner.check_invariants()
