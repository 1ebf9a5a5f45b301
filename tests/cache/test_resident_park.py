"""The parked session: when another session's request replaces the resident prompt, the rows it
overwrites are parked with the newest anchors and the end; a later request that shares more with
the parked prompt swaps it back (the other conversation is parked as it leaves). Grid resumes
are checked bit for bit (gate 1), end resumes by greedy tokens (greedy gate) and by the bits of
the conversation run alone, which forwarded the same inputs on the same chunks."""

import pytest
import torch

from resident_rig import Rig, Uninterrupted, assert_bit_exact, assert_uninterrupted, cold, tokens
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def _two_sessions(model):
    v = model.vocab_size
    head = tokens(v, 130, 20)  # the shared system text: rows [0, 128) stay in place
    a1 = head + tokens(v, 300, 21)
    b1 = head + tokens(v, 280, 22)
    return head, a1, b1


def test_another_session_parks_the_rows_it_overwrites_with_the_end(model):
    _, a1, b1 = _two_sessions(model)
    rig = Rig(model)
    _, out_a = rig.turn(a1, session="a")
    resume_b, out_b = rig.turn(b1, session="b")
    assert (resume_b.source, resume_b.start) == ("resident", 128)
    # Resumed on the grid at the shared anchor: a cold run's tokens and bits.
    assert_uninterrupted(rig.engine, model, [b1], [out_b])
    parked = rig.resident.statistics()["parked"]
    assert parked == {"head": 128, "rows": len(a1) + len(out_a) - 1,
                      "end": len(a1) + len(out_a) - 1}


def test_every_swap_brings_a_conversation_back_at_its_end_with_the_same_tokens(model):
    v = model.vocab_size
    _, a1, b1 = _two_sessions(model)
    rig = Rig(model)
    alone_a, alone_b = Uninterrupted(model), Uninterrupted(model)
    _, out_a1 = rig.turn(a1, session="a")
    _, out_b1 = rig.turn(b1, session="b")
    a2 = a1 + out_a1 + tokens(v, 40, 23)
    resume, out_a2 = rig.turn(a2, session="a")
    assert (resume.source, resume.start) == ("park", len(a1) + len(out_a1) - 1)
    # Greedy gate, and bits: each conversation writes what it writes when served alone.
    assert [alone_a.turn(a1), alone_a.turn(a2)] == [out_a1, out_a2]
    alone_a.assert_same(rig.engine)
    b2 = b1 + out_b1 + tokens(v, 40, 24)
    resume, out_b2 = rig.turn(b2, session="b")  # B was parked as A came back
    assert (resume.source, resume.start) == ("park", len(b1) + len(out_b1) - 1)
    assert [alone_b.turn(b1), alone_b.turn(b2)] == [out_b1, out_b2]
    alone_b.assert_same(rig.engine)
    a3 = a2 + out_a2 + tokens(v, 20, 25)
    resume, out_a3 = rig.turn(a3, session="a")
    assert resume.source == "park"
    assert rig.resident.stats.park_hits == 3
    assert alone_a.turn(a3) == out_a3
    alone_a.assert_same(rig.engine)


def test_a_swap_to_a_parked_grid_anchor_equals_a_cold_prefill_bit_for_bit(model):
    v = model.vocab_size
    rig = Rig(model)
    rig.resident.end_anchor = False  # the park then holds grid anchors only
    _, a1, b1 = _two_sessions(model)
    rig.prefill(a1, session="a")
    rig.prefill(b1, session="b")
    a_edit = a1[:400] + tokens(v, 50, 26)  # parts from A's rows at 400: anchor 384
    resume, logits = rig.prefill(a_edit, session="a")
    assert (resume.source, resume.start) == ("park", 384)
    engine, want = cold(model, a_edit)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(a_edit))


def test_a_compaction_drops_its_sessions_park(model):
    v = model.vocab_size
    _, a1, b1 = _two_sessions(model)
    rig = Rig(model)
    rig.turn(a1, session="a")
    _, out_b = rig.turn(b1, session="b")
    assert rig.resident.parked.session == "a"
    assert_uninterrupted(rig.engine, model, [b1], [out_b])  # resumed at the shared anchor 128
    compacted = tokens(v, 420, 27)
    _, out = rig.turn(compacted, session="a")  # a's compaction replaces b: b is parked
    assert rig.resident.parked.session == "b"
    assert rig.resident.stats.parks == 2
    assert_uninterrupted(rig.engine, model, [compacted], [out])


def test_a_swap_parks_the_leaving_conversation_in_the_returning_ones_buffer(model):
    """When the leaving rows fit the returning park's buffer they are swapped in place (the
    machine never holds both copies); greedy gate for both conversations after two swaps."""
    v = model.vocab_size
    _, a1, b1 = _two_sessions(model)  # B's rows are shorter than A's: they fit A's buffer
    rig = Rig(model)
    alone_a, alone_b = Uninterrupted(model), Uninterrupted(model)
    _, out_a1 = rig.turn(a1, session="a")
    _, out_b1 = rig.turn(b1, session="b")
    buffers = {k: t.data_ptr() for k, t in rig.resident.parked.rows.tensors.items()}
    buffer_nbytes = rig.resident.parked.rows.nbytes
    a2 = a1 + out_a1 + tokens(v, 40, 23)
    resume, out_a2 = rig.turn(a2, session="a")
    assert resume.source == "park"
    assert [alone_a.turn(a1), alone_a.turn(a2)] == [out_a1, out_a2]
    alone_a.assert_same(rig.engine)  # A's rows came back by the in-place swap
    parked = rig.resident.parked
    assert parked.session == "b" and len(parked.token_ids) < len(a1) + len(out_a1)
    assert {k: t.data_ptr() for k, t in parked.rows.tensors.items()} == buffers
    # B's park is counted at A's whole buffer, which it holds (its rows are fewer).
    assert parked.rows.nbytes == buffer_nbytes and rig.memory.held["park"] == parked.nbytes
    b2 = b1 + out_b1 + tokens(v, 40, 24)
    resume, out_b2 = rig.turn(b2, session="b")  # A2's rows are longer: copied, not swapped
    assert resume.source == "park"
    assert [alone_b.turn(b1), alone_b.turn(b2)] == [out_b1, out_b2]
    alone_b.assert_same(rig.engine)  # B's rows came back from A's old buffer
    rig.resident.check_invariants()


def test_a_park_coming_back_over_a_head_tainted_since_is_tainted_there():
    """The park-swap hole (issue 12, part 6): the head [0, head) stays in place when a park
    comes back, so rows there that a decode or a tainted restore wrote after the park was made
    are not the rows its copies were taken over; the returning state must carry that taint,
    not only the park's own (which starts at the parked conversation's first decoded row)."""
    model = ThirdModel()
    _, a1, b1 = _two_sessions(model)
    rig = Rig(model)
    _, out_a1 = rig.turn(a1, session="a")
    rig.turn(b1, session="b")
    assert rig.resident.parked.head == 128 and rig.resident.parked.taint == len(a1)
    # The head's rows in place rewritten since, the same tokens, from row 100 on not a cold
    # prefill's (as a restore of a copy written by decoding leaves them).
    rig.engine.resume_at(rig.engine.length, taint=100)
    resume, _ = rig.turn(a1 + out_a1 + tokens(model.vocab_size, 40, 23), session="a")
    assert resume.source == "park"
    assert rig.engine.taint == 100
