"""Cache namespaces (a request's cache_salt): every tier refuses a copy of another namespace,
whatever tokens the two share, and still serves its own. A request of another namespace is
served cold; a grid resume in its own namespace after another's came and went is a cold
prefill's bit for bit (gate 1: torch.equal on the logits and on every section and view), an end
or session resume holds the greedy gate (the same tokens as the uninterrupted run) and that
run's bits, since it forwarded the same inputs on the same chunks."""

import pytest
import torch

from resident_rig import Rig, assert_bit_exact, assert_uninterrupted, cold, tokens
from store_rig import StoreRig
from tandem.actors.engine_messages import GenerationParams
from tandem.cache.endrecords import EndRecords
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, namespace_of
from tandem.cache.response import CachedResponse, ResponseCache
from tandem.cache.store import StoreCore
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

A = namespace_of("tenant-a")
B = namespace_of("tenant-b")


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def test_a_namespace_is_a_digest_of_the_salt_and_no_salt_is_the_shared_one():
    assert namespace_of(None) == SHARED == ""
    assert namespace_of("tenant-a") == A != B
    assert len(A) == 64 and "tenant-a" not in A


# -- the rows in place: extension, anchors, end ----------------------------------------------


def test_another_namespace_is_offered_nothing_of_the_rows_in_place(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1, namespace=A)
    turn2 = turn1 + out1 + tokens(v, 40, 2)  # extends A's rows past its end anchor
    edit = turn1[:280] + tokens(v, 30, 3)  # parts inside A's rows: A's anchor 256
    assert rig.resident.offer(turn2, A).source == "end"
    assert (rig.resident.offer(edit, A).source, rig.resident.offer(edit, A).start) == \
        ("resident", 256)
    for prompt in (turn2, edit, turn1):
        offer = rig.resident.offer(prompt, B)
        assert (offer.source, offer.start) == ("cold", 0)
        assert rig.resident.offer(prompt, SHARED) == offer  # no salt is a namespace too
    # B's prefill over A's rows starts at row 0 and parks A's rows whole.
    resume, logits = rig.prefill(turn2, namespace=B)
    assert (resume.source, resume.start) == ("cold", 0)
    parked = rig.resident.parked
    assert parked.namespace == A and parked.head == 0
    assert rig.resident.namespace == B
    engine, want = cold(model, turn2)
    assert torch.equal(logits, want)


def test_the_same_session_key_in_another_namespace_is_another_conversation(model):
    """A session key is a conversation, a salt a tenant: the same key under two salts never
    pins (a compaction of one conversation) nor drops the other's park."""
    v = model.vocab_size
    rig = Rig(model)
    rig.turn(tokens(v, 600, 10), session="s", namespace=A)
    rig.turn(tokens(v, 400, 12), session="s", namespace=B)  # shares nothing, same key
    assert rig.resident.pinned is None
    assert rig.resident.parked.namespace == A


# -- the park --------------------------------------------------------------------------------


def test_a_parked_conversation_comes_back_to_its_own_namespace_only_bit_for_bit(model):
    v = model.vocab_size
    rig = Rig(model)
    rig.resident.end_anchor = False  # the park then holds grid anchors only
    a1 = tokens(v, 430, 20)
    rig.prefill(a1, namespace=A)
    rig.prefill(tokens(v, 410, 21), namespace=A)  # another A conversation parks a1
    a_edit = a1[:400] + tokens(v, 50, 26)  # parts from a1's rows at 400: anchor 384
    assert rig.resident.parked.namespace == A
    offer = rig.resident.offer(a_edit, B)
    assert (offer.source, offer.start) == ("cold", 0)
    assert rig.resident.offer(a_edit, A).source == "park"
    resume, logits = rig.prefill(a_edit, namespace=A)
    assert (resume.source, resume.start) == ("park", 384)
    engine, want = cold(model, a_edit)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(a_edit))


def test_a_parked_end_comes_back_to_its_own_namespace_with_the_same_tokens(model):
    v = model.vocab_size
    rig = Rig(model)
    a1 = tokens(v, 300, 20)
    _, out_a1 = rig.turn(a1, namespace=A)
    rig.turn(tokens(v, 280, 21), namespace=B)  # B parks A's rows, end included
    a2 = a1 + out_a1 + tokens(v, 40, 23)
    assert rig.resident.offer(a2, B).source == "cold"
    assert rig.resident.offer(a2, SHARED).source == "cold"
    resume, out_a2 = rig.turn(a2, namespace=A)
    assert (resume.source, resume.start) == ("park", len(a1) + len(out_a1) - 1)
    assert_uninterrupted(rig.engine, model, [a1, a2], [out_a1, out_a2])  # greedy gate and bits


