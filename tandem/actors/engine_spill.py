"""The engine actor's side of the session spill (issue 16, parts 1 and 2): which conversations
leave for the NVMe and when, the read in the plan, and the drain's and the start's.

A part of ``EngineActor`` (tandem/actors/engine_actor.py), kept apart for its size: every
method runs on the loop unless it says the engine thread. The spill writer actor
(tandem/actors/spill_writer.py) writes every entry (a `SpillSave`, asked and waited for); the
engine thread reads one back into its slot itself (``SessionSpill.restore``, under the spill's
own lock), as it reads the disk tier's files.

When an entry is written:

- a conversation leaves its slot (the plan parks the rows in place above a head, or a state
  store restore clears them): written before the prefill that overwrites them starts, from
  ``session_spill_park_min_tokens`` rows (so that the park, which holds one conversation, may
  give it up to the next one); the reason is ``evict`` from ``session_spill_min_tokens``, else
  ``park``, and the write guard weighs both as evictions;
- a planned stop (`SpillSlots`, after the engine drained): every slot's conversation, reason
  ``drain``, which the guard always lets through, then the parked conversation when it is not
  on the NVMe already (one of ``session_spill_park_min_tokens`` rows was written as it was
  parked).

When one is read: the plan's offer (``spill_offer``) resumes the prompt more than a chunk past
every tier in RAM and the read costs less than the prefill it saves; the engine thread restores
it over the rows in place (the blocks they hold are not read) after the resident put the engine
at its own start. At start (`ReadSpill`) the most recent entries, one a slot, newest in slot 0.
"""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import structlog

from tandem.actors.engine_messages import SlotsSpilled, SpillRead
from tandem.actors.runtime import ActorStopped
from tandem.actors.spill_messages import SpillSave
from tandem.actors.tier_messages import GenerationEnded, LendSlot, OfferTiers
from tandem.cache.holdings import Resume
from tandem.cache.namespace import Namespace
from tandem.io.spill import SpillReadFailed
from tandem.io.spill_slots import (RESTORE_RATE_PRIOR, adopt_entry, align_offer, slot_entry,
                                   weigh)
from tandem.tokens import common_prefix

log = structlog.get_logger("tandem.spill")

SPILL_SAVE_S = 120.0  # a save's ask: a conversation of the window's rows, with room to spare
BASES = ("cold", "resident", "end")  # the RAM resumes a spill read goes on from


class _ParkedHoldings:
    """A parked conversation seen as a slot's holdings, for ``slot_entry`` (its anchors, its
    end; no end record travels with a park here)."""

    def __init__(self, parked: Any) -> None:
        self.namespace = parked.namespace
        self.session = parked.session
        self.anchors = SimpleNamespace(copies=dict(parked.anchors))
        self.ends = SimpleNamespace(end=parked.end)
        self.records = None


