"""The resident prefix and the park as actors (spec: "Resident prefix", "Another session").

Each owns its holdings (tandem/cache/holdings.py): the resident the grid anchors, the ends and
the stash, and whose the rows in place are; the park the pinned head and the parked session.
When a job gets the engine, each answers the engine actor's `OfferTiers` with its offer,
computed over its own copies, and lends the holdings for that generation; `GenerationEnded`
gives them back. A tier never touches its holdings while they are lent: the engine thread
writes into them, and only one side holds them at a time.

Invariants: lent to at most one request (the resident: each slot to at most one, so requests
in different slots hold their slots' holdings at once); what comes back is what was lent; the holdings'
own invariants hold whenever they are here (checked on their return).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import structlog

from tandem.actors.compaction_messages import FindSession, SessionHeld
from tandem.actors.messages import Message
from tandem.actors.governor import TierHeld
from tandem.actors.mailbox import MailboxFull
from tandem.actors.runtime import Actor, ActorStopped
from tandem.actors.tier_messages import (AnchorWritten, ClearHoldings, GenerationEnded,
                                         GetTierStats, HoldingsCleared, LendSlot, OfferTiers,
                                         ParkOffered, ResidentOffered, SlotLent, TierStats)
from tandem.cache.memory import Share, check_shares
from tandem.cache.namespace import Namespace
from tandem.cache.slots import SlotFacts, place
from tandem.cache.holdings import (ParkHoldings, ResidentHoldings, park_offer, park_statistics,
                                   resident_offer, resident_statistics)
from tandem.tokens import common_prefix

log = structlog.get_logger("tandem.tiers")

# The guests' prompts kept to tell a conversation's next turn (ResidentActor.recent_guests),
# and the tokens at a prompt's end that may differ once the turn is rendered with its answer.
RECENT_GUESTS = 8
GUEST_TAIL = 16


class TierLendingError(RuntimeError):
    """A tier's holdings lent twice, or given back by a request they were not lent to."""


