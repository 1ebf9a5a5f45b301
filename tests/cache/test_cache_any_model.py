"""The caches know no model (resident part): the made-up third architecture, whose two
sections and three views have other shapes and token axes than the hybrid's, runs through grid
anchors, the end anchor, the guest stash, the pinned head and the parked session with no edit in
the cache code. Grid resumes are held to torch.equal, end resumes to the greedy gate."""

import torch

from resident_rig import Rig, assert_bit_exact, cold, tokens, uninterrupted
from tandem.models.third import ThirdModel


def test_the_third_architecture_has_other_sections_and_token_axes():
    state = Rig(ThirdModel()).engine.cache_state()
    assert sorted(state.sections) == ["mix.m", "rnn.h", "tail.x"]
    assert {name: v.token_axis for name, v in state.views.items()} == {
        "keys": 0, "vals": 1, "gate": 1}


def test_every_resident_part_serves_the_third_architecture():
    model = ThirdModel()
    v = model.vocab_size
    rig = Rig(model)
    head = tokens(v, 130, 1)
    a1 = head + tokens(v, 500, 2)
    # grid anchors, bit for bit
    _, out_a1 = rig.turn(a1, session="a")
    edit = a1[:300] + tokens(v, 40, 3)
    resume, logits = rig.prefill(edit, session="a")
    assert (resume.source, resume.start) == ("resident", 256)
    engine, want = cold(model, edit)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(edit))
    # the end anchor, with a guest between two turns
    _, out_e = rig.turn(edit, session="a")
    resume, _ = rig.turn(tokens(v, 30, 4))
    assert resume.guest
    nxt = edit + out_e + tokens(v, 20, 5)
    resume, out_n = rig.turn(nxt, session="a")
    assert resume.source == "end"
    assert [out_e, out_n] == uninterrupted(model, [edit, nxt])
    # another session parks it; it comes back at its end
    resume, _ = rig.turn(head + tokens(v, 400, 6), session="b")
    assert rig.resident.parked.session == "a"
    back = nxt + out_n + tokens(v, 10, 7)
    resume, out_back = rig.turn(back, session="a")
    assert resume.source == "park"
    assert out_back == uninterrupted(model, [edit, nxt, back])[2]
    # a compaction pins the head (up to 256, below the first row decoding wrote, 340); the
    # next turn gets it back, bit for bit
    rig.turn(tokens(v, 300, 8), session="a")
    assert sorted(rig.resident.pinned.anchors) == [256] and rig.resident.pinned.taint is None
    after = back[:300] + tokens(v, 30, 9)
    resume, logits = rig.prefill(after, session="a")
    assert (resume.source, resume.start) == ("pin", 256)
    assert rig.engine.taint is None
    engine, want = cold(model, after)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(after))
