"""The spill writer actor: writes whole conversations to the session spill and reads them back
(spec: "Live conversations on the NVMe", "Its own I/O path", "The day's write budget"; issue 16,
parts 6, 7 and 8).

The actor owns the ``SessionSpill`` (tandem/io/spill.py; a callable resolved at start, the
engine building it on its thread beside the disk tier) and one single-thread executor, ``io``:
every save, restore, clear and sweep runs there, one at a time, in the order they came (the
spill's ``io_lock`` holds the engine thread's own restores to the same rule). A save or a
restore is answered later (``Deferred``): the mailbox moves on meanwhile, so `GetSpillStats`
is answered while a save runs.

The write guard (the disk tier's WriteGuard, the spill's ``guard``): a drain is always
written; an eviction, a park and a store restore only while ``may_spill("eviction", valid)``;
a refusal is logged and journaled by the guard (``skipped``) and answered ``skipped="guard"``.
The spill adds every byte it writes to the guard's count itself.

Budget and TTL: the spill evicts at start and every ``sweep_every_s`` (a task the actor owns,
on its clock), and a save makes room for itself.

The capture lock (spec: "The writer and CUDA graph captures"): on CUDA the save's device work
(the block sums and each buffer's planes, with their copies to the host) runs on the ``io``
thread, outside the engine, so each step holds a grant of the engine's capture lock
(``RequestCaptureLock``, as the disk writer's copies do): a graph capture never runs beside
it, and waits at most one buffer's copy (a block's K or V, an anchor's section). A save whose sender keeps the device still
(``SpillSave.locked``) and a CPU state take no grant: nothing to wait for, no cost.

Nothing here fails a request: an I/O error is a `SpillSaved` with ``skipped="failed"`` (the
entry gone, logged, counted) or a `SpillRestored` with ``failed`` set. Anything else is a bug
and stops the actor (`SpillWriterFaulted`), hence the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import structlog

from tandem.actors.engine_messages import (CaptureLockGranted, ReleaseCaptureLock,
                                           RequestCaptureLock)
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStopped, Deferred
from tandem.actors.spill_messages import (ClearSpill, DrainSpill, GetSpillStats, SaveReason,
                                          SpillCleared, SpillDrained, SpillRestore,
                                          SpillRestored, SpillSave, SpillSaved, SpillStats,
                                          SpillWriterFaulted)
from tandem.io.spill import SessionSpill, SpillReadFailed, SpillStopped, SpillWriteFailed
from tandem.io.write_guard import WriteGuard
from tandem.torch_thread import one_openmp_thread_here

log = structlog.get_logger("tandem.spill_writer")

SWEEP_EVERY_S = 300.0  # the TTL and budget sweep between two saves
REASONS: tuple[SaveReason, ...] = ("drain", "evict", "park", "store_restore")


def on_device(state: Any) -> bool:
    """Whether a save of ``state`` issues device work (its rows are not the host's)."""
    return any(v.tensor.device.type != "cpu" for v in state.views.values())


class SpillWriterActor(Actor):
    def __init__(self, name: str = "spill_writer", *,
                 spill: "SessionSpill | Callable[[], SessionSpill | None] | None",
                 guard: "WriteGuard | Callable[[], WriteGuard | None] | None" = None,
                 sweep_every_s: float = SWEEP_EVERY_S, engine: Actor | None = None,
                 **actor_options: Any) -> None:
        """``guard``: the write guard when the spill has none of its own (the disk tier's;
        the spill then counts its bytes there too). A spill that resolves to None is a writer
        that answers every save ``off``. ``engine``: whose capture lock a save of device rows
        holds around its device work (None: no lock to take)."""
        super().__init__(name, **actor_options)
        self.engine = engine
        self._grants: asyncio.Queue[CaptureLockGranted] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        if not sweep_every_s > 0:
            raise ValueError("sweep_every_s must be positive")
        self.spill = spill
        self.guard = guard
        self.sweep_every_s = sweep_every_s
        self._io: ThreadPoolExecutor | None = None
        self._sweeper: asyncio.Task | None = None
        self._running: set[asyncio.Future] = set()  # saves and restores not answered yet
        self._fault: BaseException | None = None
        self.counters: dict[str, Any] = {
            "saves": 0, "unchanged": 0, "saves_by_reason": dict.fromkeys(REASONS, 0),
            "skips": {"guard": 0, "budget": 0, "failed": 0, "off": 0, "stopped": 0},
            "restores": 0, "restore_failures": 0, "failures": 0, "nbytes_written": 0,
            "blocks_written": 0, "blocks_kept": 0, "nbytes_read": 0, "sweeps": 0,
            "swept": 0, "clears": 0, "grants": 0}
        self.last_save: dict[str, Any] | None = None

    async def on_start(self) -> None:
        if callable(self.spill) and not isinstance(self.spill, SessionSpill):
            self.spill = self.spill()  # built on the engine thread, after this actor was
        if callable(self.guard) and not isinstance(self.guard, WriteGuard):
            self.guard = self.guard()
        self._loop = asyncio.get_running_loop()
        if self.spill is None:
            log.info("spill_writer_without_spill")
            return
        if self.spill.guard is None:
            self.spill.guard = self.guard  # one day's count: every byte it writes goes there
        self.guard = self.spill.guard
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}-io")
        await self._on(one_openmp_thread_here)
        await self._sweep()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_every())

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._io is not None:
            self._io.shutdown(wait=True)  # a save under way finishes: no torn entry left
        if isinstance(self.guard, WriteGuard):
            self.guard.save()
        if isinstance(self.spill, SessionSpill):
            # The writer owns the instance: its I/O thread and folder descriptor end with it
            # (a server started and stopped in one process leaves no spill thread behind).
            self.spill.close()

    # -- messages --------------------------------------------------------------------------

    async def handle(self, msg: Message) -> object | None:
        if self._fault is not None:
            raise self._fault
        match msg:
            case SpillSave():
                if self.spill is None:
                    self.counters["skips"]["off"] += 1
                    return SpillSaved(msg.entry_id, "off")
                return self._later(self._save, msg, time.perf_counter())
            case SpillRestore():
                if self.spill is None:
                    return SpillRestored(msg.entry_id, None, "off", len(msg.rows_in_place))
                return self._later(self._restore, msg)
            case GetSpillStats():
                return SpillStats(self.report())
            case ClearSpill():
                if self.spill is None:
                    return SpillCleared({"entries": 0, "nbytes": 0})
                dropped = await self._on(self.spill.clear)
                self.counters["clears"] += 1
                return SpillCleared(dropped)
            case DrainSpill():
                while self._running:  # every save told before this one, and the ones after it
                    await asyncio.wait(set(self._running))
                if isinstance(self.guard, WriteGuard):
                    await self._on(self.guard.save)
                return SpillDrained()
            case CaptureLockGranted():
                self._grants.put_nowait(msg)
            case SpillWriterFaulted():
                pass  # the fault was raised above
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    @property
    def on(self) -> bool:
        """Whether there is a spill to write (False before the start resolved it)."""
        return isinstance(self.spill, SessionSpill)

    def report(self) -> dict[str, Any]:
        """The writer's counters and the spill's index (its own lock): /v1/cache/stats,
        /metrics and the console read it on the loop."""
        if not self.on:
            return {"on": False}
        c = self.counters
        return {"on": True, **self.spill.statistics(),
                "queued": len(self._running),
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in c.items()},
                "skips_total": sum(c["skips"].values()),
                "last_save": self.last_save}

    # -- the work, on the io thread --------------------------------------------------------

    def _save(self, msg: SpillSave, queued_at: float) -> SpillSaved:
        writer_ms = (time.perf_counter() - queued_at) * 1000.0
        guard = self.guard
        kind = "drain" if msg.reason == "drain" else "eviction"
        if isinstance(guard, WriteGuard) and not guard.may_spill(kind, msg.valid):
            guard.skipped("spill", guard.level(), tokens=msg.valid)
            self.counters["skips"]["guard"] += 1
            return SpillSaved(msg.entry_id, "guard")
        try:
            report = self.spill.save(msg.entry_id, msg.state, msg.valid, msg.token_ids,
                                     msg.anchors, msg.end, msg.meta, writer_ms=writer_ms,
                                     now=msg.used_at, stop=msg.stop,
                                     device_calls=self._device_calls(msg))
        except SpillStopped:
            self.counters["skips"]["stopped"] += 1
            return SpillSaved(msg.entry_id, "stopped")
        except SpillWriteFailed as exc:
            # the spill logged it (spill_write_failed) and deleted what it had written
            self.counters["failures"] += 1
            self.counters["skips"]["failed"] += 1
            log.warning("spill_save_failed", reason=msg.reason, rows=msg.valid,
                        errno=exc.errno)
            return SpillSaved(msg.entry_id, "failed")
        if report.skipped == "budget":
            self.counters["skips"]["budget"] += 1
            return SpillSaved(msg.entry_id, "budget", report, dict(report.ms))
        c = self.counters
        c["saves"] += 1
        c["saves_by_reason"][msg.reason] += 1
        c["unchanged"] += report.skipped == "nothing"
        c["nbytes_written"] += report.nbytes_written + report.manifest_nbytes
        c["blocks_written"] += report.blocks_written
        c["blocks_kept"] += report.blocks_kept
        self.last_save = {"reason": msg.reason, "rows": report.valid,
                          "nbytes": report.nbytes_written, "entry_nbytes": report.entry_nbytes,
                          "blocks_written": report.blocks_written,
                          "blocks_kept": report.blocks_kept, "at": self.clock.wall_time(),
                          "ms": {k: round(v, 2) for k, v in report.ms.items()}}
        return SpillSaved(msg.entry_id, "", report, dict(report.ms))

    def _restore(self, msg: SpillRestore) -> SpillRestored:
        try:
            report = self.spill.restore(msg.entry_id, msg.state, msg.rows_in_place,
                                        line=msg.line)
        except SpillReadFailed as exc:  # logged by the spill; the entry is gone
            self.counters["restore_failures"] += 1
            return SpillRestored(msg.entry_id, None, exc.reason, exc.intact_below)
        self.counters["restores"] += 1
        self.counters["nbytes_read"] += report.nbytes_read
        return SpillRestored(msg.entry_id, report)

    async def _sweep(self) -> None:
        try:
            gone = await self._on(self.spill.sweep)
        except OSError as exc:  # a folder the next sweep tries again
            log.warning("spill_sweep_failed", errno=exc.errno, error=type(exc).__name__)
            return
        self.counters["sweeps"] += 1
        self.counters["swept"] += len(gone)

    async def _sweep_every(self) -> None:
        try:
            while True:
                await self.clock.sleep(self.sweep_every_s)
                await self._sweep()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._faulted(exc)

    # -- helpers ---------------------------------------------------------------------------

    def _later(self, work: Callable[..., Message], *args: Any) -> Deferred:
        fut = asyncio.get_running_loop().run_in_executor(self._io, work, *args)
        self._running.add(fut)
        fut.add_done_callback(self._done)
        return Deferred(fut)

    def _done(self, fut: asyncio.Future) -> None:
        self._running.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            self._faulted(fut.exception())

    def _faulted(self, exc: BaseException) -> None:
        self._fault = exc
        log.error("spill_writer_failed", error=type(exc).__name__)
        try:
            self.try_tell(SpillWriterFaulted(type(exc).__name__), sender=self)
        except Exception:
            pass  # stopped or full: the next message raises the fault anyway

    # -- the capture lock (the io thread's side) ---------------------------------------------

    def _device_calls(self, msg: SpillSave) -> Callable[[], Any] | None:
        """What the save holds around its device work: a grant, for device rows of an engine
        whose generations may capture meanwhile; None otherwise (no cost)."""
        if self.engine is None or msg.locked or not on_device(msg.state):
            return None
        return self._held

    @contextlib.contextmanager
    def _held(self):
        """On the io thread: a grant of the engine's capture lock, asked and released through
        the loop (the grant comes on its own queue, never behind a handler)."""
        loop = self._loop
        grant = asyncio.run_coroutine_threadsafe(self._acquire(), loop).result()
        try:
            yield
        finally:
            asyncio.run_coroutine_threadsafe(self._release(grant), loop).result()

    async def _acquire(self) -> int:
        await self.engine.tell(RequestCaptureLock(self.name, self._grants), sender=self)
        grant = await self._grants.get()
        self.counters["grants"] += 1
        return grant.grant_id

    async def _release(self, grant_id: int) -> None:
        try:
            await self.engine.tell(ReleaseCaptureLock(self.name, grant_id), sender=self)
        except ActorStopped:
            pass  # a stopped engine holds no lock any more

    async def _on(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def check_invariants(self) -> None:
        if isinstance(self.spill, SessionSpill):
            entries = self.spill.entries()
            assert self.spill.nbytes == sum(m.nbytes for m in entries.values())
