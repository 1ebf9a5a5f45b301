"""The disk tier: the index, the usage and the admission over one folder of chunk and anchor
files, and the three things done with them (spec: "Disk tier").

- ``plan`` (the loop, in the prefill's plan): what a prefill writes (``Admission.decide``);
- ``offer`` (the loop) and ``restore`` (the engine thread, into the buffers of the slot it
  serves): the longest usable anchor above the rows in place, read and checked before a byte of
  each file reaches the engine. The engine thread reads each file whole, in one transfer, into
  host buffers the tier keeps (``Staging``); one checker thread sums it and copies it in while
  the next is read (the last file's work shared with the engine thread, nothing being left to
  read), so the restore runs at about the disk's rate;
- ``write_chunk`` / ``write_anchor`` / ``drop_entries`` (the disk writer's thread): the files a
  plan named, room made by value first, every outcome reported to the admission once.

Thread rule: the index, the usage, the admission, the counters and the events are touched only
under ``self._lock``, held briefly; file I/O runs outside it. A restore in flight protects the
keys it reads from eviction (``_reading``), and a write protects its chain, so neither loses a
file under the other. The tier reads no clock of its own: ``wall`` (usage, events) and
``monotonic`` (rates) are given.

A write or fsync error never raises: the entry is deleted, logged (``disk_write_failed``) and
counted, and the admission is told it failed, so a later plan admits it again. A file that fails
a restore's check is deleted with every longer chunk of the prompt's chain, the index forgets
them, and ``DiskReadFailed`` tells the caller to resume from the rows in place (rows below the
offer's ``start`` are never written).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import structlog
import torch

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.namespace import Namespace
from tandem.devices import host_clone
from tandem.io.admission import Admission, DiskPlan, Entry, write_atomic
from tandem.io.chain import Key, chain_keys
from tandem.io.direct import ALIGN, round_up
from tandem.io.eviction import (BUDGET_NBYTES, DAY_S, FREE_FLOOR_NBYTES, TTL_S, TierUsage,
                                room_for, seed_from_files)
from tandem.io.fingerprint import FingerprintInputs, Identity, tier_identity
from tandem.io.tierfile import (Loaded, MissingFile, Section, Staging, TierFileError,
                                TierFiles)
from tandem.io.tierindex import AnchorEntry, ChunkEntry, TierIndex, scan
from tandem.io.write_guard import WriteGuard, make_write_guard
from tandem.models.base import CacheState, View
from tandem.models.rows import rows_written
from tandem.torch_thread import one_openmp_thread_here

log = structlog.get_logger("tandem.disk")

GB = 10 ** 9
COUNTS_FILE = "admission.counts"
EVENTS = 20  # the last events the console shows
UNJOURNALED = 4096  # events held for drain_events between two calls, at most (oldest go first)
TOP_PREFIXES = 8
# Rates before the first measurement: a slow NVMe's (the box's reads 7.35 GB/s, writes 4.3).
PRIOR_READ_BPS = 1.0 * GB
PRIOR_WRITE_BPS = 0.5 * GB
RATE_WEIGHT = 0.3  # an exponential mean: the newest transfer's weight
# Files a restore has read and its checker not yet verified and copied: with the one being read,
# the host buffers a restore holds (kept for the next one, up to STAGING_KEEP_NBYTES).
CHECK_DEPTH = 2
STAGING_KEEP_NBYTES = 256 << 20

Mode = Literal["off", "on"]
EventKind = Literal["hit", "write", "eviction", "drop", "window", "failed_restore",
                    "write_failed"]


class DiskReadFailed(Exception):
    """A restore stopped at a file that failed its check (or went missing); the file and every
    longer chunk of the chain are gone. ``reason``: the ``TierFileError``'s. Names no token."""

    def __init__(self, reason: str, kind: str, key: str):
        super().__init__(f"disk restore failed: {kind} {key[:12]} {reason}")
        self.reason = reason
        self.kind = kind
        self.key = key


@dataclass(frozen=True)
class DiskOffer:
    """The longest usable anchor of a prompt above ``start``: resuming at ``line`` reads
    ``chunk_keys_to_read`` (the chunks holding rows at or above ``start``, their first at chunk
    index ``first_chunk``) and the anchor, ``read_nbytes`` in all, in about ``est_ms``."""

    line: int
    start: int
    anchor_key: Key
    chunk_keys_to_read: tuple[Key, ...]
    first_chunk: int
    read_nbytes: int
    est_ms: float
    namespace: str

    @property
    def tokens_saved(self) -> int:
        return self.line - self.start

    def worth(self, prefill_tok_s: float) -> bool:
        """Whether the read costs less than the prefill it saves at ``prefill_tok_s``."""
        return prefill_tok_s <= 0 or self.est_ms < self.tokens_saved / prefill_tok_s * 1000.0