class EngineSpill:
    """The spill's methods and state of the engine actor (a mixin: ``EngineActor`` calls
    ``_init_spill`` from its constructor)."""

    def _init_spill(self, make_spill: Any, spill_writer: Any, min_tokens: int,
                    park_min_tokens: int) -> None:
        self._make_spill = make_spill
        self.spill: Any = None  # tandem.io.spill.SessionSpill, built on the engine thread
        self.spill_writer = spill_writer
        self.spill_min_tokens = min_tokens
        self.spill_park_min_tokens = park_min_tokens
        self._restore_rates: deque[float] = deque(maxlen=32)
        self.spill_counts: dict[str, Any] = {
            "served": 0, "read_failed": 0, "saves": 0, "saved_tokens": 0,
            "save_skipped": {}, "not_served": {}, "read_at_start": 0}

    def _build_spill(self, engine: Any) -> None:
        """On the engine thread, after the disk tier: the spill beside it (its identity)."""
        if self._make_spill is not None and self.disk_tier is not None:
            self.spill = self._make_spill(engine, self.disk_tier)

    # -- the read, in the plan ---------------------------------------------------------------

    def _restore_rate(self) -> float:
        rates = sorted(self._restore_rates)
        return rates[len(rates) // 2] if rates else RESTORE_RATE_PRIOR

    def _spill_candidate(self, job: Any, prompt: list[int], records: Any) -> tuple[Any, Any]:
        """The spill's best offer for the client's copy and the alignment that reaches its end
        (None: the copy reaches it as it came, or nothing aligns)."""
        if self.spill is None:
            return None, None
        align = (records.align_record if records is not None and self.end_align
                 else (lambda record, prompt: None))
        return align_offer(self.spill, prompt, job.namespace, align)

    def _weigh_spill(self, job: Any, offer: Any, resume: Resume, served_len: int,
                     other: int = 0) -> bool:
        """Whether the plan reads ``offer`` over the RAM ``resume`` (and the disk tier's offer,
        which resumes at ``other``); an entry that shared more than a chunk past RAM and does
        not serve is logged and counted by why."""
        if offer is None:
            return False
        chunk = self.view.prefix_chunk or 1
        if resume.source not in BASES or resume.guest:
            take, why = False, None
            if offer.matched > resume.start + chunk:
                why = "anchors_below" if resume.source in ("pin", "park", "store") else None
        else:
            take, why = weigh(offer, resume.start, served_len, chunk, self._prefill_rate(),
                              self._restore_rate(), other)
        if why is not None:
            counts = self.spill_counts["not_served"]
            counts[why] = counts.get(why, 0) + 1
            log.info("spill_not_served", request_id=job.request_id, why=why,
                     matched=offer.matched, line=offer.line, start=resume.start)
        return take

    def _restore_spill(self, job: Any, plan: Any, served: Sequence[int]) -> Resume:
        """On the engine thread, after the resident put the engine at its own start: the
        entry's blocks above the rows in place and its sections at the offer's line (every
        block and anchor summed again before a byte reaches the rows). A failure deletes the
        entry; the prefill then goes on from the highest anchor below what was overwritten."""
        engine, offer, resident = self.engine, plan.spill_offer, self.resident
        start = engine.length
        same = resident.namespace == job.namespace
        rows = list(engine.token_ids[:start]) if same else []
        t = time.perf_counter()
        try:
            report = self.spill.restore(offer.entry_id, engine.cache_state(), rows,
                                        line=offer.line)
        except (SpillReadFailed, ValueError) as exc:
            intact = exc.intact_below if isinstance(exc, SpillReadFailed) else start
            self.spill_counts["read_failed"] += 1
            log.warning("spill_read_failed", request_id=job.request_id, line=offer.line,
                        start=start, error=type(exc).__name__,
                        why=getattr(exc, "reason", "layout"))
            if intact >= start:
                return Resume(start, plan.spill_base_source if start else "cold")
            line = resident.anchor_tier.best(intact)
            state = engine.cache_state()
            resident.anchors_drop_above(line)
            resident.ends.drop_end()
            if line:
                resident.anchors[line].restore(state)
            engine.resume_at(line)  # at 0: zeros, the cold start
            return Resume(line, "resident" if line else "cold")
        in_place = common_prefix(rows, report.token_ids)  # the rows the restore left alone
        adopt_entry(resident.holdings, engine, report, job.session, job.namespace, in_place,
                    end_anchor=resident.end_anchor)
        seconds = time.perf_counter() - t
        if report.nbytes_read and seconds > 0:
            self._restore_rates.append(report.nbytes_read / seconds)
        self.spill_counts["served"] += 1
        log.info("spill_served", request_id=job.request_id, line=report.line, start=start,
                 blocks_read=report.blocks_read, blocks_in_place=report.blocks_in_place,
                 nbytes=report.nbytes_read, ms=round(seconds * 1000, 2))
        return Resume(report.line, "spill")

    # -- what leaves ---------------------------------------------------------------------------

    def _other_conversation(self, holdings: Any, job: Any) -> bool:
        if holdings.namespace != job.namespace:
            return True
        if job.session is not None and holdings.session is not None:
            return job.session != holdings.session
        return True

    async def _spill_leaving(self, job: Any, plan: Any) -> None:
        """On the loop, before the engine thread runs ``plan`` (the slot is the job's and
        idle): the conversation in place, when the plan parks it or a store restore clears it,
        goes to the spill first."""
        if self.spill_writer is None or self.spill is None or plan.guest:
            return
        holdings = plan.resident
        rows = self._slot_rows[job.slot]
        moves = plan.moves
        parked = moves is not None and moves.park_above is not None
        cleared = plan.source == "store" and self._other_conversation(holdings, job)
        if not (parked or cleared) or len(rows) < max(1, self.spill_park_min_tokens):
            return
        reason = ("store_restore" if cleared else
                  "evict" if len(rows) >= self.spill_min_tokens else "park")
        await self._save_slot(job.slot, holdings, reason, job.request_id)

    async def _save_slot(self, slot: int, holdings: Any, reason: str, request_id: str,
                         used_at: float | None = None,
                         stop: Callable[[], bool] | None = None) -> str | None:
        """One slot's conversation to the spill writer, waited for: what it skipped ("" when
        written, None when there was nothing to write; "stopped" when ``stop``, asked before
        each file, said so)."""
        engine = self.engines[slot]
        if engine is None or not self._slot_rows[slot]:
            return None
        state = await self._on_thread(engine.cache_state)
        rows = self._slot_rows[slot]
        entry = slot_entry(holdings, state, rows, len(rows), self._slot_taint[slot],
                           self.view.prefix_chunk or 1, self.spill.entries())
        if entry is None:
            return None
        # A job being planned holds the lock with the running generations (or they are paused
        # for an outside holder and take it back): the writer's grants pause them. The drain
        # (nothing holds it, the handler holds the mailbox) and a prewarm (it holds the lock)
        # keep the device still themselves.
        locked = self._lock.holder is None or bool(getattr(self, "_prewarming", False))
        msg = SpillSave(reason, slot, entry.entry_id, entry.state, entry.valid,
                        entry.token_ids, entry.anchors, entry.end, entry.meta, used_at, stop,
                        locked)
        t = time.perf_counter()
        try:
            reply = await self.spill_writer.ask(msg, SPILL_SAVE_S, sender=self)
        except (ActorStopped, TimeoutError) as exc:
            log.warning("spill_save_unanswered", slot=slot, reason=reason,
                        error=type(exc).__name__)
            skipped = "failed"
        else:
            skipped = reply.skipped
        if skipped:
            counts = self.spill_counts["save_skipped"]
            counts[skipped] = counts.get(skipped, 0) + 1
        else:
            self.spill_counts["saves"] += 1
            self.spill_counts["saved_tokens"] += entry.valid
        log.info("spill_slot_saved", request_id=request_id, slot=slot, reason=reason,
                 tokens=entry.valid, skipped=skipped or None,
                 ms=round((time.perf_counter() - t) * 1000, 2))
        return skipped

    # -- a planned stop, and the start ----------------------------------------------------------

    async def _lend_slot(self, request_id: str, slot: int) -> Any:
        reply = await self._tiers[0].ask(LendSlot(request_id, slot), 30.0, sender=self)
        return reply.holdings

    def _return_slot(self, request_id: str, slot: int, holdings: Any) -> None:
        try:
            self._tiers[0].try_tell(GenerationEnded(request_id, "finished",
                                                    self._slot_rows[slot], holdings),
                                    sender=self)
        except ActorStopped:
            pass

    async def _spill_slots(self) -> SlotsSpilled:
        """Every slot's conversation to the spill, while nothing runs (the handler holds the
        mailbox meanwhile: no request starts)."""
        if self._tiers is None or self.spill_writer is None or self.spill is None:
            return SlotsSpilled(skipped={"off": 1} if self._tiers is not None else {})
        if self._jobs or self._lock.holder is not None:
            return SlotsSpilled(busy=True)
        saved, skipped = 0, {}
        started = time.time()
        for slot in range(self.parallel):
            if self.engines[slot] is None or not self._slot_rows[slot]:
                continue
            request_id = f"spill-drain-{slot}"
            holdings = await self._lend_slot(request_id, slot)
            if holdings is None:
                continue
            try:
                why = await self._save_slot(slot, holdings, "drain", request_id)
            finally:
                self._return_slot(request_id, slot, holdings)
            if why == "":
                saved += 1
            elif why is not None:
                skipped[why] = skipped.get(why, 0) + 1
        why = await self._spill_parked(used_at=started - 1.0)
        if why == "":
            saved += 1
        elif why is not None:
            skipped[why] = skipped.get(why, 0) + 1
        log.info("spill_drain_saved", saved=saved, **{f"skipped_{k}": v for k, v in
                                                      skipped.items()})
        return SlotsSpilled(saved=saved, skipped=skipped)

    async def _spill_parked(self, used_at: float) -> str | None:
        """The drain's last step: the parked conversation, when the spill does not hold it
        already (one of ``session_spill_park_min_tokens`` was written as it was parked). Its
        head is in place in the slot it left; its rows above come back over that slot, whose
        own conversation the drain wrote already (the process stops next: the slot is left
        empty), and it is written from there."""
        slot = self._park_slot
        if slot is None or self.engines[slot] is None:
            return None
        request_id = "spill-drain-park"
        reply = await self._tiers[1].ask(OfferTiers(request_id, [], self._slot_rows[slot]),
                                         30.0, sender=self)
        park = reply.holdings
        try:
            parked = park.park.parked
            if parked is None or len(parked.token_ids) >= max(1, self.spill_park_min_tokens) \
                    or self._slot_rows[slot][:parked.head] != parked.token_ids[:parked.head]:
                return None
            await self._on_thread(self._park_into_slot, slot, parked)
            self._slot_rows[slot] = list(parked.token_ids)
            self._slot_taint[slot] = parked.taint
            held = _ParkedHoldings(parked)
            try:
                return await self._save_slot(slot, held, "drain", request_id, used_at)
            finally:
                await self._on_thread(self.engines[slot].reset)
                self._slot_rows[slot], self._slot_taint[slot] = [], None
        finally:
            try:
                self._tiers[1].try_tell(GenerationEnded(request_id, "finished", [], park),
                                        sender=self)
            except ActorStopped:
                pass

    def _park_into_slot(self, slot: int, parked: Any) -> None:
        """On the engine thread: the parked rows above its head over the slot's rows."""
        engine = self.engines[slot]
        parked.rows.restore(engine.cache_state(), parked.head, len(parked.token_ids))
        engine.resume_at(len(parked.token_ids), parked.token_ids, taint=parked.taint)

    async def _read_spill(self) -> SpillRead:
        """The most recent entries back into the empty slots, newest first, before the first
        request (the handler holds the mailbox meanwhile)."""
        if self._tiers is None or self.spill is None or self._jobs:
            return SpillRead()
        manifests = self.spill.entries()  # one copy of the index, read once
        entries = sorted(manifests, key=lambda eid: -(self.spill.last_used(eid) or 0))
        read = failed = 0
        slots = [i for i in range(self.parallel) if not self._slot_rows[i]]
        for eid, slot in zip(entries, slots):
            m = manifests[eid]
            if m.valid > self.view.window:
                continue
            await self._use_slot(slot)
            request_id = f"spill-read-{slot}"
            holdings = await self._lend_slot(request_id, slot)
            if holdings is None:
                continue
            namespace = Namespace(m.namespace)
            session = m.meta.get("session") if isinstance(m.meta, dict) else None
            try:
                ok = await self._on_thread(self._read_into_slot, slot, eid, holdings,
                                           namespace, session if isinstance(session, str)
                                           else None)
            finally:
                self._return_slot(request_id, slot, holdings)
            if ok:
                self._slot_namespace[slot] = namespace
            read += ok
            failed += not ok
        self.spill_counts["read_at_start"] += read
        log.info("spill_read_at_start", read=read, failed=failed, entries=len(entries))
        return SpillRead(read, failed)

    def _read_into_slot(self, slot: int, eid: str, holdings: Any, namespace: Namespace,
                        session: str | None = None) -> bool:
        """On the engine thread: entry ``eid`` into the empty slot ``slot``."""
        self._activate(slot)
        engine = self.engine
        try:
            report = self.spill.restore(eid, engine.cache_state(), [])
        except (SpillReadFailed, ValueError) as exc:
            log.warning("spill_read_failed", slot=slot, error=type(exc).__name__)
            engine.reset()
            self.spill_counts["read_failed"] += 1
            return False
        adopt_entry(holdings, engine, report, session, namespace, 0,
                    end_anchor=holdings.ends.end_anchor)
        self._hand_over_rows()
        return True
