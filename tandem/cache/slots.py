"""Slots: several conversations in place at once (spec: side slots, ``--parallel N``).

Each slot is a sequence of its own in the engine (rows, recurrent sections, conv tails, taint)
with its own resident holdings (grid anchors, end and prompt-end anchors, end records, the guest
stash); the park, the pin and the store are shared. Placement is a pure function of what each
slot holds, made by the resident actor when it answers a job's offer:

1. the slot that holds the request's session (its session key, same namespace);
2. else a slot the prompt continues: its offer there is the rows in place, the end anchor or the
   prompt-end anchor, its client's copy aligns with the slot's end record, or the parked
   conversation made from that slot would come back;
3. else the slot whose rows it shares most, when that is at least a grid line and at least
   half of the slot's rows (a branch of that conversation: an edit, a regenerate); the rest of
   its rows go to the park as a leaving conversation's do;
4. else an idle slot: an empty one first, else the least recently used.

A guest (a short prompt beside a long conversation) thus takes an empty side slot and needs no
stash. Where every slot holds a conversation, the least recently used one's leaves for the park
(as a replaced prompt's does) and the new prompt is no guest there whatever its length: it keeps
its slot, and resumes at its own end from its next turn. (A guest keeps nothing: stashed over a
conversation, a new one re-read itself whole at its next turn, 870 tokens a turn in
scripts/bench_slots.py's figure c.) A short conversation beside a long one thus keeps its own
slot and resumes at its own end every turn. A guest with several slots is a short prompt placed
in its own session's slot, over that conversation's stash; its next turn (a prompt that goes on
from a recent guest's, ``guests`` False) is no guest. With one slot the resident stays
protected: a short conversation there is a guest every turn, as the spec's single engine has it.

A side request (tandem/server/side.py: Open WebUI's title, tags and follow-ups, often longer
than the chat they are about) is placed by its own rule, before every other, and runs as a
guest whatever its length, so it keeps nothing (no rows, anchor, end or prompt-end anchor, park
or store snapshot) wherever it runs:

- an empty slot (no rows, no end), the least recently used one;
- else the least recently used slot that does not hold its own session. Its conversation's
  rows are stashed and put back after it, so "least valuable" only decides whose rows wait
  under it (and are cut should the stash be refused): the one left longest ago, never the
  chat the request belongs to, nor (without a session key) the one placed last, which is the
  chat the client asks about whenever another slot is there;
- else its session's slot (the only one idle), as a guest over the stash.

A side request does not make its slot more recently used (the resident actor's clock).

Idle work (the compaction preparer's continuation, ``own_slot``) is a side request that goes
on from its own conversation: it is placed in its session's slot, as a guest over that slot's
stash, and takes the side rule only when no slot holds its session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from tandem.cache.holdings import ResidentHoldings, ResidentOffer, resident_offer
from tandem.cache.namespace import Namespace

Why = Literal["only", "session", "continues", "park", "shares", "empty", "lru", "side"]


@dataclass(frozen=True)
class SlotFacts:
    """What placement reads of one slot: its rows' tokens, its holdings, when it was last
    placed (a logical clock), and whether its end record aligns the client's copy."""

    index: int
    rows: Sequence[int]
    holdings: ResidentHoldings
    used: int = 0
    aligned: bool = False


@dataclass(frozen=True)
class Placement:
    slot: int
    why: Why
    offer: ResidentOffer
    guest_ok: bool = True  # False: no guest in that slot (the engine's offers again say so)


