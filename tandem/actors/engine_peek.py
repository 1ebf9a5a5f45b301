"""The engine actor's side of the peek (issue 18, part 2; spec: "Peek and prewarm"): where the
plan would resume a prompt, asked of every tier as the plan asks them, without running the
model or counting anything.

A part of ``EngineActor`` (tandem/actors/engine_actor.py), kept apart as engine_spill.py is;
every method runs on the loop. A `Peek` is answered in the engine's mailbox while no generation
runs or waits (the handler holds the mailbox meanwhile, so no request is planned beside it):

- the park and the resident are asked with ``OfferTiers(peek=True)``: the same placement and
  offers a request gets, their holdings lent for the moment and given back with a
  `GenerationEnded` (no loan, use or placement is counted);
- the end alignment over the lent records, counted nowhere (``count=False``), and the store's
  ``StoreHolds`` for a recent turn's session snapshot, as ``_align`` asks it;
- the spill's candidate and its weighing (``weigh``, as ``_weigh_spill`` without its count),
  the state store's ``StoreOffer(peek=True)`` (no lease, no miss), the disk tier's offer
  (``count=False``) and its worth, in the plan's order (``_plan``).

What the peek leaves out, and so may answer otherwise than the request: the governor's
admission (a request whose workspace does not fit sheds caches first, or is refused), a
compaction request's continuation (the route serves it as other ids), the response cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import structlog

from tandem.actors.engine_messages import Peek, Peeked
from tandem.actors.runtime import ActorStopped
from tandem.actors.store import StoreHolds, StoreOffer
from tandem.actors.tier_messages import GenerationEnded, OfferTiers
from tandem.cache.holdings import (ParkOffer, ResidentOffer, Resume, choose, park_offer,
                                   resident_offer)
from tandem.cache.namespace import Namespace
from tandem.cache.vocabulary import tier_of
from tandem.io.spill_slots import weigh

log = structlog.get_logger("tandem.peek")

PEEK_ASK_S = 30.0  # a tier's offer is microseconds of its handler; past this it is stuck
BASES = ("cold", "resident", "end")  # the RAM resumes a spill read goes on from (engine_spill)


@dataclass
class PeekPlan:
    """What a peek found: the resume, the prompt served, the placed slot and the offers a
    prewarm reads from (the spill's, with the slot's holdings while they are lent)."""

    resume: Resume
    served: list[int]
    slot: int
    spill_offer: Any = None
    disk_offer: Any = None
    alignment: Any = None


class EnginePeek:
    """The peek's methods of the engine actor (a mixin: ``EngineActor`` calls ``_init_peek``
    from its constructor)."""

    def _init_peek(self) -> None:
        self._peek_ids = itertools.count(1)
        self._prewarming = False  # a prewarm holds the engine (engine_peek's prewarm)

    def _peek_busy(self) -> Peeked | None:
        """Busy while a generation runs or waits, a prewarm runs or the engine drains (the
        route answers 409 at once while one waits, and tries again a while otherwise)."""
        waiting = self.waiting
        if waiting or self._draining:
            return Peeked(busy=True, waiting=max(waiting, 1),
                          retry_after_s=self.retry_after_estimate())
        if self._jobs or self._lock.holder is not None or self._prewarming:
            return Peeked(busy=True, retry_after_s=self.retry_after_estimate())
        return None

    async def _peek(self, msg: Peek) -> Peeked:
        if (busy := self._peek_busy()) is not None:
            return busy
        if self._tiers is None:
            # No caches: nothing is kept but the rows in place, which no tier names.
            n = len(msg.prompt_ids)
            return self._peeked(Resume(0, "cold"), n, 0, None)
        request_id = f"peek-{next(self._peek_ids)}"
        return await self._with_plan(request_id, msg, self._answer_peek)

    async def _answer_peek(self, request_id: str, msg: Peek, plan: PeekPlan,
                           holdings: Any) -> Peeked:
        return self._peeked(plan.resume, len(plan.served), plan.slot, plan)

    async def _with_plan(self, request_id: str, msg: Peek, then: Any) -> Any:
        """The tiers' holdings lent for a peek's plan, ``then(request_id, msg, plan, holdings)``
        over them, and the holdings given back whatever happens."""
        resident, park = self._tiers
        namespace = Namespace(msg.namespace)
        prompt = list(msg.prompt_ids)
        from_slot = (self._park_slot if self._park_slot is not None else self._last_slot)
        p = await park.ask(OfferTiers(request_id, prompt, self._slot_rows[from_slot], namespace,
                                      rows_namespace=self._slot_namespace[from_slot],
                                      peek=True), PEEK_ASK_S, sender=self)
        r = None
        composer = None
        try:
            r = await resident.ask(OfferTiers(
                request_id, prompt, self._slot_rows[from_slot], namespace,
                slot_rows=self._slot_rows if self.parallel > 1 else [], session=msg.session,
                park_slot=self._park_slot, park_point=p.park_point,
                park_session=p.park_session, side=msg.side, peek=True),
                PEEK_ASK_S, sender=self)
            if r.slot != from_slot:
                again = park_offer(p.holdings, prompt, namespace, self._slot_rows[r.slot],
                                   Namespace(r.rows_namespace))
                p = msgspec.structs.replace(p, pin_point=again.pin_point,
                                            park_point=again.park_point)
            # The records follow the composer they are lent with (the alignment reads the
            # ends through it); a slot not built yet holds nothing, slot 0's composer reads.
            composer = self.composers[r.slot] or self.composers[0]
            composer.lend(r.holdings, p.holdings)
            plan = await self._peek_plan(msg, r, p)
            return await then(request_id, msg, plan, r.holdings)
        finally:
            if composer is not None:
                composer.give_back()
            for actor, reply, rows in ((park, p, []), (resident, r, None)):
                if reply is None:
                    continue
                slot_rows = self._slot_rows[r.slot] if rows is None else rows
                try:
                    actor.try_tell(GenerationEnded(request_id, "not_run", slot_rows,
                                                   reply.holdings), sender=self)
                except ActorStopped:
                    pass

    async def _peek_plan(self, msg: Peek, r: Any, p: Any) -> PeekPlan:
        """``_plan``'s decisions over the lent holdings, asking and counting nothing more."""
        prompt = list(msg.prompt_ids)
        namespace = Namespace(msg.namespace)
        rows = self._slot_rows[r.slot]
        chunk = self.view.prefix_chunk or 1
        mine = ResidentOffer(Resume(r.start, r.source, guest=r.guest), r.shared, r.continuing,
                             r.decisive)
        theirs = ParkOffer(p.pin_point, p.park_point)
        records = r.holdings.records
        alignment = None
        if records is not None and not msg.side:
            alignment, recent = records.align_in_place(prompt, namespace, count=False)
            if alignment is None:
                for candidate, key_rows in recent:
                    reply = await self._ask_store(StoreHolds(list(key_rows), namespace))
                    if reply is not None and reply.held:
                        alignment = candidate
                        break
        served = alignment.served if alignment is not None else prompt
        spill_offer = None
        if alignment is None and self.spill is not None:
            spill_offer, spill_alignment = self._spill_candidate(
                SimpleNamespace(namespace=namespace), prompt, records)
            if spill_alignment is not None and weigh(
                    spill_offer, mine.resume.start, len(spill_alignment.served), chunk,
                    self._prefill_rate(), self._restore_rate())[0]:
                alignment = spill_alignment
                served = alignment.served
        if served is not prompt:
            mine = resident_offer(r.holdings, served, namespace, rows, side=msg.side)
            if not mine.decisive:
                theirs = park_offer(p.holdings, served, namespace, rows, r.holdings.namespace)
        resume = choose(mine, theirs)
        if self.stores[0] is not None and not resume.guest:
            reply = await self._ask_store(StoreOffer(list(served), namespace, peek=True))
            if reply is not None and reply.start > resume.start:
                resume = Resume(reply.start, "store")
        disk_offer = None
        tier = self.disk_tier
        if tier is not None and not resume.guest and resume.source in ("cold", "resident"):
            got = tier.offer(list(served), namespace, start=resume.start, count=False)
            if got is not None and resume.start < got.line < len(served) \
                    and got.worth(self._prefill_rate()):
                disk_offer = got
        ram = resume
        if disk_offer is not None:
            resume = Resume(disk_offer.line, "disk")
        if spill_offer is not None:
            take = (ram.source in BASES and not ram.guest and weigh(
                spill_offer, ram.start, len(served), chunk, self._prefill_rate(),
                self._restore_rate(), disk_offer.line if disk_offer is not None else 0)[0])
            if take:
                disk_offer = None
                resume = Resume(spill_offer.line, "spill")
            else:
                spill_offer = None
        return PeekPlan(resume, list(served), r.slot, spill_offer, disk_offer, alignment)

    def _peeked(self, resume: Resume, tokens: int, slot: int | None,
                plan: PeekPlan | None, **extra: Any) -> Peeked:
        restore_ms = 0.0
        if plan is not None and plan.spill_offer is not None:
            restore_ms = plan.spill_offer.read_nbytes / max(self._restore_rate(), 1.0) * 1000.0
        elif plan is not None and plan.disk_offer is not None:
            restore_ms = plan.disk_offer.est_ms
        reread = max(0, tokens - resume.start)
        eta = reread / max(self._prefill_rate(), 1.0) * 1000.0 + restore_ms
        return Peeked(source=resume.source, tier=tier_of(resume.source),
                      cached_tokens=resume.start, reread_tokens=reread, tokens=tokens,
                      restore_ms=round(restore_ms, 3), reread_eta_ms=round(eta, 3), slot=slot,
                      **extra)