class _Lender(Actor):
    def __init__(self, name: str, holdings: Any, governor: Actor | None = None,
                 **actor_options: Any) -> None:
        super().__init__(name, **actor_options)
        self.holdings = holdings
        self.governor = governor  # told what the holdings hold (TierHeld)
        self.lent_to: str | None = None
        self.lent_total = 0
        self.anchors_written = 0
        self._stats = self._statistics()

    def _lend(self, request_id: str, peek: bool = False) -> Any:
        if self.lent_to is not None:
            raise TierLendingError(f"{self.name} is lent to {self.lent_to} already")
        self.lent_to = request_id
        self.lent_total += not peek  # a peek's loan is counted nowhere
        return self.holdings

    def _take_back(self, msg: GenerationEnded) -> None:
        if self.lent_to != msg.request_id or msg.holdings is not self.holdings:
            raise TierLendingError(f"{self.name}: {msg.request_id} gave back what it was not lent")
        self.lent_to = None
        self._check(msg.rows)
        self._stats = self._statistics()
        self._report_held()

    async def on_start(self) -> None:
        self._report_held()

    def _report_held(self) -> None:
        if self.governor is None:
            return
        try:
            self.governor.try_tell(TierHeld(self.name, self._stats["held_bytes"]), sender=self)
        except (MailboxFull, ActorStopped):
            log.warning("tier_held_dropped", tier=self.name)

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case OfferTiers():
                return self._offer(msg)
            case GenerationEnded():
                self._take_back(msg)
            case AnchorWritten():
                self.anchors_written += 1
            case ClearHoldings():
                return self._clear()
            case GetTierStats():
                stats = self._stats if self.lent_to is not None else self._statistics()
                return TierStats(dict(stats, lent_total=self.lent_total,
                                      anchors_written=self.anchors_written), self.lent_to)
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    def _offer(self, msg: OfferTiers) -> Message:
        raise NotImplementedError

    def _clear(self) -> HoldingsCleared:
        if self.lent_to is not None:
            return HoldingsCleared(busy=True)
        held = sum(self._stats["held_bytes"].values())
        for holdings in self._all_holdings():
            holdings.clear()
        self._stats = self._statistics()
        self._report_held()
        log.info("tier_cleared", tier=self.name, nbytes=held)
        return HoldingsCleared(nbytes=held)

    def _all_holdings(self) -> list[Any]:
        return [self.holdings]

    def _check(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _statistics(self) -> dict:
        raise NotImplementedError


class ResidentActor(_Lender):
    """The resident tiers of every slot (tandem/cache/slots.py): one ``ResidentHoldings`` a
    slot. An offer places the request in a slot and lends that slot's holdings alone."""

    holdings: ResidentHoldings

    def __init__(self, name: str = "resident", *, holdings: ResidentHoldings | None = None,
                 slots: list[ResidentHoldings] | None = None, governor: Actor | None = None,
                 **actor_options: Any) -> None:
        self.slots = list(slots) if slots is not None else [holdings]
        assert self.slots and all(h is not None for h in self.slots), "no holdings"
        self.used = [0] * len(self.slots)  # when each slot was last placed (a logical clock)
        self._clock = 0
        self.placements: dict[str, int] = {}  # how requests were placed, by rule
        self.lent: dict[int, str] = {}  # the slots lent now, to which request
        # The prompts of the last guests (namespace, ids): a prompt that goes on from one is a
        # conversation's next turn, and is no guest (tandem/cache/slots.py).
        self.recent_guests: deque[tuple[Namespace, list[int]]] = deque(maxlen=RECENT_GUESTS)
        super().__init__(name, self.slots[0], governor, **actor_options)

    def _offer(self, msg: OfferTiers) -> ResidentOffered:
        namespace = Namespace(msg.namespace)
        rows_of = msg.slot_rows if msg.slot_rows else [msg.rows]
        if len(rows_of) != len(self.slots):
            raise TierLendingError(f"{self.name}: {len(rows_of)} slots' rows for "
                                   f"{len(self.slots)} slots")
        # A slot lent to a running request is not placed in (issue 14: requests in different
        # slots run at once; the engine admits one only while a slot is idle).
        facts = [SlotFacts(i, rows_of[i], held, self.used[i],
                           aligned=_aligns(held, msg.prompt_ids, namespace))
                 for i, held in enumerate(self.slots) if i not in self.lent]
        if not facts:
            raise TierLendingError(f"{self.name}: every slot is lent")
        prompt = list(msg.prompt_ids)
        guests = msg.side or not self._goes_on_from_a_guest(prompt, namespace)
        placed = place(prompt, msg.session, namespace, facts,
                       self.slots[0].anchors.chunk, park_slot=msg.park_slot,
                       park_point=msg.park_point, park_session=msg.park_session,
                       side=msg.side, own_slot=msg.own_slot, guests=guests)
        self.holdings = self.slots[placed.slot]
        self.lent[placed.slot] = msg.request_id
        self.lent_to = msg.request_id
        holdings = self.holdings
        if not msg.peek:  # a peek counts nothing: no loan, no use, no placement
            self.lent_total += 1
            if not msg.side:
                # A side request keeps nothing: the slot it ran in is no more recently used.
                self._clock += 1
                self.used[placed.slot] = self._clock
            self.placements[placed.why] = self.placements.get(placed.why, 0) + 1
            if placed.offer.resume.guest and not msg.side and len(self.slots) > 1:
                self.recent_guests.append((namespace, prompt))
        offer = placed.offer
        r = offer.resume
        return ResidentOffered(msg.request_id, r.start, r.source, r.guest, offer.shared,
                               offer.continuing, offer.decisive, holdings.namespace, holdings,
                               slot=placed.slot, placed=placed.why,
                               guest_ok=placed.guest_ok)

    def _all_holdings(self) -> list[Any]:
        return list(self.slots)

    def _goes_on_from_a_guest(self, prompt: list[int], namespace: Namespace) -> bool:
        """Whether ``prompt`` is a recent guest's prompt gone on: longer, and the same tokens
        but for the last few (a template may render the turn's opening of the answer
        otherwise once it has one)."""
        for ns, ids in self.recent_guests:
            if ns == namespace and len(prompt) > len(ids) and common_prefix(
                    prompt, ids) >= max(1, len(ids) - GUEST_TAIL):
                return True
        return False

    async def handle(self, msg: Message) -> object | None:
        if isinstance(msg, LendSlot):
            return self._lend_slot(msg)
        if isinstance(msg, FindSession):
            return self._find_session(msg)
        return await super().handle(msg)

    def _find_session(self, msg: FindSession) -> SessionHeld:
        """The idle slots whose rows are the session's and end at an end anchor (a compaction's
        continuation resumes there)."""
        namespace = Namespace(msg.namespace)
        return SessionHeld(slot_ends=[
            [i, held.ends.end.length] for i, held in enumerate(self.slots)
            if i not in self.lent and held.session == msg.session
            and held.namespace == namespace and held.ends.end is not None])

    def _lend_slot(self, msg: LendSlot) -> SlotLent:
        """One idle slot's holdings, outside a generation (the spill's drain and start)."""
        if not 0 <= msg.slot < len(self.slots) or msg.slot in self.lent:
            return SlotLent(None)
        self.lent[msg.slot] = msg.request_id
        self.lent_to = msg.request_id
        self.lent_total += 1
        self.holdings = self.slots[msg.slot]
        return SlotLent(self.holdings)

    def _take_back(self, msg: GenerationEnded) -> None:
        slot = next((i for i, held in enumerate(self.slots) if held is msg.holdings), None)
        if slot is None or self.lent.get(slot) != msg.request_id:
            raise TierLendingError(f"{self.name}: {msg.request_id} gave back what it was not lent")
        del self.lent[slot]
        self.lent_to = next(reversed(self.lent.values()), None)
        self.holdings = self.slots[slot]
        self._check(msg.rows)
        self._stats = self._statistics()
        self._report_held()

    def _check(self, rows: list[int]) -> None:
        self.holdings.check_invariants(rows)
        shares = [held.anchors.memory for held in self.slots]
        if all(isinstance(share, Share) for share in shares):
            check_shares(shares[0].shared, shares)

    def _statistics(self) -> dict:
        per_slot = [dict(resident_statistics(held), slot=i, session=held.session is not None,
                         used=self.used[i], lent=i in self.lent)
                    for i, held in enumerate(self.slots)]
        total = dict(per_slot[0])
        total["anchors"] = sorted({line for s in per_slot for line in s["anchors"]})
        for key in ("anchors_taken", "evictions", "guests"):
            total[key] = sum(s[key] for s in per_slot)
        total["held_bytes"] = {level: sum(s["held_bytes"][level] for s in per_slot)
                               for level in total["held_bytes"]}
        total.pop("slot"), total.pop("session"), total.pop("used"), total.pop("lent")
        total["slots"] = per_slot
        total["placements"] = dict(self.placements)
        return total


def _aligns(held: ResidentHoldings, prompt: list[int], namespace: Namespace) -> bool:
    """Whether the client's copy aligns with this slot's end in place (counted nowhere: the
    plan aligns again over the placed slot's lent holdings)."""
    return held.records is not None and held.records.aligns_at_end(
        held.ends.end, held.namespace, prompt, namespace)


class ParkActor(_Lender):
    holdings: ParkHoldings

    def __init__(self, name: str = "park", *, holdings: ParkHoldings,
                 governor: Actor | None = None, **actor_options: Any) -> None:
        super().__init__(name, holdings, governor, **actor_options)

    async def handle(self, msg: Message) -> object | None:
        if isinstance(msg, FindSession):
            return self._find_session(msg)
        return await super().handle(msg)

    def _find_session(self, msg: FindSession) -> SessionHeld:
        """The parked conversation, when it is the session's and kept its end anchor."""
        parked = self.holdings.park.parked
        if self.lent_to is not None or parked is None or parked.end is None \
                or parked.session != msg.session or parked.namespace != Namespace(msg.namespace):
            return SessionHeld()
        return SessionHeld(park_end=parked.end.length, park_head=parked.head,
                           token_ids=list(parked.token_ids[:parked.end.length]))

    def _offer(self, msg: OfferTiers) -> ParkOffered:
        offer = park_offer(self.holdings, msg.prompt_ids, Namespace(msg.namespace), msg.rows,
                           Namespace(msg.rows_namespace))
        parked = self.holdings.park.parked
        return ParkOffered(msg.request_id, offer.pin_point, offer.park_point,
                           self._lend(msg.request_id, msg.peek),
                           park_session=parked.session if parked is not None else None)

    def _check(self, rows: list[int]) -> None:
        self.holdings.check_invariants()

    def _statistics(self) -> dict:
        return park_statistics(self.holdings)
