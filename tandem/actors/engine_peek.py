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

The prewarm (issue 18, part 3) is a `Peek` with ``prewarm`` set. When the plan resumes from
the spill (``nvme_spill``), the slot's rows belong to no other conversation used in the last
``PREWARM_IN_USE_S`` and the read takes at most ``PREWARM_MAX_S`` at the measured rate, the
engine's capture lock is taken as an outside holder (every request that comes waits in its
FIFO, as behind any holder) and the mailbox moves on: a `Generate` accepted meanwhile sets the
prewarm's stop. The conversation in place goes to the spill first when it is worth keeping
(from ``session_spill_park_min_tokens`` rows, as a plan parks it); then the entry is read into
the slot as the plan's read does (``SessionSpill.restore`` over the rows in place, adopted as
``_restore_spill`` adopts it), so the next turn resumes at the entry's end anchor (source
``end``). The restore stops between two files when a request came (the blocks over the rows in
place are written only after the last file: the rows stay) and the save is not begun after one
came; either way the answer is ``yielded``, the entry stays on the NVMe and the conversation in
place in its slot.

What the peek leaves out, and so may answer otherwise than the request: the governor's
admission (a request whose workspace does not fit sheds caches first, or is refused), a
compaction request's continuation (the route serves it as other ids), the response cache.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import structlog

from tandem.actors.engine_messages import Peek, Peeked
from tandem.actors.runtime import ActorStopped, Deferred
from tandem.actors.store import StoreHolds, StoreOffer
from tandem.actors.tier_messages import GenerationEnded, OfferTiers
from tandem.cache.holdings import (ParkOffer, ResidentOffer, Resume, choose, park_offer,
                                   resident_offer)
from tandem.cache.namespace import Namespace
from tandem.cache.vocabulary import tier_of
from tandem.io.spill import SpillReadFailed, SpillStopped
from tandem.io.spill_slots import adopt_entry, weigh
from tandem.tokens import common_prefix

log = structlog.get_logger("tandem.peek")

