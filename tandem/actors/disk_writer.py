"""The disk writer actor: copies a prefill's chunk rows out of its slot after the prefill, under
the engine's capture lock, and writes the plan's files while the request decodes (spec: "Disk
tier", "The writes never hold a request" and "The writer and CUDA graph captures").

The actor owns the ``DiskTier`` (tandem/io/tier.py) and two single-thread executors: ``copy``
(the device-to-host copies, each one chunk, each under its own grant of the capture lock, so a
capture waits at most one chunk's copy) and ``io`` (every file write, delete and the counts'
save, in the order the jobs came). A worker task owned by the actor runs the jobs one at a
time, at most ``max_ahead`` copied chunks ahead of the disk (the host holds no more than that
of a job's rows); the mailbox stays free meanwhile, so a `Fence` is answered while a job waits
for the lock or the disk.

The window: a job's rows stay in the slot where the prefill wrote them until a `Fence` of that
slot closes it above the fence's row; chunks not copied by then are dropped, never copied from
rows another request is writing. A grant reaches the worker through its own queue (the
``reply_to`` of `RequestCaptureLock`), never behind a handler in the mailbox.

The drive's turns (tandem.io.turns, shared with the session spill): while a spill save runs, the
``io`` thread waits before its next file, at most ``spill_wait_s`` (30 s), and logs
``disk_writer_waited_for_spill``; the wait is the writer's own, between two files, so no request
and no fence waits for it.

Nothing here fails a request: an I/O error is the tier's to log and count. Anything else the
worker raises is a bug and stops the actor (`DiskWriterFaulted`), hence the system.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from tandem.actors.disk_messages import (ClearDisk, DiskCleared, DiskDrained, DiskJob,
                                         DiskStats, DiskWriterFaulted, DrainDisk, Fence,
                                         Fenced, GetDiskStats)
from tandem.actors.engine_messages import (CaptureLockGranted, ReleaseCaptureLock,
                                           RequestCaptureLock)
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStopped
from tandem.cache.copies import SectionsCopy
from tandem.io.tier import DiskTier, host_rows
from tandem.io.turns import MAX_WAIT_S, IoTurns
from tandem.torch_thread import one_openmp_thread_here

log = structlog.get_logger("tandem.disk_writer")

MAX_AHEAD = 2  # copied chunks waiting for the disk, at most (the spec's two chunk slots)


@dataclass
class _Job:
    msg: DiskJob
    todo: deque[int]  # chunk lines not copied yet, lowest first; a fence takes from it


class DiskWriterActor(Actor):
    def __init__(self, name: str = "disk_writer", *, tier: "DiskTier | Callable[[], DiskTier]",
                 engine: Actor | None = None, max_ahead: int = MAX_AHEAD,
                 spill_turns: "IoTurns | Callable[[], IoTurns | None] | None" = None,
                 spill_wait_s: float = MAX_WAIT_S, **actor_options: Any) -> None:
        """``spill_turns``: the session spill's (``SessionSpill.turns``; a callable resolved at
        start, like the tier), None when there is no spill to give way to."""
        super().__init__(name, **actor_options)
        if max_ahead < 1:
            raise ValueError("max_ahead must be at least 1")
        self.tier = tier
        self.engine = engine  # None: no capture lock to take (a CPU engine without captures)
        self.max_ahead = max_ahead
        self.spill_turns = spill_turns
        self.spill_wait_s = spill_wait_s
        self._jobs: deque[_Job] = deque()
        self._copying: tuple[int, int] | None = None  # (slot, line) of the copy under way
        self._copy_done = asyncio.Event()
        self._copy_done.set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._grants: asyncio.Queue[CaptureLockGranted] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._copy: ThreadPoolExecutor | None = None
        self._io: ThreadPoolExecutor | None = None
        self._fault: BaseException | None = None
        self.counters = {"jobs": 0, "copied_chunks": 0, "grants": 0, "window_drops": 0,
                         "spill_waits": 0, "spill_wait_ms": 0.0, "spill_waits_capped": 0}

    async def on_start(self) -> None:
        if callable(self.tier) and not isinstance(self.tier, DiskTier):
            # The tier built after this actor was (the engine builds it on its thread, from
            # its manifest): resolved once the actors before this one have started.
            self.tier = self.tier()
        if self.tier is None:
            raise RuntimeError(f"{self.name}: no disk tier to write")
        if callable(self.spill_turns) and not isinstance(self.spill_turns, IoTurns):
            self.spill_turns = self.spill_turns()
        self._copy = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}-copy")
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}-io")
        # Their copies' and crc32's OpenMP regions on these threads alone (tandem/torch_thread).
        await self._on(self._copy, one_openmp_thread_here)
        await self._on(self._io, one_openmp_thread_here)
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def on_stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._copy is not None:
            self._copy.shutdown(wait=True)
        if self._io is not None:
            self._io.submit(self.tier.save_counts)
            self._io.shutdown(wait=True)

    # -- messages --------------------------------------------------------------------------

    async def handle(self, msg: Message) -> object | None:
        if self._fault is not None:
            raise self._fault
        match msg:
            case DiskJob():
                self._jobs.append(_Job(msg, deque(sorted(msg.plan.chunk_lines))))
                self.counters["jobs"] += 1
                self._idle.clear()
                self._wake.set()
            case Fence(slot=slot, from_row=from_row):
                return await self._fence(slot, from_row)
            case CaptureLockGranted():
                self._grants.put_nowait(msg)
            case GetDiskStats():
                return DiskStats({**self.tier.statistics(), "queued_jobs": len(self._jobs),
                                  "writer": dict(self.counters)})
            case ClearDisk():
                return DiskCleared(await self._on(self._io, self.tier.clear))
            case DrainDisk():
                await self._idle.wait()
                await self._on(self._io, self.tier.save_counts)
                return DiskDrained()
            case DiskWriterFaulted():
                pass  # the fault was raised above
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    async def _fence(self, slot: int, from_row: int) -> Fenced:
        entries, lines = [], []
        for job in self._jobs:
            if job.msg.slot != slot:
                continue
            # rows [line - grid, line) reach from_row iff line > from_row
            closed = [line for line in job.todo if line > from_row]
            if closed:
                job.todo = deque(line for line in job.todo if line <= from_row)
                entries += [("chunk", job.msg.plan.key(line)) for line in closed]
                lines += closed
        self.tier.drop_entries(entries, lines, "window")
        self.counters["window_drops"] += len(entries)
        copying = self._copying
        if copying is not None and copying[0] == slot and copying[1] > from_row:
            await self._copy_done.wait()  # one chunk's copy, under a grant it already holds
        return Fenced(slot, len(entries))

    # -- the worker ------------------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while True:
                if not self._jobs:
                    self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._write_job(self._jobs[0])
                self._jobs.popleft()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fault = exc
            log.error("disk_writer_failed", error=type(exc).__name__)
            try:
                self.try_tell(DiskWriterFaulted(type(exc).__name__), sender=self)
            except Exception:
                pass  # stopped or full: the next message raises the fault anyway

    async def _write_job(self, job: _Job) -> None:
        msg = job.msg
        plan = msg.plan
        g = plan.grid
        writes: deque[asyncio.Future] = deque()
        while True:
            while len(writes) >= self.max_ahead:
                await writes.popleft()
            if not job.todo:
                break
            try:
                grant = await self._acquire()
            except ActorStopped:
                self._drop_rest(job)  # the engine is gone: its rows are nobody's to copy
                break
            try:
                if not job.todo:
                    break  # a fence took the rest while the grant was coming
                line = job.todo.popleft()
                self._copying = (msg.slot, line)
                self._copy_done.clear()
                try:
                    rows = await self._on(self._copy, host_rows, msg.views, line - g, line)
                finally:
                    self._copying = None
                    self._copy_done.set()
            finally:
                await self._release(grant)
            self.counters["copied_chunks"] += 1
            # submitted now, so the next chunk's copy overlaps this one's write
            writes.append(asyncio.get_running_loop().run_in_executor(
                self._io, self._file, self.tier.write_chunk, plan, line,
                msg.token_ids[line - g:line], rows))
        for w in writes:
            await w
        for line in plan.anchor_lines:
            staged = msg.staged.get(line)
            if staged is None:
                self.tier.drop_entries([("anchor", plan.key(line))], [line], "drop")
                continue
            staged = await self._on_host(staged)
            await self._on(self._io, self._file, self.tier.write_anchor, plan, line, staged)
        await self._on(self._io, self.tier.save_counts)

    def _file(self, write: Callable[..., bool], *args: Any) -> bool:
        """One file on the ``io`` thread, after the spill save under way (if any)."""
        turns = self.spill_turns
        if turns is None:
            return write(*args)
        with turns.file(self.spill_wait_s) as turn:
            if turn.waited:
                # counters: the io thread's; read on the loop as a snapshot
                self.counters["spill_waits"] += 1
                self.counters["spill_wait_ms"] += turn.ms
                self.counters["spill_waits_capped"] += turn.capped
                log.info("disk_writer_waited_for_spill", ms=round(turn.ms, 1),
                         capped=turn.capped)
            return write(*args)

    def _drop_rest(self, job: _Job) -> None:
        lines = list(job.todo)
        job.todo.clear()
        self.tier.drop_entries([("chunk", job.msg.plan.key(line)) for line in lines], lines,
                               "drop")

    async def _on_host(self, staged: SectionsCopy) -> SectionsCopy:
        """A staged anchor on the device comes to the host under the lock (its write would
        otherwise be a device call outside it)."""
        if all(t.device.type == "cpu" for t in staged.tensors.values()):
            return staged
        grant = await self._acquire()
        try:
            return await self._on(self._copy, lambda: SectionsCopy(
                {name: t.to("cpu", copy=True) for name, t in staged.tensors.items()}))
        finally:
            await self._release(grant)

    # -- the capture lock ------------------------------------------------------------------

    async def _acquire(self) -> int | None:
        if self.engine is None:
            return None
        await self.engine.tell(RequestCaptureLock(self.name, self._grants), sender=self)
        grant = await self._grants.get()
        self.counters["grants"] += 1
        return grant.grant_id

    async def _release(self, grant_id: int | None) -> None:
        if grant_id is None or self.engine is None:
            return
        try:
            await self.engine.tell(ReleaseCaptureLock(self.name, grant_id), sender=self)
        except ActorStopped:
            pass  # a stopped engine holds no lock any more

    async def _on(self, executor: ThreadPoolExecutor | None, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.tier.check_invariants()
        for job in self._jobs:
            assert list(job.todo) == sorted(set(job.todo)), "a job's lines out of order"
            assert set(job.todo) <= set(job.msg.plan.chunk_lines)
        assert self._copying is None or not self._copy_done.is_set()
