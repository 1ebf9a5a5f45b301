"""Placement (tandem/cache/slots.py): the slot of the request's session, else one it continues
(its rows, its end anchor, its prompt end, the park made from it), else the one whose rows it
shares most (a branch of that conversation), else an empty slot, else the least recently used.
Pure: the slots' holdings are built as the server builds them, with fake rows."""

import pytest
import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.holdings import make_holdings
from tandem.cache.memory import MemoryAccountant, Share, check_shares
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.slots import SlotFacts, place
from tandem.models.base import CacheState

CHUNK = 64


def _memory() -> MemoryAccountant:
    return MemoryAccountant({"anchors": 1 << 30, "end": 1 << 30, "prompt_end": 1 << 30,
                             "stash": 1 << 30})


def _state() -> CacheState:
    return CacheState(sections={"s": torch.zeros(4)}, views={})


def _slots(n: int = 4):
    shared = _memory()
    shares = [Share(shared) for _ in range(n)]
    return shared, shares, [make_holdings(share, CHUNK)[0] for share in shares]


def _facts(held, rows, used=None):
    return [SlotFacts(i, rows[i], h, used[i] if used else 0) for i, h in enumerate(held)]


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_one_slot_always_places_there():
    _, _, held = _slots(1)
    placed = place(_ids(0, 10), None, SHARED, _facts(held, [_ids(500, 300)]), CHUNK)
    assert (placed.slot, placed.why) == (0, "only")


def test_a_request_goes_to_the_slot_of_its_session_whatever_it_shares():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    held[1].session = "ses_b"
    # It shares 300 rows with slot 0 and nothing with slot 1: its session decides.
    placed = place(_ids(0, 300) + _ids(9000, 5), "ses_b", SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "session")


def test_another_namespace_never_takes_a_slot_by_its_session_key():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    held[1].session = "ses_b"
    placed = place(_ids(1000, 310), "ses_b", Namespace("salt-x"), _facts(held, rows), CHUNK)
    assert placed.why == "empty" and placed.slot == 2


def test_a_prompt_that_extends_a_slot_s_rows_goes_there():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    placed = place(_ids(1000, 300) + _ids(7, 20), None, SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "continues")
    assert placed.offer.resume.start == 300 and placed.offer.continuing


def test_a_prompt_at_a_slot_s_end_anchor_goes_there():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    held[1].ends.keep(290, _state())  # the end of the last answer, below the rows' end
    prompt = _ids(1000, 290) + _ids(5, 30)
    placed = place(prompt, None, SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "continues")
    assert placed.offer.resume.source == "end"


def test_a_branch_of_a_conversation_goes_to_its_slot():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    held[1].anchors.add(192, SectionsCopy.take(_state()))
    # An edit of the conversation's last message: it shares 200 of its 300 rows.
    placed = place(_ids(1000, 200) + _ids(5, 40), None, SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "shares")
    assert placed.offer.resume.start == 192


def test_a_new_conversation_sharing_a_system_prompt_takes_an_empty_slot():
    """It shares a head of 100 rows with a conversation of 300: not a branch of it."""
    _, _, held = _slots()
    rows = [_ids(0, 300), [], [], []]
    placed = place(_ids(0, 100) + _ids(5000, 50), None, SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "empty")


def test_a_guest_takes_an_empty_side_slot_and_needs_no_stash():
    """A prompt under a quarter of the conversation in place would stash it in one slot;
    with an empty slot it is a request like any other there."""
    _, _, held = _slots()
    rows = [_ids(0, 2000), [], [], []]
    placed = place(_ids(9000, 40), None, SHARED, _facts(held, rows), CHUNK)
    assert (placed.slot, placed.why) == (1, "empty")
    assert not placed.offer.resume.guest


def test_with_every_slot_taken_the_least_recently_used_goes():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), _ids(2000, 300), _ids(3000, 300)]
    placed = place(_ids(9000, 300), None, SHARED, _facts(held, rows, used=[4, 2, 1, 3]),
                   CHUNK)
    assert (placed.slot, placed.why) == (2, "lru")


def test_a_short_prompt_with_every_slot_taken_keeps_the_least_recently_used_as_its_own():
    """Under a quarter of every conversation in place, it would be a guest over any one (and
    keep nothing); with several slots it takes the least recently used as no guest (that
    conversation leaves for the park) and says so to the engine's offers (guest_ok). With one
    slot the resident stays protected: a guest."""
    _, _, held = _slots()
    rows = [_ids(0, 2000), _ids(3000, 2000), _ids(6000, 2000), _ids(9000, 2000)]
    short = _ids(20000, 40)
    placed = place(short, None, SHARED, _facts(held, rows, used=[4, 2, 1, 3]), CHUNK)
    assert (placed.slot, placed.why) == (2, "lru")
    assert not placed.offer.resume.guest and not placed.guest_ok
    _, _, one = _slots(1)
    alone = place(short, None, SHARED, _facts(one, rows[:1]), CHUNK)
    assert alone.offer.resume.guest and alone.guest_ok