PEEK_ASK_S = 30.0  # a tier's offer is microseconds of its handler; past this it is stuck
BASES = ("cold", "resident", "end")  # the RAM resumes a spill read goes on from (engine_spill)
PREWARM_IN_USE_S = 120.0  # another conversation used the slot's rows this recently: kept (spec)
PREWARM_MAX_S = 3.0  # a read longer than this at the measured rate is not begun (spec)


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
        self._prewarming = False  # a prewarm holds the capture lock
        self._prewarm_stop = threading.Event()  # set by a request accepted during one
        # When each slot's last generation ended (the actor clock's; None: never).
        self._slot_used_s: list[float | None] = [None] * self.parallel
        self.request_hooks.append(self._prewarm_yields)
        self.prewarm_counts: dict[str, int] = {}  # prewarms by outcome (prewarmed or why)

    def _prewarm_yields(self, msg: Any) -> None:
        if self._prewarming:
            self._prewarm_stop.set()

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
        if msg.prewarm:
            return self._start_prewarm(request_id, msg)
        return await self._with_plan(request_id, msg, self._answer_peek)

    # -- the prewarm -----------------------------------------------------------------------

    def _start_prewarm(self, request_id: str, msg: Peek) -> Deferred:
        """The capture lock taken as an outside holder (free: nothing runs or waits), the
        prewarm run as the actor's task, and its answer deferred, so that the mailbox moves on
        and a request that comes meanwhile stops it."""
        from tandem.actors.engine_actor import _Outside

        holder = _Outside("prewarm", None, next(self._grant_ids))
        self._lock.enqueue(holder)
        self._pump()
        assert self._lock.holder is holder, "the capture lock was not free for the prewarm"
        self._prewarming = True
        self._prewarm_stop.clear()
        fut = self._loop.create_future()

        async def run() -> None:
            try:
                fut.set_result(await self._with_plan(request_id, msg, self._answer_prewarm))
            except BaseException as exc:
                fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            finally:
                self._prewarming = False
                self._lock.release(holder)
                self._pump()  # the requests that came meanwhile

        self._task(run())
        return Deferred(fut)

    async def _answer_prewarm(self, request_id: str, msg: Peek, plan: PeekPlan,
                              holdings: Any) -> Peeked:
        t = time.perf_counter()

        def answer(**prewarm: Any) -> Peeked:
            why = "prewarmed" if prewarm.get("prewarmed") else prewarm.get("why", "")
            self.prewarm_counts[why] = self.prewarm_counts.get(why, 0) + 1
            log.info("prewarm", request_id=request_id, outcome=why, slot=plan.slot,
                     ms=round((time.perf_counter() - t) * 1000, 2))
            return self._peeked(plan.resume, len(plan.served), plan.slot, plan,
                                prewarm=dict(prewarmed=False, **prewarm)
                                if "prewarmed" not in prewarm else prewarm)

        offer = plan.spill_offer
        if plan.resume.source != "spill" or offer is None or self.spill is None:
            return answer(why="not_on_nvme")
        slot, namespace = plan.slot, Namespace(msg.namespace)
        rows = list(self._slot_rows[slot])
        other = bool(rows) and self._other_conversation(
            holdings, SimpleNamespace(namespace=namespace, session=msg.session))
        used = self._slot_used_s[slot]
        if other and used is not None and self.clock.monotonic() - used < PREWARM_IN_USE_S:
            return answer(why="resident_in_use")
        if offer.read_nbytes / max(self._restore_rate(), 1.0) > PREWARM_MAX_S:
            return answer(why="too_long")
        saved = None
        if other and self.spill_writer is not None \
                and len(rows) >= max(1, self.spill_park_min_tokens):
            if self._prewarm_stop.is_set():
                return answer(why="yielded")
            reason = "evict" if len(rows) >= self.spill_min_tokens else "park"
            skipped = await self._save_slot(slot, holdings, reason, request_id,
                                            stop=self._prewarm_stop.is_set)
            saved = {"rows": len(rows), "skipped": skipped or None}
            if skipped == "stopped":  # between two files: the rows in place are the slot's
                return answer(why="yielded", saved=saved)
        if self._prewarm_stop.is_set():
            return answer(why="yielded", saved=saved)
        await self._use_slot(slot)
        got = await self._on_thread(self._prewarm_into_slot, slot, offer, holdings,
                                    msg.session, namespace)
        if got is None:
            return answer(why="yielded", saved=saved)
        if isinstance(got, str):
            return answer(why="read_failed", saved=saved)
        self._slot_namespace[slot] = namespace
        report, seconds = got
        if report.nbytes_read and seconds > 0:
            self._restore_rates.append(report.nbytes_read / seconds)
        return answer(prewarmed=True, saved=saved, restore={
            "slot": slot, "entry": report.entry_id[:12], "line": report.line,
            "blocks_read": report.blocks_read,
            "blocks_in_place": report.blocks_in_place, "nbytes": report.nbytes_read,
            "ms": round(seconds * 1000.0, 3)})

    def _prewarm_into_slot(self, slot: int, offer: Any, holdings: Any, session: str | None,
                           namespace: Namespace) -> Any:
        """On the engine thread: the entry read over the slot's rows in place, as the plan's
        read does, stopping between two files once a request came (None: stopped, the rows as
        they were; a str: the read failed, the entry deleted)."""
        self._activate(slot)
        engine = self.engine
        rows = list(engine.token_ids) if holdings.namespace == namespace else []
        t = time.perf_counter()
        try:
            report = self.spill.restore(offer.entry_id, engine.cache_state(), rows,
                                        line=offer.line, stop=self._prewarm_stop.is_set)
        except SpillStopped:
            return None
        except (SpillReadFailed, ValueError) as exc:
            # The blocks over the rows in place were never written (held to the end).
            self.spill_counts["read_failed"] += 1
            log.warning("prewarm_read_failed", slot=slot, error=type(exc).__name__)
            return "failed"
        in_place = common_prefix(rows, report.token_ids)
        adopt_entry(holdings, engine, report, session, namespace, in_place,
                    end_anchor=holdings.ends.end_anchor)
        seconds = time.perf_counter() - t
        self._hand_over_rows()
        return report, seconds

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
        if records is not None and not msg.side and not msg.images:
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
                SimpleNamespace(namespace=namespace), prompt,
                records if not msg.images else None)
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
