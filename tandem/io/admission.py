"""What a prefill writes to the disk tier, decided in the plan before it runs (spec: "Disk tier",
"What is written is decided before the prefill runs" and the two rules of 0.3.18-test).

Every grid line a prefill forwards cold is counted by its key (``tandem.io.chain``): the count is
the work the tier would have saved, so a resumed line is not counted. From the counts and the
request, ``decide`` names the lines to anchor:

- ``repeated``: the longest line of the prompt counted ``admit_after`` times;
- ``head``: for a session's first long request, the last ``head_anchors`` lines at or below where
  its last user message starts (the next session in the same folder parts from it there);
- ``branch``: a line counted ``admit_after`` times whose count falls at the prompt's next line (an
  earlier prompt read this far and went on differently), the ``branch_max`` longest, only in the
  head two sessions can share (up to where the conversation's first answer starts).

and every chunk below them that is not on disk. Nothing is written of a prompt under
``min_tokens``, and nothing is counted or written of a request resumed from a session snapshot or
above taint (off the grid, or on rows a generation wrote: every row its prefill writes is then
not a cold grid prefill's; taint as the engine keeps it, cleared by a resume at a grid line at or
below it). An anchor counts as written only with every chunk below it on disk, so an anchor file
whose chunks failed is admitted again, and the plan names only the chunks it lacks (its state is
on disk already).

A new anchor's state is copied as the prefill passes its line, so only lines above ``start`` get
one; chunks are copied from the rows in place after the prefill, so any line of the prompt may.

The counts are traffic, not rows: keys and how often they were read cold, no token. They outlive
a new fingerprint (the file carries none, and the tier's sweep never touches it) and are kept on
one grid (keys of another grid never match); only ``clear`` drops them. They decide what is
written, never what is read. ``save`` persists them (temp, fsync, rename, fsync the folder) and
is left to the caller, off the request's path; a counts file that fails its checks is left
behind and the counts start empty, with a log event.

Between a plan and its writer's report, a plan's entries are pending and no other plan names
them; the writer reports every entry once, ``done`` or ``failed`` (a fenced or dropped one is
failed), and a failed entry may be admitted again by the next plan whose rules name it.

Pure bookkeeping and the counts file: no asyncio, no clock, no actor.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

import structlog

from tandem.cache.namespace import Namespace
from tandem.io.chain import Key, chain_keys
from tandem.io.direct import write_atomic_at
from tandem.io.tierfile import FileKind
from tandem.io.tierindex import TierIndex

log = structlog.get_logger()

Reason = Literal["repeated", "head", "branch"]
Entry = tuple[FileKind, Key]

ADMIT_AFTER = 2
HEAD_ANCHORS = 4
MIN_TOKENS = 4096
BRANCH_MAX = 4
MAX_LINES = 1 << 16  # counted lines kept; the least recently counted go first (2.9 MB a file)

# The counts file: a prefix, one record a counted line, and a crc32 of everything before it.
COUNTS_MAGIC = b"TNDMADM1"
COUNTS_VERSION = 1
_HEAD = struct.Struct("<8sIIQII")  # magic, version, grid, seq, records, reserved (zero)
_RECORD = struct.Struct("<32sIQ")  # key (sha256), count, seq of the request that last counted it
_CRC = struct.Struct("<I")
TMP = ".tmp"
COUNTS_MAX_NBYTES = 64 << 20  # a larger file is not one of ours


@dataclass(frozen=True)
class DiskPlan:
    """What one prefill writes: an anchor at each of ``anchor_lines`` (its state copied as the
    prefill passes the line) and the chunk of rows ``[b - grid, b)`` for each of ``chunk_lines``
    (copied from the rows in place after the prefill). ``keys[i]`` names line ``(i + 1) * grid``
    of the prompt, up to the highest line named, so the plan names the files the writer writes;
    an anchor at ``b`` lists ``chunk_keys(b)``. ``reasons[i]`` says why ``anchor_lines[i]`` was
    admitted; ``repaired`` are lines whose anchor file is on disk without every chunk below it,
    which get their missing chunks only."""

    grid: int
    anchor_lines: tuple[int, ...] = ()
    chunk_lines: tuple[int, ...] = ()
    keys: tuple[Key, ...] = ()
    reasons: tuple[tuple[Reason, ...], ...] = ()
    repaired: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.anchor_lines and not self.chunk_lines

    def key(self, line: int) -> Key:
        return self.keys[line // self.grid - 1]

    def chunk_keys(self, line: int) -> tuple[Key, ...]:
        """The chunks an anchor at ``line`` lists: ``key(grid) ... key(line)``."""
        return self.keys[:line // self.grid]

    def entries(self) -> list[Entry]:
        """Every file the plan writes, the chunks first (an anchor serves only with every chunk
        below it on disk, so a writer that goes in this order never leaves one that could be
        found without its chunks)."""
        return ([("chunk", self.key(b)) for b in self.chunk_lines]
                + [("anchor", self.key(b)) for b in self.anchor_lines])


class Admission:
    """The disk tier's admission: the cold-read counts of grid lines (persisted at ``path``),
    the entries of plans whose writes are not reported yet, and the rules that make a plan."""

    def __init__(self, path: str | os.PathLike | None, *, grid: int,
                 admit_after: int = ADMIT_AFTER, head_anchors: int = HEAD_ANCHORS,
                 min_tokens: int = MIN_TOKENS, branch_max: int = BRANCH_MAX,
                 max_lines: int = MAX_LINES):
        if grid <= 0:
            raise ValueError("the grid must be positive")
        if max_lines < 1:
            raise ValueError("max_lines must be at least 1")
        self.path = None if path is None else Path(path)
        self.grid = grid
        self.max_lines = max_lines
        self.admit_after = self.head_anchors = self.min_tokens = self.branch_max = 0
        self.configure(admit_after=admit_after, head_anchors=head_anchors,
                       min_tokens=min_tokens, branch_max=branch_max)
        # key -> [times read cold, seq of the request that last counted it]
        self.counts: dict[Key, list[int]] = {}
        self.seq = 0
        self.dirty = False
        self.pending: set[Entry] = set()
        self.stats = {"requests": 0, "lines_counted": 0, "anchors_repeated": 0,
                      "anchors_head": 0, "anchors_branch": 0, "repaired": 0, "chunks": 0,
                      "failed": 0, "skipped_short": 0, "skipped_snapshot": 0,
                      "skipped_taint": 0}
        if self.path is not None:
            self._load()

    def configure(self, *, admit_after: int | None = None, head_anchors: int | None = None,
                  min_tokens: int | None = None, branch_max: int | None = None) -> None:
        """Settings apply from the next ``decide``."""
        if admit_after is not None:
            if admit_after < 1:
                raise ValueError("admit_after must be at least 1")
            self.admit_after = admit_after
        if head_anchors is not None:
            if head_anchors < 0:
                raise ValueError("head_anchors must not be negative")
            self.head_anchors = head_anchors
        if min_tokens is not None:
            if min_tokens < 0:
                raise ValueError("min_tokens must not be negative")
            self.min_tokens = min_tokens
        if branch_max is not None:
            if branch_max < 0:
                raise ValueError("branch_max must not be negative")
            self.branch_max = branch_max

    # -- the plan --------------------------------------------------------------------------

    def count_of(self, key: Key) -> int:
        held = self.counts.get(key)
        return held[0] if held else 0

    def decide(self, prompt_ids: Sequence[int], namespace: Namespace, *, start: int,
               taint: int | None, on_disk: TierIndex, first_of_session: bool = False,
               last_user_start: int | None = None, head_stop: int | None = None,
               from_snapshot: bool = False) -> DiskPlan:
        """Count the lines this prefill forwards cold and say what it writes.

        ``start``: where the prefill resumes (0: cold). ``taint``: the rows in place's (the
        engine's before ``resume_at(start)``; the engine's rule is applied here: a resume at a
        grid line at or below it clears it, one off the grid taints from there).
        ``first_of_session``: the request a session starts with (its conversation holds no
        answer yet); ``last_user_start``: the token where its last user message starts.
        ``head_stop``: where the conversation's first answer starts (None: the prompt holds
        none, all of it is head). ``from_snapshot``: resumed from a session snapshot."""
        self.stats["requests"] += 1
        g = self.grid
        n = len(prompt_ids)
        if from_snapshot:
            # verify blocks wrote those rows: nothing above them is a cold prefill's
            self.stats["skipped_snapshot"] += 1
            return DiskPlan(g)
        if taint is not None and taint >= start:
            taint = None
        if start % g:
            taint = start if taint is None else min(taint, start)
        if taint is not None:
            # the prefill continues rows that are not a cold grid prefill's, and so is every
            # row it writes: nothing of it is counted or written
            self.stats["skipped_taint"] += 1
            return DiskPlan(g)
        keys = chain_keys(prompt_ids, g, namespace)
        self._count(keys, start)
        if n < self.min_tokens:
            self.stats["skipped_short"] += 1
            return DiskPlan(g)
        top = len(keys)  # line i is keys[i - 1]
        counts = [self.count_of(k) for k in keys]
        picks: dict[int, list[Reason]] = {}

        repeated = [i for i in range(1, top + 1) if counts[i - 1] >= self.admit_after]
        if repeated:
            picks.setdefault(repeated[-1], []).append("repeated")
        if first_of_session and last_user_start is not None and self.head_anchors:
            head_top = min(last_user_start, n) // g
            for i in range(head_top, max(0, head_top - self.head_anchors), -1):
                picks.setdefault(i, []).append("head")
        if self.branch_max:
            shared_top = top if head_stop is None else min(top, head_stop // g)
            branches = [i for i in range(1, shared_top + 1)
                        if i < len(keys) and counts[i - 1] >= self.admit_after
                        and counts[i] < counts[i - 1]]
            for i in branches[-self.branch_max:]:
                picks.setdefault(i, []).append("branch")

        anchors: list[int] = []
        reasons: list[tuple[Reason, ...]] = []
        repaired: list[int] = []
        chunks: set[int] = set()
        for i in sorted(picks):
            key = keys[i - 1]
            if ("anchor", key) in self.pending:
                continue
            entry = on_disk.anchors.get(key)
            if entry is not None and on_disk.usable(entry):
                continue
            lacking = [j for j in range(1, i + 1) if keys[j - 1] not in on_disk.chunks
                       and ("chunk", keys[j - 1]) not in self.pending]
            if entry is None:
                if i * g <= start:
                    continue  # its state was never in the engine during this prefill
                anchors.append(i * g)
                reasons.append(tuple(picks[i]))
            elif lacking:
                repaired.append(i * g)
            chunks.update(lacking)
        if not anchors and not repaired:
            return DiskPlan(g)
        high = max(anchors + repaired)
        plan = DiskPlan(g, tuple(anchors), tuple(j * g for j in sorted(chunks)),
                        tuple(keys[:high // g]), tuple(reasons), tuple(repaired))
        self.pending.update(plan.entries())
        for why in reasons:
            for r in why:
                self.stats[f"anchors_{r}"] += 1
        self.stats["repaired"] += len(repaired)
        self.stats["chunks"] += len(plan.chunk_lines)
        return plan

    def _count(self, keys: Sequence[Key], start: int) -> None:
        cold = keys[start // self.grid:]
        if not cold:
            return
        self.seq += 1
        for k in cold:
            held = self.counts.get(k)
            if held is None:
                self.counts[k] = [1, self.seq]
            else:
                held[0] += 1
                held[1] = self.seq
        self.stats["lines_counted"] += len(cold)
        self.dirty = True
        self._trim()

    def _trim(self) -> None:
        over = len(self.counts) - self.max_lines
        if over > 0:
            for k in sorted(self.counts, key=lambda k: self.counts[k][1])[:over]:
                del self.counts[k]

    # -- the writer's report ---------------------------------------------------------------

    def done(self, entries: Iterable[Entry]) -> None:
        """Entries on disk (the index holds them now)."""
        for e in entries:
            self.pending.discard(e)

    def failed(self, entries: Iterable[Entry]) -> None:
        """Entries a write did not put on disk (an error, a fence, a drop): no longer pending,
        so the next plan whose rules name them admits them again."""
        for e in entries:
            if e in self.pending:
                self.pending.discard(e)
                self.stats["failed"] += 1

    def clear(self) -> None:
        """Drop every count and pending entry (the dashboard's clear) and persist that at once:
        a clear must not come back after a restart."""
        self.counts.clear()
        self.pending.clear()
        self.seq = 0
        self.dirty = True
        self.save()

    # -- the counts file -------------------------------------------------------------------

    def encode(self) -> bytes:
        """The counts file's bytes (cheap; ``write_atomic`` them from any thread)."""
        parts = [_HEAD.pack(COUNTS_MAGIC, COUNTS_VERSION, self.grid, self.seq,
                            len(self.counts), 0)]
        parts += [_RECORD.pack(bytes.fromhex(k), c, s)
                  for k, (c, s) in sorted(self.counts.items())]
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def save(self) -> bool:
        """Persist the counts (no-op without a path). An error is logged, never raised: the
        counts decide what is written, and a lost count costs a cold read at most."""
        if self.path is None:
            self.dirty = False
            return True
        try:
            write_atomic(self.path, self.encode())
        except OSError as exc:
            log.warning("disk_admission_counts_unsaved", errno=exc.errno,
                        error=type(exc).__name__)
            return False
        self.dirty = False
        return True

    def _load(self) -> None:
        try:
            data = read_small(self.path, COUNTS_MAX_NBYTES)
        except OSError as exc:
            log.warning("disk_admission_counts_unreadable", reason="refused",
                        errno=exc.errno)
            return
        if data is None:
            return
        try:
            seq, counts = decode_counts(data, self.grid)
        except CountsError as exc:
            log.warning("disk_admission_counts_unreadable", reason=exc.reason, nbytes=len(data))
            return
        self.seq, self.counts = seq, counts
        self._trim()
        log.info("disk_admission_counts_loaded", lines=len(self.counts))

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        assert len(self.counts) <= self.max_lines
        for k, (c, s) in self.counts.items():
            assert len(k) == 64 and c >= 1 and 1 <= s <= self.seq, (c, s, self.seq)
        for kind, key in self.pending:
            assert kind in ("chunk", "anchor") and len(key) == 64

    def statistics(self) -> dict[str, int]:
        return {**self.stats, "lines": len(self.counts), "pending": len(self.pending)}


class CountsError(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def decode_counts(data: bytes, grid: int) -> tuple[int, dict[Key, list[int]]]:
    """The seq and counts a counts file holds; ``CountsError`` (its ``reason``) when it is not
    one, fails its crc32, or counts another grid."""
    if len(data) < _HEAD.size + _CRC.size:
        raise CountsError("truncated")
    magic, version, file_grid, seq, n, reserved = _HEAD.unpack_from(data)
    if magic != COUNTS_MAGIC:
        raise CountsError("foreign")
    if version != COUNTS_VERSION:
        raise CountsError("version")
    if len(data) != _HEAD.size + n * _RECORD.size + _CRC.size:
        raise CountsError("truncated")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(data[:-_CRC.size]) != crc:
        raise CountsError("corrupt")
    if reserved:
        raise CountsError("corrupt")
    if file_grid != grid:
        raise CountsError("grid")
    counts: dict[Key, list[int]] = {}
    for raw, c, s in _RECORD.iter_unpack(data[_HEAD.size:-_CRC.size]):
        if c < 1 or not 1 <= s <= seq:
            raise CountsError("corrupt")
        counts[Key(raw.hex())] = [c, s]
    if len(counts) != n:
        raise CountsError("corrupt")
    return seq, counts


# -- small files, atomically ----------------------------------------------------------------

def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data``: written to ``<path>.tmp`` (0600, no symlink followed),
    fsynced, renamed over it, and its folder fsynced, so a crash leaves the old file or the
    new one, and at most a ``.tmp`` the next write replaces."""
    path = Path(path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(folder, path.name, data)
    finally:
        os.close(folder)


def read_small(path: str | os.PathLike, limit: int) -> bytes | None:
    """A small regular file's bytes (None when there is none); a symlink, a FIFO or another
    kind of entry raises OSError, as does a file over ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, "larger than a counts file")
        chunks = []
        while (b := os.read(fd, 1 << 20)):
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)
