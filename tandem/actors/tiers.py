"""The resident prefix and the park as actors (spec: "Resident prefix", "Another session").

Each owns its holdings (tandem/cache/holdings.py): the resident the grid anchors, the ends and
the stash, and whose the rows in place are; the park the pinned head and the parked session.
When a job gets the engine, each answers the engine actor's `OfferTiers` with its offer,
computed over its own copies, and lends the holdings for that generation; `GenerationEnded`
gives them back. A tier never touches its holdings while they are lent: the engine thread
writes into them, and only one side holds them at a time.

Invariants: lent to at most one request; what comes back is what was lent; the holdings'
own invariants hold whenever they are here (checked on their return).
"""

from __future__ import annotations

from typing import Any

import structlog

from tandem.actors.messages import Message
from tandem.actors.governor import TierHeld
from tandem.actors.mailbox import MailboxFull
from tandem.actors.runtime import Actor, ActorStopped
from tandem.actors.tier_messages import (AnchorWritten, GenerationEnded, GetTierStats,
                                         OfferTiers, ParkOffered, ResidentOffered, TierStats)
from tandem.cache.namespace import Namespace
from tandem.cache.holdings import (ParkHoldings, ResidentHoldings, park_offer, park_statistics,
                                   resident_offer, resident_statistics)

log = structlog.get_logger("tandem.tiers")


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

    def _lend(self, request_id: str) -> Any:
        if self.lent_to is not None:
            raise TierLendingError(f"{self.name} is lent to {self.lent_to} already")
        self.lent_to = request_id
        self.lent_total += 1
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
            case GetTierStats():
                stats = self._stats if self.lent_to is not None else self._statistics()
                return TierStats(dict(stats, lent_total=self.lent_total,
                                      anchors_written=self.anchors_written), self.lent_to)
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    def _offer(self, msg: OfferTiers) -> Message:
        raise NotImplementedError

    def _check(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _statistics(self) -> dict:
        raise NotImplementedError


class ResidentActor(_Lender):
    holdings: ResidentHoldings

    def __init__(self, name: str = "resident", *, holdings: ResidentHoldings,
                 governor: Actor | None = None, **actor_options: Any) -> None:
        super().__init__(name, holdings, governor, **actor_options)

    def _offer(self, msg: OfferTiers) -> ResidentOffered:
        offer = resident_offer(self.holdings, msg.prompt_ids, Namespace(msg.namespace),
                               msg.rows)
        r = offer.resume
        return ResidentOffered(msg.request_id, r.start, r.source, r.guest, offer.shared,
                               offer.continuing, offer.decisive, self.holdings.namespace,
                               self._lend(msg.request_id))

    def _check(self, rows: list[int]) -> None:
        self.holdings.check_invariants(rows)

    def _statistics(self) -> dict:
        return resident_statistics(self.holdings)


class ParkActor(_Lender):
    holdings: ParkHoldings

    def __init__(self, name: str = "park", *, holdings: ParkHoldings,
                 governor: Actor | None = None, **actor_options: Any) -> None:
        super().__init__(name, holdings, governor, **actor_options)

    def _offer(self, msg: OfferTiers) -> ParkOffered:
        offer = park_offer(self.holdings, msg.prompt_ids, Namespace(msg.namespace), msg.rows,
                           Namespace(msg.rows_namespace))
        return ParkOffered(msg.request_id, offer.pin_point, offer.park_point,
                           self._lend(msg.request_id))

    def _check(self, rows: list[int]) -> None:
        self.holdings.check_invariants()

    def _statistics(self) -> dict:
        return park_statistics(self.holdings)