def place(prompt: Sequence[int], session: str | None, namespace: Namespace,
          slots: Sequence[SlotFacts], chunk: int, *, park_slot: int | None = None,
          park_point: int = 0, park_session: str | None = None,
          side: bool = False, own_slot: bool = False, guests: bool = True) -> Placement:
    """The slot a request goes to, and the resident's offer there (module docstring).

    ``park_slot``: the slot the parked conversation was parked from, ``park_point`` where the
    park's offer resumes the prompt over that slot's rows (0: it does not), ``park_session``
    the parked conversation's session key; ``side``: a side request; ``own_slot``: one
    placed in its session's slot (idle work); ``guests`` False: the prompt is no guest in any
    slot (it goes on from a recent guest's), where there are several."""
    prompt = list(prompt)
    guest_ok = guests or len(slots) == 1
    offers = {s.index: resident_offer(s.holdings, prompt, namespace, s.rows, side=side,
                                      guest_ok=guest_ok)
              for s in slots}
    if len(slots) == 1:
        return Placement(slots[0].index, "only", offers[slots[0].index], guest_ok)
    if side:
        own = [s for s in slots if own_slot and session is not None and s.rows
               and s.holdings.session == session and s.holdings.namespace == namespace]
        best = own[0] if own else _side_slot(slots, session, namespace)
        return Placement(best.index, "side", offers[best.index], guest_ok)
    indices = {s.index for s in slots}
    if session is not None:
        for s in slots:
            if s.holdings.session == session and s.holdings.namespace == namespace and s.rows:
                return Placement(s.index, "session", offers[s.index], guest_ok)
        if (park_slot in indices and park_session == session and park_point > 0):
            return _comes_back(park_slot, prompt, namespace, slots, offers)
    continuing = [s for s in slots if s.rows and _continues(offers[s.index], s)]
    if continuing:
        best = max(continuing, key=lambda s: (offers[s.index].resume.start, s.used))
        return Placement(best.index, "continues", offers[best.index], guest_ok)
    if park_slot in indices and park_point > 0:
        return _comes_back(park_slot, prompt, namespace, slots, offers)
    sharing = [s for s in slots if s.rows and offers[s.index].shared >= chunk
               and 2 * offers[s.index].shared >= len(s.rows)]
    if sharing:
        best = max(sharing, key=lambda s: (offers[s.index].shared, s.used))
        return Placement(best.index, "shares", offers[best.index], guest_ok)
    empty = [s for s in slots if not s.rows and s.holdings.ends.end is None]
    if empty:
        best = min(empty, key=lambda s: (s.used, s.index))
        return Placement(best.index, "empty", offers[best.index], guest_ok)
    best = min(slots, key=lambda s: (s.used, s.index))
    return _no_guest(best, "lru", prompt, namespace, offers)


def _no_guest(slot: SlotFacts, why: Why, prompt: list[int], namespace: Namespace,
              offers: dict[int, ResidentOffer]) -> Placement:
    """Placed in ``slot`` as no guest: the conversation there leaves (for the park), and this
    one keeps the slot whatever its length (the engine's offers again say so: guest_ok)."""
    offer = offers[slot.index]
    if offer.resume.guest:
        offer = resident_offer(slot.holdings, prompt, namespace, slot.rows, guest_ok=False)
    return Placement(slot.index, why, offer, guest_ok=False)


def _comes_back(park_slot: int, prompt: list[int], namespace: Namespace,
                slots: Sequence[SlotFacts], offers: dict[int, ResidentOffer]) -> Placement:
    """The parked conversation comes back to the slot it left, as no guest: a short one would
    otherwise be a guest over the conversation that took its place, and the park's end, the
    resident's offer being decisive, never asked."""
    return _no_guest(next(s for s in slots if s.index == park_slot), "park", prompt, namespace,
                     offers)


def _side_slot(slots: Sequence[SlotFacts], session: str | None,
               namespace: Namespace) -> SlotFacts:
    """A side request's slot (module docstring); ``slots`` holds two at least."""
    empty = [s for s in slots if not s.rows and s.holdings.ends.end is None]
    if empty:
        return min(empty, key=lambda s: (s.used, s.index))
    own = {s.index for s in slots if session is not None and s.holdings.session == session
           and s.holdings.namespace == namespace}
    if not own:
        own = {max(slots, key=lambda s: (s.used, s.index)).index}
    others = [s for s in slots if s.index not in own]
    return min(others or slots, key=lambda s: (s.used, s.index))


def _continues(offer: ResidentOffer, slot: SlotFacts) -> bool:
    """The prompt goes on from this slot's conversation: it extends the rows in place, resumes
    at the end or prompt-end anchor, or its copy aligns with the slot's end record."""
    if slot.aligned:
        return True
    if offer.resume.guest:
        return False
    return offer.continuing or offer.resume.source in ("end", "prompt_end")