# -- the pinned head -------------------------------------------------------------------------


def test_a_pinned_head_serves_its_own_namespace_only_bit_for_bit(model):
    v = model.vocab_size
    rig = Rig(model)
    head = tokens(v, 600, 10)
    rig.turn(head + tokens(v, 300, 11), session="s", namespace=A)
    rig.turn(tokens(v, 400, 12), session="s", namespace=A)  # a compaction pins A's head
    assert rig.resident.pinned.namespace == A
    after = head + tokens(v, 100, 13)
    offer = rig.resident.offer(after, B)
    assert (offer.source, offer.start) == ("cold", 0)
    # B's own prefill of the very same tokens: cold, its rows in place share A's tokens.
    resume, _ = rig.prefill(after, session="s", namespace=B)
    assert (resume.source, resume.start) == ("cold", 0)
    # A gets its pin back over B's rows: none of them is kept, the pin's rows are copied.
    resume, logits = rig.prefill(after, session="s", namespace=A)
    assert (resume.source, resume.start) == ("pin", 512)
    engine, want = cold(model, after)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(after))


# -- the guest stash -------------------------------------------------------------------------


def test_a_guest_of_another_namespace_starts_cold_and_the_rows_come_back(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 700, 1)
    _, out1 = rig.turn(turn1, namespace=A)
    guest = turn1[:140] + tokens(v, 30, 2)  # short, shares A's anchor 128
    assert rig.resident.offer(guest, A).start == 128
    offer = rig.resident.offer(guest, B)
    assert offer.guest and (offer.source, offer.start) == ("cold", 0)
    resume, _ = rig.turn(guest, namespace=B, max_tokens=4)
    assert resume.guest and (resume.source, resume.start) == ("cold", 0)
    assert rig.resident.namespace == A  # the stash put A's rows back
    turn2 = turn1 + out1 + tokens(v, 20, 3)
    resume, out2 = rig.turn(turn2, namespace=A)
    assert resume.source == "end"
    assert_uninterrupted(rig.engine, model, [turn1, turn2], [out1, out2])


# -- the end records and their alignment -----------------------------------------------------


def test_a_copy_is_aligned_with_its_own_namespaces_end_records_only(model):
    v = model.vocab_size
    rig = Rig(model)
    held = []
    ends = EndRecords(rig.resident, lambda t: b"t%d" % t,
                      holds=lambda rows, ns: held.append(ns) or True)
    a1 = tokens(v, 300, 1)
    _, out = rig.turn(a1, namespace=A)
    ends.remember(a1, out, [])
    copy = a1 + out + tokens(v, 20, 2)
    assert ends.align(copy, A).mode == "exact"
    assert ends.align(copy, B) is None and ends.align(copy) is None
    # Parked by B, the record follows the park and still aligns A's copy only.
    parked_before = rig.resident.parked
    b1 = tokens(v, 280, 3)
    _, out_b = rig.turn(b1, namespace=B)
    ends.follow_park(parked_before, False)
    ends.remember(b1, out_b, [])
    assert ends.align(copy, A).mode == "exact"
    assert ends.align(copy, SHARED) is None
    # A third conversation takes the park: A's recent record is met against the store, in
    # A's namespace, and never for another.
    parked_before = rig.resident.parked
    rig.turn(tokens(v, 260, 4), namespace=SHARED)
    ends.follow_park(parked_before, False)
    assert ends.align(copy, B) is None and held == []
    assert ends.align(copy, A).mode == "exact" and held == [A]


# -- the state store -------------------------------------------------------------------------


@pytest.fixture
def hybrid(qwen3_5_dir):
    return HybridModel.load(qwen3_5_dir)