def test_a_conversation_going_on_from_a_guest_in_its_sessions_slot_is_no_guest():
    """A short prompt of the session whose long conversation holds a slot is a guest there
    (its stash keeps that conversation); ``guests`` False (the prompt goes on from a recent
    guest's, tandem/actors/tiers.py): the same request is no guest, in the same slot; with one
    slot the resident stays protected and it is a guest still."""
    _, _, held = _slots()
    held[1].session = "ses_s"
    rows = [_ids(0, 900), _ids(1000, 900), _ids(2000, 900), _ids(3000, 900)]
    facts = _facts(held, rows, used=[3, 1, 2, 4])
    short = _ids(9000, 40)
    first = place(short, "ses_s", SHARED, facts, CHUNK)
    again = place(short, "ses_s", SHARED, facts, CHUNK, guests=False)
    assert (first.slot, first.why, first.offer.resume.guest) == (1, "session", True)
    assert (again.slot, again.why, again.offer.resume.guest) == (1, "session", False)
    assert first.guest_ok and not again.guest_ok
    _, _, one = _slots(1)
    alone = place(short, None, SHARED, _facts(one, rows[:1]), CHUNK, guests=False)
    assert alone.offer.resume.guest


def test_the_parked_conversation_comes_back_to_the_slot_it_left():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    placed = place(_ids(0, 64) + _ids(4000, 200), None, SHARED, _facts(held, rows), CHUNK,
                   park_slot=0, park_point=250)
    assert (placed.slot, placed.why) == (0, "park")
    # Its session key finds it there too, before any empty slot.
    placed = place(_ids(7000, 200), "ses_p", SHARED, _facts(held, rows), CHUNK, park_slot=0,
                   park_point=150, park_session="ses_p")
    assert (placed.slot, placed.why) == (0, "park")


def test_a_short_parked_conversation_comes_back_as_no_guest():
    """Under a quarter of the conversation that took its slot, it would be a guest there and
    the park, behind the resident's decisive offer, never asked: it comes back instead."""
    _, _, held = _slots()
    rows = [_ids(0, 2000), _ids(3000, 2000), _ids(6000, 2000), _ids(9000, 2000)]
    short = _ids(0, 64) + _ids(20000, 60)
    guest = place(short, None, SHARED, _facts(held, rows, used=[4, 2, 1, 3]), CHUNK)
    assert guest.why == "lru"
    placed = place(short, None, SHARED, _facts(held, rows, used=[4, 2, 1, 3]), CHUNK,
                   park_slot=0, park_point=120)
    assert (placed.slot, placed.why) == (0, "park")
    assert not placed.offer.resume.guest and not placed.offer.decisive and not placed.guest_ok


def test_the_slots_share_one_budget_and_each_counts_its_part():
    shared, shares, held = _slots()
    held[0].anchors.add(64, SectionsCopy.take(_state()))
    held[2].anchors.add(64, SectionsCopy.take(_state()))
    held[2].anchors.add(128, SectionsCopy.take(_state()))
    check_shares(shared, shares)
    assert shares[0].held["anchors"] * 3 == shared.held["anchors"]
    for h, n in zip(held, (1, 0, 2, 0)):
        h.check_invariants(_ids(0, 200))
        assert len(h.anchors.copies) == n
    shared.budgets["anchors"] = shared.held["anchors"]  # full: nobody takes more
    assert not shares[1].reserve("anchors", 1)
    with pytest.raises(AssertionError):
        shares[1].release("anchors", 1)  # a part never gives back what it does not hold


# -- side requests (tandem/server/side.py) --------------------------------------------------


def test_a_side_request_takes_an_empty_slot_as_a_guest_whatever_it_shares_or_its_session():
    _, _, held = _slots()
    rows = [_ids(0, 300), _ids(1000, 300), [], []]
    held[0].session = "chat"
    # Longer than the chat, extending slot 0's rows, with the chat's session: an empty slot
    # still, and a guest there (it keeps nothing).
    placed = place(_ids(0, 300) + _ids(9000, 400), "chat", SHARED,
                   _facts(held, rows, used=[4, 3, 2, 1]), CHUNK, side=True)
    assert (placed.slot, placed.why) == (3, "side")
    assert placed.offer.resume.guest and placed.offer.decisive


def test_a_side_request_with_no_empty_slot_never_takes_its_chat_s_slot():
    _, _, held = _slots(3)
    rows = [_ids(0, 300), _ids(1000, 300), _ids(2000, 300)]
    held[0].session = "chat"
    # Slot 0 is the least recently used, but it holds the request's own chat.
    placed = place(_ids(9000, 700), "chat", SHARED, _facts(held, rows, used=[1, 3, 2]), CHUNK,
                   side=True)
    assert (placed.slot, placed.why) == (2, "side") and placed.offer.resume.guest


def test_a_side_request_without_a_session_spares_the_slot_placed_last():
    _, _, held = _slots(2)
    rows = [_ids(0, 300), _ids(1000, 300)]
    placed = place(_ids(9000, 700), None, SHARED, _facts(held, rows, used=[1, 2]), CHUNK,
                   side=True)
    assert placed.slot == 0
    placed = place(_ids(9000, 700), None, SHARED, _facts(held, rows, used=[2, 1]), CHUNK,
                   side=True)
    assert placed.slot == 1


def test_a_side_request_beside_only_its_chat_s_slot_runs_there_as_a_guest():
    _, _, held = _slots(4)
    held[2].session = "chat"
    # The other slots are lent to running requests: only the chat's is offered.
    facts = [SlotFacts(2, _ids(0, 300), held[2], 5)]
    placed = place(_ids(9000, 700), "chat", SHARED, facts, CHUNK, side=True)
    assert placed.slot == 2 and placed.offer.resume.guest