@dataclass
class WriteReport:
    written: list[Entry] = field(default_factory=list)
    failed: list[Entry] = field(default_factory=list)  # an I/O error, or no room
    dropped: list[Entry] = field(default_factory=list)  # never copied (window, no staged state)
    nbytes: int = 0


@dataclass
class HostRows(RowsCopy):
    """A ``RowsCopy`` on the host that knows each view's token axis (a chunk file names it)."""

    token_axes: dict[str, int] = field(default_factory=dict)

    def views(self) -> dict[str, "_Shifted"]:
        """The copy as views whose ``rows(start, stop)`` are its rows ``[start, stop)``."""
        return {name: _Shifted(t, self.token_axes[name], self.start)
                for name, t in self.tensors.items()}


def host_rows(views: Mapping[str, View], start: int, stop: int) -> HostRows:
    """Rows ``[start, stop)`` of every view, copied to the host (the writer's device copy, taken
    under the capture lock; on a CPU a clone)."""
    out = {}
    for name, v in views.items():
        t = v.rows(start, stop)
        out[name] = host_clone(t)  # a CPU tensor's clone; a device one's pinned copy
    return HostRows(start, stop, out, {name: v.token_axis for name, v in views.items()})


def _file_nbytes(tensors: Sequence[torch.Tensor], extra_sections: int = 0) -> int:
    """A tier file's size within a header line or two (room is made before the write)."""
    return (sum(round_up(t.numel() * t.element_size()) for t in tensors)
            + (1 + extra_sections) * ALIGN + ALIGN)