def test_a_prefix_snapshot_serves_its_own_namespace_only_bit_for_bit(hybrid):
    v = hybrid.vocab_size
    rig = StoreRig(hybrid)
    first = tokens(v, 300, 1)
    rig.prefill(first, namespace=A)
    rig.prefill(tokens(v, 300, 2), namespace=A)  # replaces the rows in place (no park)
    second = first[:280] + tokens(v, 60, 3)
    assert rig.store.offer(second, B) == (0, None)
    resume, _ = rig.prefill(second, namespace=B)
    assert (resume.source, resume.start) == ("cold", 0)
    # B's prefill wrote its own snapshot of the same 256 tokens beside A's.
    assert rig.store.statistics()["prefix_entries"] == 3
    third = first[:280] + tokens(v, 50, 4)
    resume, logits = rig.prefill(third, namespace=A)
    assert (resume.source, resume.start) == ("store", 256)
    engine, want = cold(hybrid, third)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(third))
    assert rig.core.stats.prefix_hits == 1
    rig.planner.check_invariants()


def test_a_session_snapshot_serves_its_own_namespace_only_greedy_equal(hybrid):
    v = hybrid.vocab_size
    rig = StoreRig(hybrid)
    turn1 = tokens(v, 200, 1)
    _, out1 = rig.turn(turn1, session="a", namespace=A)
    rig.turn(tokens(v, 250, 2), session="b", namespace=A)  # replaces a's rows and end
    turn2 = turn1 + out1 + tokens(v, 40, 3)
    key = turn1 + out1[:-1]
    assert rig.store.holds(key, A) and not rig.store.holds(key, B)
    assert not rig.store.holds(key)
    resume, _ = rig.turn(turn2, session="a", namespace=B)
    assert (resume.source, resume.start) == ("cold", 0)
    resume, out2 = rig.turn(turn2, session="a", namespace=A)
    assert (resume.source, resume.start) == ("store", len(key))
    assert_uninterrupted(rig.engine, hybrid, [turn1, turn2], [out1, out2])


def test_a_store_entry_of_the_same_tokens_in_another_namespace_is_a_miss_on_one_hash(hybrid):
    """Every key forced onto one hash: the bucket and the compare both hold the namespace."""
    v = hybrid.vocab_size
    rig = StoreRig(hybrid, hash_fn=lambda ids: 7)
    prompt = tokens(v, 300, 1)
    rig.prefill(prompt, namespace=A)
    longer = prompt + tokens(v, 10, 2)
    for ns in (B, SHARED):
        assert rig.core.offer(longer, ns) == (0, None)
    start, entry = rig.core.offer(longer, A)
    assert start == 256 and entry.namespace == A
    rig.core.release(entry, False)
    with pytest.raises(ValueError):
        rig.store.restore(rig.core.offer(longer, A)[1], longer, B)
    rig.core.check_invariants()


def test_a_store_core_keeps_one_entry_a_namespace_for_the_same_tokens():
    from tandem.cache.copies import RowsCopy, SectionsCopy
    from tandem.cache.store import StoreEntry, token_hash

    core = StoreCore(MemoryAccountant({"store": 1 << 20}), entry_nbytes=1 << 20)
    key = [1, 2, 3]

    def entry(ns):
        return StoreEntry(key, "prefix", SectionsCopy({}), RowsCopy(0, 3, {}), None, 10,
                          token_hash(key), ns)

    assert core.admit(key, "prefix", 10, A) == "reserved"
    core.insert(entry(A))
    assert core.admit(key, "prefix", 10, B) == "reserved"  # A's entry is not B's
    core.insert(entry(B))
    assert core.admit(key, "prefix", 10, A) == "held"
    assert core.holds(key, A) and core.holds(key, B) and not core.holds(key)
    assert len(core) == 2
    core.check_invariants()


# -- the response cache ----------------------------------------------------------------------


def test_the_response_cache_answers_its_own_namespace_only():
    cache = ResponseCache(1 << 20)
    greedy = GenerationParams(max_tokens=4)
    answer = CachedResponse(((5, False),), finished={})
    assert cache.put([1, 2, 3], greedy, [], answer, A)
    assert cache.lookup([1, 2, 3], greedy, [], A) is answer
    assert cache.lookup([1, 2, 3], greedy, [], B) is None
    assert cache.lookup([1, 2, 3], greedy) is None
    assert cache.put([1, 2, 3], greedy, [], answer)
    assert cache.lookup([1, 2, 3], greedy) is answer
    cache.check_invariants()