class DiskTier:
    def __init__(self, root: str | os.PathLike, identity: Identity, grid: int, *,
                 admission: Admission, budget_nbytes: int = BUDGET_NBYTES,
                 ttl_s: float = TTL_S, floor_nbytes: int = FREE_FLOOR_NBYTES,
                 mode: Mode = "on", direct: bool = True,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.perf_counter,
                 free_nbytes: Callable[[Path], int] | None = None,
                 guard: WriteGuard | None = None):
        """``guard``: the day's write budget (shared with the spill); None writes unguarded."""
        if admission.grid != grid:
            raise ValueError("the admission counts another grid")
        self.root = Path(root)
        self.files = TierFiles(self.root, direct=direct)
        self.identity = identity
        self.grid = grid
        self.admission = admission
        self.mode: Mode = mode
        self.budget_nbytes = budget_nbytes
        self.ttl_s = ttl_s
        self.floor_nbytes = floor_nbytes
        self.min_floor_nbytes = floor_nbytes  # a setting may raise the floor, never lower it
        self._wall = wall
        self._monotonic = monotonic
        self._free = free_nbytes or _free_nbytes
        self.guard = guard
        self._lock = threading.Lock()
        self._unjournaled: deque[dict[str, Any]] = deque(maxlen=UNJOURNALED)
        self.index, self.scanned = scan(self.files, identity, grid)
        self.usage = TierUsage()
        seed_from_files(self.usage, self.files, self.index)
        self._reading: dict[Key, int] = {}  # keys a restore in flight reads: never evicted
        self._staging = Staging(STAGING_KEEP_NBYTES)  # a restore's host buffers, kept
        self.read_bps = PRIOR_READ_BPS
        self.write_bps = PRIOR_WRITE_BPS
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS)
        self.counters = {"hits": 0, "misses": 0, "failed_restores": 0, "restored_tokens": 0,
                         "read_nbytes": 0, "writes": 0, "written_nbytes": 0, "write_failures": 0,
                         "skipped_no_room": 0, "evictions": 0, "evicted_nbytes": 0,
                         "window_drops": 0, "drops": 0, "clears": 0}

    def close(self) -> None:
        if self.guard is not None:
            self.guard.save()
        self.files.close()

    # -- settings --------------------------------------------------------------------------

    def configure(self, *, mode: Mode | None = None, budget_gb: float | None = None,
                  ttl_days: float | None = None, admit_after: int | None = None,
                  min_free_gb: float | None = None) -> None:
        """The console's settings, applied from the next request. The floor never goes under
        the one the tier was started with."""
        with self._lock:
            if mode is not None:
                self.mode = mode
            if budget_gb is not None:
                if budget_gb < 0:
                    raise ValueError("budget_gb must not be negative")
                self.budget_nbytes = int(budget_gb * GB)
            if ttl_days is not None:
                if ttl_days <= 0:
                    raise ValueError("ttl_days must be positive")
                self.ttl_s = ttl_days * DAY_S
            if min_free_gb is not None:
                self.floor_nbytes = max(self.min_floor_nbytes, int(min_free_gb * GB))
            self.admission.configure(admit_after=admit_after)

    # -- the plan (the loop) ---------------------------------------------------------------

    def plan(self, prompt_ids: Sequence[int], namespace: Namespace, *, start: int,
             taint: int | None, first_of_session: bool = False,
             last_user_start: int | None = None, head_stop: int | None = None,
             from_snapshot: bool = False) -> DiskPlan:
        """What this prefill writes (empty when the tier is off, or when the day's write
        budget is spent: the lines are still counted, so the next day admits them)."""
        with self._lock:
            if self.mode == "off":
                return DiskPlan(self.grid)
            plan = self.admission.decide(
                prompt_ids, namespace, start=start, taint=taint, on_disk=self.index,
                first_of_session=first_of_session, last_user_start=last_user_start,
                head_stop=head_stop, from_snapshot=from_snapshot)
            if plan.empty or self.guard is None:
                return plan
            level = self.guard.level()
            if level == "ok":
                return plan
            # Never written, never failed: the entries leave the pending set unreported.
            self.admission.pending.difference_update(plan.entries())
        self.guard.skipped("tier", level, tokens=len(prompt_ids))
        return DiskPlan(self.grid)

    def offer(self, prompt_ids: Sequence[int], namespace: Namespace, *,
              start: int, count: bool = True) -> DiskOffer | None:
        """The longest usable anchor at a line above ``start`` and below the prompt's last token
        (a prefill forwards at least one), or None. ``count`` False: a miss is not counted (a
        peek's)."""
        g = self.grid
        top = len(prompt_ids) - 1
        if top < g or top // g * g <= start:
            return None
        chain = chain_keys(prompt_ids, g, namespace, stop=top)
        with self._lock:
            if self.mode == "off":
                return None
            hit = self.index.longest_anchor(chain)
            if hit is None or hit.line <= start:
                self.counters["misses"] += count
                return None
            first = start // g
            keys = tuple(chain[first:hit.line // g])
            nbytes = hit.anchor.nbytes + sum(self.index.chunks[k].nbytes for k in keys)
            est_ms = nbytes / self.read_bps * 1000.0
        return DiskOffer(hit.line, start, hit.anchor.key, keys, first, nbytes, est_ms,
                         str(namespace))

    # -- the restore (the engine thread) ---------------------------------------------------

    def restore(self, offer: DiskOffer, prompt_ids: Sequence[int], state: CacheState) -> None:
        """Resume ``state`` at ``offer.line``: the rows of every view from the chunk files (each
        chunk's whole, from the first, the one that holds ``offer.start``: rows in place below
        ``start`` in that chunk are replaced by the grid's, of the same tokens, once every file
        has passed: a prefill that ended inside a chunk computed them in a shorter one, whose
        bits a host's matmuls may round otherwise; the engine's offers start on a grid line,
        where there are none), then the anchor's sections. Every file is read whole into one of the
        tier's host buffers and checked whole there (its token ids against the prompt's, element
        by element; every section's crc32; the state's layout) before a byte of it is copied
        into ``state``; the sections are copied only once every file has passed. Raises
        ``DiskReadFailed`` after deleting what failed; ``state`` at its length is then as it
        was (its sections and its rows below ``start``); rows above ``start`` may hold rows of
        files that passed, and no read sees a row above the length."""
        keys = list(offer.chunk_keys_to_read)
        # rows from the first chunk's start are written (on the checkers too): borrowers of
        # rows above it copy them first, here, before any thread writes
        rows_written(state.views, offer.first_chunk * self.grid)
        with self._lock:
            for k in keys + [offer.anchor_key]:
                self._reading[k] = self._reading.get(k, 0) + 1
            # by kind too: an anchor's key is the key of the last chunk below it
            expect: dict[Entry, int] = {
                ("chunk", k): e.nbytes for k in keys
                if (e := self.index.chunks.get(k)) is not None}
            if (a := self.index.anchors.get(offer.anchor_key)) is not None:
                expect[("anchor", offer.anchor_key)] = a.nbytes
        t0 = self._monotonic()
        held: dict[str, torch.Tensor] = {}  # the first chunk's rows below start
        try:
            try:
                anchor = self._read_rows(offer, prompt_ids, state, expect, held)
            except TierFileError as exc:
                self._failed_restore(exc, offer, prompt_ids)
                raise DiskReadFailed(exc.reason, exc.kind, exc.key) from None
            try:
                with torch.inference_mode():
                    a = offer.first_chunk * self.grid
                    for name, rows in held.items():
                        _copy_into(state.views[name].rows(a, offer.start), rows)
                    anchor.anchor().sections.restore(state)
            finally:
                self._staging.give([anchor.buf])
        finally:
            with self._lock:
                for k in keys + [offer.anchor_key]:
                    left = self._reading[k] - 1
                    if left:
                        self._reading[k] = left
                    else:
                        del self._reading[k]
        took_s = max(self._monotonic() - t0, 1e-9)
        with self._lock:
            entry = self.index.anchors.get(offer.anchor_key)
            if entry is not None:
                self.usage.hit(entry, self._wall())
            self.read_bps = _mean(self.read_bps, offer.read_nbytes / took_s)
            self.counters["hits"] += 1
            self.counters["restored_tokens"] += offer.tokens_saved
            self.counters["read_nbytes"] += offer.read_nbytes
            self._event("hit", offer.line, offer.anchor_key)
        log.info("disk_restored", line=offer.line, start=offer.start,
                 chunks=len(keys), nbytes=offer.read_nbytes, ms=round(took_s * 1000.0, 2))

    def _read_rows(self, offer: DiskOffer, prompt_ids: Sequence[int], state: CacheState,
                   expect: Mapping[Entry, int], held: dict[str, torch.Tensor]) -> Loaded:
        """The anchor, then the chunks, each read whole into a staging buffer on this thread
        while the checker verifies the one before and copies its rows into ``state`` (the reads
        wait on the disk, the sums and the copies on a core: the one overlaps the other). The
        anchor comes back verified, its sections not yet copied. Raises the first failure in
        read order (a chunk's deletes every longer one, so the lowest wins) once nothing of
        this restore is in flight, and with every buffer back in the staging."""
        # One checker a restore (a thread costs microseconds against a restore's milliseconds).
        # One: with two, each chunk's sections summed and copied on both, the reads slowed more
        # than the tail shrank (bench_disk: 0.74 of the raw read against 0.83).
        with ThreadPoolExecutor(1, thread_name_prefix="tandem-disk-check",
                                initializer=one_openmp_thread_here) as checker:
            return self._read_rows_with(checker, offer, prompt_ids, state, expect, held)

    def _read_rows_with(self, checker: ThreadPoolExecutor, offer: DiskOffer,
                        prompt_ids: Sequence[int], state: CacheState,
                        expect: Mapping[Entry, int], held: dict[str, torch.Tensor]) -> Loaded:
        g = self.grid
        files, accept, staging = self.files, self.identity, self._staging
        anchor = files.load("anchor", offer.anchor_key, accept, like=state, grid=g,
                            staging=staging,
                            expect_nbytes=expect.get(("anchor", offer.anchor_key)))
        checks: list[Future] = [checker.submit(anchor.verify)]
        failure: BaseException | None = None
        try:
            for i, key in enumerate(offer.chunk_keys_to_read, start=offer.first_chunk):
                # at most CHECK_DEPTH files read and not yet checked: the staging holds a few
                # chunks' buffers, not the whole read
                while sum(not c.done() for c in checks) >= CHECK_DEPTH:
                    wait(checks, return_when=FIRST_COMPLETED)
                if any(c.done() and c.exception() is not None for c in checks):
                    break  # a check failed: what is left is not read
                a = i * g
                try:
                    chunk = files.load("chunk", key, accept, like=state, grid=g,
                                       staging=staging, expect_nbytes=expect.get(("chunk", key)))
                except TierFileError as exc:
                    failure = exc
                    break
                rows = (chunk, prompt_ids[a:a + g], state, max(a, offer.start), a + g,
                        held if a < offer.start else None)
                if i + 1 < offer.first_chunk + len(offer.chunk_keys_to_read):
                    checks.append(checker.submit(self._commit_rows, *rows))
                else:  # nothing left to read: this thread takes half of the last one's work
                    checks.append(self._commit_shared(checker, *rows))
        finally:
            wait(checks)
        for c in checks:  # in read order: the first that failed is the lowest
            if (exc := c.exception()) is not None:
                failure = exc
                break
        if failure is not None:
            staging.give([anchor.buf])
            raise failure
        return anchor

    def _commit_rows(self, chunk: Loaded, token_ids: Sequence[int], state: CacheState,
                     start: int, stop: int, held: dict[str, torch.Tensor] | None) -> None:
        """On the checker: one chunk verified whole, then its rows ``[start, stop)`` copied
        into ``state`` (one copy per view) and, with ``held``, its rows below ``start`` into
        it (copied in once the restore has passed); its buffer back to the staging either
        way."""
        try:
            chunk.verify(token_ids)
            rows = chunk.tensors()
            a = chunk.header.start
            with torch.inference_mode():
                for name, v in state.views.items():
                    _copy_into(v.rows(start, stop),
                               rows[name].narrow(v.token_axis, start - a, stop - start))
                    if held is not None:
                        held[name] = rows[name].narrow(v.token_axis, 0, start - a).clone()
        finally:
            self._staging.give([chunk.buf])

    def _commit_shared(self, checker: ThreadPoolExecutor, chunk: Loaded,
                       token_ids: Sequence[int], state: CacheState, start: int,
                       stop: int, held: dict[str, torch.Tensor] | None) -> Future:
        """``_commit_rows`` on the checker and this thread at once, each summing half the
        sections and then, once all passed, copying half the views: the restore's tail (the
        work after the last read) halved. A done future either way, as the checker's are."""
        sections = chunk.header.sections
        names = list(state.views)
        mine, theirs = sections[len(sections) // 2:], sections[:len(sections) // 2]
        a = chunk.header.start
        src = chunk.tensors()

        def check(part: Sequence[Section]) -> None:
            for s in part:
                chunk.check(s, token_ids)

        def copy(part: Sequence[str]) -> None:
            with torch.inference_mode():
                for name in part:
                    v = state.views[name]
                    _copy_into(v.rows(start, stop),
                               src[name].narrow(v.token_axis, start - a, stop - start))
                    if held is not None:
                        held[name] = src[name].narrow(v.token_axis, 0, start - a).clone()

        done: Future = Future()
        try:
            try:
                other = checker.submit(check, theirs)
                check(mine)
            finally:
                wait([other])
            other.result()
            other = checker.submit(copy, names[:len(names) // 2])
            try:
                copy(names[len(names) // 2:])
            finally:
                wait([other])
            other.result()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        finally:
            self._staging.give([chunk.buf])
        return done

    def _failed_restore(self, exc: TierFileError, offer: DiskOffer,
                        prompt_ids: Sequence[int]) -> None:
        """Delete the file that failed and every chunk of the prompt's chain above it (above the
        anchor's line, for an anchor), index first, so that nothing finds them meanwhile."""
        g = self.grid
        chain = chain_keys(prompt_ids, g, Namespace(offer.namespace))
        if exc.kind == "chunk" and exc.key in chain:
            above = chain.index(exc.key) + 1
        else:
            above = offer.line // g
        victims = [(exc.kind, Key(exc.key))] + [("chunk", k) for k in chain[above:]]
        with self._lock:
            gone = [(kind, key) for kind, key in victims
                    if self.index.remove(kind, key) or (kind, key) == victims[0]]
            for kind, key in gone:
                self.usage.forget(kind, key)
            self.counters["failed_restores"] += 1
            self._event("failed_restore", offer.line, exc.key)
        for kind, key in gone:
            if isinstance(exc, MissingFile) and (kind, key) == victims[0]:
                continue
            self._discard(kind, key)
        log.warning("disk_restore_failed", reason=exc.reason, kind=exc.kind,
                    key=exc.key[:12], line=offer.line, deleted=len(gone))

    # -- the writes (the writer's thread) --------------------------------------------------

    def write_chunk(self, plan: DiskPlan, line: int, token_ids: Sequence[int],
                    rows: HostRows) -> bool:
        """The chunk of rows ``[line - grid, line)`` (``rows``, a host copy) as the plan's file
        of ``line``; False when it was not written (no room, an I/O error: deleted, logged,
        counted, the admission told)."""
        key = plan.key(line)
        entry: Entry = ("chunk", key)
        nbytes = _file_nbytes(list(rows.tensors.values()), 1)
        if not self._make_room(plan, entry, nbytes, line):
            return False
        a = line - self.grid
        t0 = self._monotonic()
        h = self._write_file(
            entry, lambda: self.files.write_chunk(
                key, token_ids, rows.views(), a, line,
                fingerprint=self.identity.fingerprint, grid=self.grid))
        if h is None:
            return False
        self._written(entry, ChunkEntry(key, a, line, h.file_nbytes, h.fingerprint), line,
                      h.file_nbytes, self._monotonic() - t0)
        return True

    def write_anchor(self, plan: DiskPlan, line: int, sections: SectionsCopy) -> bool:
        """The anchor at ``line`` (``sections``, copied as the prefill passed it)."""
        key = plan.key(line)
        entry: Entry = ("anchor", key)
        chunks = plan.chunk_keys(line)
        nbytes = _file_nbytes(list(sections.tensors.values())) + len(chunks) * 80
        if not self._make_room(plan, entry, nbytes, line):
            return False
        t0 = self._monotonic()
        h = self._write_file(
            entry, lambda: self.files.write_anchor(
                key, line, chunks, sections.tensors,
                fingerprint=self.identity.fingerprint, grid=self.grid))
        if h is None:
            return False
        self._written(entry, AnchorEntry(key, line, tuple(chunks), h.file_nbytes,
                                         h.fingerprint), line, h.file_nbytes,
                      self._monotonic() - t0)
        return True

    def drop_entries(self, entries: Sequence[Entry], lines: Sequence[int],
                     why: Literal["window", "drop"]) -> None:
        """Entries of a plan that are not written (never copied): the admission may admit them
        again. ``window``: a fence closed the copy's window."""
        if not entries:
            return
        with self._lock:
            self.admission.failed(entries)
            self.counters["window_drops" if why == "window" else "drops"] += len(entries)
            for (kind, key), line in zip(entries, lines):
                self._event(why, line, key)
        log.info("disk_window_closed" if why == "window" else "disk_entries_dropped",
                 entries=len(entries), lines=len(set(lines)))

    def write_entries(self, plan: DiskPlan, token_ids: Sequence[int],
                      staged: Mapping[int, SectionsCopy],
                      rows: Mapping[int, HostRows]) -> WriteReport:
        """Every entry of ``plan``: the chunks (``rows[line]``, each a host copy of its grid
        step) first, then the anchors (``staged[line]``); an entry with no copy is dropped."""
        g = self.grid
        report = WriteReport()
        for line in plan.chunk_lines:
            entry: Entry = ("chunk", plan.key(line))
            if line not in rows:
                self.drop_entries([entry], [line], "drop")
                report.dropped.append(entry)
            elif self.write_chunk(plan, line, token_ids[line - g:line], rows[line]):
                report.written.append(entry)
            else:
                report.failed.append(entry)
        for line in plan.anchor_lines:
            entry = ("anchor", plan.key(line))
            if line not in staged:
                self.drop_entries([entry], [line], "drop")
                report.dropped.append(entry)
            elif self.write_anchor(plan, line, staged[line]):
                report.written.append(entry)
            else:
                report.failed.append(entry)
        with self._lock:
            report.nbytes = sum(self._entry_nbytes(e) for e in report.written)
        self.save_counts(guard=False)
        return report

    def _make_room(self, plan: DiskPlan, entry: Entry, nbytes: int, line: int) -> bool:
        """Evict what ``room_for`` says (the write's chain and every file a restore reads are
        kept); False (the admission told) when the write does not fit."""
        try:
            free = self._free(self.root)
        except OSError:
            free = 0
        with self._lock:
            room = room_for(nbytes, self.index, self.usage, self._wall(),
                            budget_nbytes=self.budget_nbytes, free_nbytes=free,
                            floor_nbytes=self.floor_nbytes, ttl_s=self.ttl_s,
                            protect=set(plan.keys) | set(self._reading))
            victims = list(room.evict)
            for kind, key in victims:
                self.index.remove(kind, key)
                self.usage.forget(kind, key)
                self._event("eviction", 0, key)
            self.counters["evictions"] += len(victims)
            self.counters["evicted_nbytes"] += room.freed_nbytes
            if not room.fits:
                self.admission.failed([entry])
                self.counters["skipped_no_room"] += 1
        for kind, key in victims:  # the index forgot them first: nothing finds them now
            self._discard(kind, key)
        if victims:
            log.info("disk_evicted", files=len(victims), nbytes=room.freed_nbytes)
        if not room.fits:
            log.info("disk_write_skipped", reason="no_room", kind=entry[0], line=line,
                     nbytes=nbytes, free_nbytes=free)
        return room.fits

    def _write_file(self, entry: Entry, write: Callable[[], Any]) -> Any:
        kind, key = entry
        try:
            return write()
        except OSError as exc:
            # tierfile removed its .tmp; a failure after the rename (the folder's fsync) leaves
            # a file nobody knows is durable: it goes too.
            self._discard(kind, key)
            with self._lock:
                self.admission.failed([entry])
                self.counters["write_failures"] += 1
                self._event("write_failed", 0, key)
            log.warning("disk_write_failed", kind=kind, key=key[:12], errno=exc.errno,
                        error=type(exc).__name__)
            return None

    def _written(self, entry: Entry, index_entry: ChunkEntry | AnchorEntry, line: int,
                 nbytes: int, took_s: float) -> None:
        kind, key = entry
        with self._lock:
            if kind == "chunk":
                self.index.add_chunk(index_entry)  # type: ignore[arg-type]
            else:
                self.index.add_anchor(index_entry)  # type: ignore[arg-type]
            self.usage.written(kind, key, self._wall())
            self.admission.done([entry])
            self.write_bps = _mean(self.write_bps, nbytes / max(took_s, 1e-9))
            self.counters["writes"] += 1
            self.counters["written_nbytes"] += nbytes
            self._event("write", line, key)
        if self.guard is not None:
            self.guard.add(nbytes, "tier")

    def save_counts(self, *, guard: bool = True) -> bool:
        """Persist the admission's counts when they changed (off the request's path), and with
        ``guard`` the write guard's count (between two, the guard saves itself once a second at
        most)."""
        if guard and self.guard is not None:
            self.guard.save()
        with self._lock:
            if not self.admission.dirty or self.admission.path is None:
                return True
            data = self.admission.encode()
            self.admission.dirty = False
        try:
            write_atomic(self.admission.path, data)
        except OSError as exc:
            with self._lock:
                self.admission.dirty = True
            log.warning("disk_admission_counts_unsaved", errno=exc.errno,
                        error=type(exc).__name__)
            return False
        return True

    def _discard(self, kind: str, key: str) -> None:
        try:
            self.files.discard(kind, key)  # type: ignore[arg-type]
        except OSError as exc:
            log.warning("disk_delete_failed", kind=kind, key=key[:12], errno=exc.errno)

    # -- the console -----------------------------------------------------------------------

    def clear(self) -> dict[str, int]:
        """Delete every file and every count (the console's clear)."""
        with self._lock:
            victims = ([("anchor", k) for k in self.index.anchors]
                       + [("chunk", k) for k in self.index.chunks])
            nbytes = self.index.nbytes
            self.index = TierIndex()
            self.usage = TierUsage()
            lines = len(self.admission.counts)
            self.admission.clear()
            self.counters["clears"] += 1
        for kind, key in victims:
            self._discard(kind, key)
        log.info("disk_cleared", files=len(victims), nbytes=nbytes, lines=lines)
        return {"files": len(victims), "nbytes": nbytes, "lines": lines}

    def statistics(self) -> dict[str, Any]:
        try:
            free = self._free(self.root)
        except OSError:
            free = 0
        with self._lock:
            now = self._wall()
            tops = sorted(self.index.anchors.values(),
                          key=lambda a: (-self.usage.get("anchor", a.key, now).hits, -a.line))
            asked = self.counters["hits"] + self.counters["misses"]
            return {
                "mode": self.mode,
                "chunks": len(self.index.chunks), "anchors": len(self.index.anchors),
                "nbytes": self.index.nbytes, "budget_nbytes": self.budget_nbytes,
                "free_nbytes": free, "floor_nbytes": self.floor_nbytes,
                "ttl_days": self.ttl_s / DAY_S, "admit_after": self.admission.admit_after,
                "hit_rate": self.counters["hits"] / asked if asked else 0.0,
                **self.counters,
                "read_gb_s": self.read_bps / GB, "write_gb_s": self.write_bps / GB,
                "transfers": dict(self.files.transfers),
                "admission": self.admission.statistics(),
                "fingerprint": self.identity.fingerprint[:12],
                "adopted": len(self.identity.adopted),
                "top_prefixes": [{"tokens": a.line, "key": a.key[:12],
                                  "hits": self.usage.get("anchor", a.key, now).hits}
                                 for a in tops[:TOP_PREFIXES]],
                "last_events": list(self.events),
            }

    def check_invariants(self) -> None:
        with self._lock:
            self.index.check_invariants()
            self.admission.check_invariants()
            for key, a in self.index.anchors.items():
                assert a.fingerprint in self.identity, "an anchor of a foreign fingerprint"
            for key, c in self.index.chunks.items():
                assert c.fingerprint in self.identity, "a chunk of a foreign fingerprint"
                assert c.stop - c.start == self.grid
            assert all(n > 0 for n in self._reading.values())
            assert self.budget_nbytes >= 0 and self.floor_nbytes >= self.min_floor_nbytes

    # -- helpers ---------------------------------------------------------------------------

    def _event(self, kind: EventKind, tokens: int, key: str) -> None:
        event = {"t": self._wall(), "event": kind, "tokens": tokens, "key": key[:12]}
        self.events.append(event)
        self._unjournaled.append(event)

    def _entry_nbytes(self, entry: Entry) -> int:
        kind, key = entry
        held = self.index.chunks if kind == "chunk" else self.index.anchors
        e = held.get(key)
        return e.nbytes if e is not None else 0

    # -- the journal -----------------------------------------------------------------------

    def drain_events(self) -> list[dict[str, Any]]:
        """The events since the last call, oldest first, for the server to journal on the loop
        (they happen on the engine thread and the writer's). Each is the ``last_events`` dict:
        t, event, tokens, a key's first 12 hex digits; no token id, no text. At most
        ``UNJOURNALED`` are held between two calls."""
        with self._lock:
            events = list(self._unjournaled)
            self._unjournaled.clear()
        return events


def _mean(old: float, new: float) -> float:
    return (1 - RATE_WEIGHT) * old + RATE_WEIGHT * new


def _free_nbytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``. Host to host through numpy (as integers of the same width, which
    numpy has for every dtype a tier file holds): one thread with the GIL released, where
    torch's copy would wake its intra-op pool, whose memory traffic on every core slows the
    disk's reads this copy overlaps (measured: bench_disk's restore rate)."""
    ints = _SAME_SIZE_INT.get(dst.element_size())
    if (ints is None or dst.device.type != "cpu" or src.device.type != "cpu"
            or dst.dtype != src.dtype or dst.shape != src.shape):
        dst.copy_(src)
        return
    np.copyto(dst.view(ints).numpy(), src.view(ints).numpy())


class _Shifted:
    """A host copy of rows ``[a, a + n)`` seen as a view: ``rows(start, stop)`` in sequence
    positions (all a tier file's writer asks of a view)."""

    def __init__(self, tensor: torch.Tensor, token_axis: int, a: int):
        self.tensor = tensor
        self.token_axis = token_axis
        self.a = a

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor.narrow(self.token_axis, start - self.a, stop - start)


def make_disk_tier(config: Any, engine: Any, *, model_dir: str | os.PathLike | None = None,
                   extra: Mapping[str, str] | None = None) -> DiskTier | None:
    """The server's tier from ``config.disk`` (None when it is off): the identity from the
    engine's manifest and the checkpoint's files (adopting earlier formulas, and the folders of
    ``disk_adopt_from``), the folder scanned, the counts opened, the usage seeded."""
    d = config.disk
    if d.disk_cache == "off":
        return None
    root = config.disk_cache_path()
    files = TierFiles(root)
    try:
        inputs = FingerprintInputs.of_checkpoint(engine.manifest(), model_dir, extra)
        adopt_from = [p for p in d.disk_adopt_from.split(os.pathsep) if p]
        identity = tier_identity(files, inputs, adopt_from)
    finally:
        files.close()
    grid = engine.prefix_chunk
    admission = Admission(root / COUNTS_FILE, grid=grid, admit_after=d.disk_cache_admit_after,
                          head_anchors=d.disk_cache_head_anchors,
                          min_tokens=d.disk_cache_min_tokens)
    return DiskTier(root, identity, grid, admission=admission,
                    budget_nbytes=int(d.disk_cache_gb * GB),
                    ttl_s=d.disk_cache_ttl_days * DAY_S,
                    floor_nbytes=int(d.disk_cache_min_free_gb * GB),
                    guard=make_write_guard(config))
