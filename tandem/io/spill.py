"""The session spill's entries: whole conversations on the NVMe (spec: "Live conversations on the
NVMe" through "The day's write budget"; issue 16, parts 1, 3, 4 and 7).

This is the entry as a library, synchronous and without an actor: what is written where, how a
save keeps what did not change, how a restore checks what it reads, and which entries go. The
spill writer actor, the drain, the eviction rule and the engine's wiring call it.

An entry is one conversation: rows ``[0, valid)`` of every view of a ``CacheState``, the end
anchor's sections (its hidden spans, alignment regions and drafter mark ride along as opaque
JSON the caller passes), the newest 4 grid anchors, the token ids, taint, the session key's
digest (never its text) and the namespace (the salt's digest). Its folder, under ``root``::

    <entry id>/            0700; the id a sha256 of the session digest and the namespace
        manifest           written last, removed first: the entry exists only with it
        blk-<hash>         block k: rows [k*G, min((k+1)*G, valid)) of every view, each view's
                           bytes by the codec (tandem.io.spill_codec) at a 4 KiB-aligned offset
        anc-<hash>         a grid anchor: every section by the codec
        end-<hash>         the end anchor, the same way

Every file is 0600 and opened relative to its folder's descriptor with O_NOFOLLOW; block and
anchor files go out with one O_DIRECT write from an aligned buffer (tandem.io.direct, buffered
where the file system refuses it) and are named by a hash of their place and content, so an
unchanged block keeps its name and file through a rewrite.

Incremental by content: a save takes two 64-bit sums of every view's block (and every anchor's
section) where the rows are (tandem.kernels.blocksums), off the device in one copy. A block
whose rows, tokens and sums equal the manifest's is not written again, nor an anchor whose sums
are equal. A restore skips a block already in place (the rows in place hold its tokens and
every token below it, so its rows are the same rows) and never reads it; every block it reads is
decoded into scratch beside the rows, summed again there and copied into the rows only when its
sums are the manifest's; every anchor too. A mismatch raises ``SpillReadFailed``, deletes the
entry, and the caller resumes from what is in place.

Crash safety: a rewrite or a delete removes the manifest first (fsync of the folder), a save
writes it last (tmp, fsync, rename, fsync of the folder), so a folder without one is a write
that did not finish and ``open`` deletes it; ``open`` deletes an entry of a fingerprint the
identity does not accept, one whose manifest fails its sha256 or version, one whose files are
missing or of another size, and files no manifest names. The layout of every buffer (dtype,
shape, token axis) is checked against the state and every block's codec header before a byte
of it is read.

Budget: ``budget_nbytes`` (``session_spill_gb``) of files; an entry unused for ``ttl_s`` (48 h)
goes, then the least recently used first (``evict``), and a save makes room the same way.
When an entry was last used is its manifest's mtime, so it survives a restart.

Its own I/O path: ``io_lock`` is held across each save, each restore, a clear and a sweep, so
the engine thread may call ``restore`` beside the spill writer's save (one at a time, the wait
timed as ``lock``); the staging buffer is the spill's own; while a save runs the disk writer
waits between two of its files (``turns``, tandem.io.turns). Every save logs one line,
``spill_saved``, with where its time went.

Write budget: every byte of a block, an anchor and a manifest is added to ``guard`` (the disk
tier's WriteGuard, the day's count) as it is written; whether a save may run is the caller's
question (the spill writer asks the guard).

Thread rule: the index is touched under ``self._lock``; one save or restore at a time
(``io_lock``); ``offer`` may run beside them. A save or restore overlaps its own files on the
spill's I/O threads (``_io`` and the readers, closed by ``close``): a save writes file k on
``_io`` while the caller encodes file k+1, a restore reads and decompresses files k+1 to k+d on
the readers (``READ_AHEAD``) while the caller checks and copies file k; neither returns, nor
fails, before those threads are done with its folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Literal, Mapping, NamedTuple,
                    Sequence)

import msgspec
import numpy as np
import structlog
import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import Namespace
from tandem.devices import host_clone, staging_pinned
from tandem.io.direct import (DirectFile, RefusedEntry, aligned, fsync_folder, open_folder,
                              write_atomic_at,
                              round_up)
from tandem.io.fingerprint import Identity
from tandem.io.spill_codec import (CODEC_VERSION, BlockHeader, CodecError, SpillCodec,
                                   _dtype_name)
from tandem.io.turns import IoTurns
from tandem.kernels.blocksums import block_sums, host_sums, sections_sums, views_block_sums
from tandem.kernels.planes import cut_planes
from tandem.models.base import CacheState
from tandem.models.rows import rows_written
from tandem.tokens import common_prefix
from tandem.torch_thread import one_openmp_thread_here

if TYPE_CHECKING:
    from tandem.io.write_guard import WriteGuard

log = structlog.get_logger("tandem.spill")

GB = 10 ** 9
MANIFEST_VERSION = 1
MANIFEST = "manifest"
TMP = ".tmp"
MAGIC = b"TANDEMSP"
ANCHORS_KEPT = 4  # the newest grid anchors an entry keeps
BUDGET_NBYTES = 64 * GB  # session_spill_gb
TTL_S = 48 * 3600.0
MIN_TOKENS = 16384  # session_spill_min_tokens: the caller's rule for an eviction's save
MAX_MANIFEST_NBYTES = 256 << 20
# A restore's read-ahead: up to READ_AHEAD files read and decompressed at once on the readers
# (the disk's queue holds several small files' reads, whose latency is most of their time), as
# long as their buffers stay within READ_AHEAD_NBYTES (at least one file ahead); buffers of up
# to KEEP_NBYTES in all are kept for the next restore (larger ones go: their allocation is small
# beside their bytes' transfer).
READ_AHEAD = 4
READ_AHEAD_NBYTES = 256 << 20
KEEP_NBYTES = 64 << 20

FileKind = Literal["blk", "anc", "end"]
Refusal = Literal["missing", "layout", "sums", "codec", "io", "manifest", "tokens"]


# -- names ----------------------------------------------------------------------------------

def session_digest(session_key: str) -> str:
    """The hex digest an entry keeps of its session key, domain-separated (never the text)."""
    return hashlib.sha256(b"tandem spill session\0"
                          + session_key.encode("utf-8", "surrogatepass")).hexdigest()


def entry_id(session: str, namespace: Namespace | str) -> str:
    """The entry's folder name: a sha256 of the session key's digest and the namespace, so a
    session of another tenant never names the same entry."""
    return hashlib.sha256(f"tandem spill entry\0{namespace}\0{session}".encode()).hexdigest()


def _is_id(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _file_name(kind: FileKind, *parts: object) -> str:
    h = hashlib.sha256(kind.encode())
    for p in parts:
        h.update(b"\0" + str(p).encode())
    return f"{kind}-{h.hexdigest()[:40]}"


def _is_file_name(name: str) -> bool:
    kind, _, rest = name.partition("-")
    return kind in ("blk", "anc", "end") and len(rest) == 40 and all(
        c in "0123456789abcdef" for c in rest)


# -- the manifest ---------------------------------------------------------------------------

class ViewLayout(msgspec.Struct, frozen=True, array_like=True):
    """A view as the entry holds it: its shape with the token axis' length set to 0 (the
    window may differ between two processes; the rows may not)."""

    name: str
    dtype: str
    shape: list[int]
    token_axis: int


class SectionLayout(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: list[int]


class Part(msgspec.Struct, frozen=True, array_like=True):
    """One buffer's bytes in a file: where they start, and the codec's header (its length)."""

    offset: int
    header: BlockHeader
    plain: int  # the two sums of the buffer's bytes (blocksums), uint64
    weighted: int


class FileRecord(msgspec.Struct, frozen=True):
    """A block (``start``/``stop`` its rows) or an anchor (``stop`` its line, ``start`` 0)."""

    name: str
    start: int
    stop: int
    file_nbytes: int
    parts: list[Part]  # the views' (a block) or the sections' (an anchor), in layout order

    def sums(self) -> list[tuple[int, int]]:
        return [(p.plain, p.weighted) for p in self.parts]


class EndRecord(msgspec.Struct, frozen=True):
    file: FileRecord  # stop: the end anchor's position
    meta: Any = None  # the caller's: hidden spans, alignment regions, the drafter's mark


class Manifest(msgspec.Struct, frozen=True):
    version: int
    fingerprint: str
    grid: int
    namespace: str
    session: str  # the session key's digest
    valid: int
    taint: int | None
    token_ids: list[int]
    views: list[ViewLayout]
    sections: list[SectionLayout]
    blocks: list[FileRecord]
    anchors: list[FileRecord]  # by line, ascending
    end: EndRecord | None
    saved_at: float
    meta: Any = None

    def files(self) -> list[FileRecord]:
        return (list(self.blocks) + list(self.anchors)
                + ([self.end.file] if self.end is not None else []))

    @property
    def nbytes(self) -> int:
        return sum(f.file_nbytes for f in self.files())


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Manifest).decode


def manifest_bytes(m: Manifest) -> bytes:
    """MAGIC, the hex sha256 of the JSON, a newline, the JSON: a flipped byte anywhere (a token
    id's digit) is refused, never served."""
    body = _encode(m)
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def parse_manifest(data: bytes) -> Manifest:
    head = len(MAGIC) + 64 + 1
    if len(data) < head or data[:len(MAGIC)] != MAGIC or data[head - 1:head] != b"\n":
        raise ValueError("not a spill manifest")
    body = data[head:]
    if hashlib.sha256(body).hexdigest().encode() != data[len(MAGIC):head - 1]:
        raise ValueError("manifest sha256")
    m = _decode(body)
    if m.version != MANIFEST_VERSION:
        raise ValueError(f"manifest version {m.version}")
    return m


# -- what a caller passes and gets ----------------------------------------------------------

@dataclass(frozen=True)
class EntryMeta:
    """Who an entry belongs to. ``session``: ``session_digest(key)``; ``namespace``: the
    request's (tandem.cache.namespace); ``taint``: the engine's (the lowest row not a cold grid
    prefill's, None: none); ``extra``: the caller's, JSON-able."""

    session: str
    namespace: Namespace | str
    taint: int | None = None
    extra: Any = None

    @property
    def entry_id(self) -> str:
        return entry_id(self.session, self.namespace)


@dataclass(frozen=True)
class SpillEnd:
    """The end anchor: the sections at ``length`` and the caller's metadata (JSON-able)."""

    length: int
    sections: Mapping[str, torch.Tensor]
    meta: Any = None


class SaveReport(msgspec.Struct, frozen=True):
    entry_id: str
    valid: int
    blocks_written: int
    blocks_kept: int
    anchors_written: int  # the end counts among the anchors
    anchors_kept: int
    nbytes_written: int  # what went to the disk (stored, padded)
    raw_nbytes_written: int  # the same blocks' and anchors' bytes in the engine
    entry_nbytes: int
    evicted: int  # other entries this save made room by deleting
    end_kept_from_disk: bool  # no end given, every block unchanged: the one on disk stayed
    skipped: Literal["", "budget", "nothing"] = ""
    # Where the time went, ms: writer (the caller's queue wait, before the save), lock (the
    # wait for io_lock), waits (for the disk writer's file under way), staging (growing the
    # staging buffer), sums, copy (planes to the host), compress, write, fsync, anchors (the
    # anchors' share of copy+compress+write+fsync), manifest, total (the save's own, lock
    # included, writer not).
    ms: dict[str, float] = {}
    manifest_nbytes: int = 0  # the manifest's bytes, beside nbytes_written


@dataclass
class RestoreReport:
    entry_id: str
    line: int  # the engine resumes here: its sections are the state's
    token_ids: list[int]  # the rows [0, line)
    taint: int | None  # below line, for Engine.resume_at
    blocks_read: int
    blocks_in_place: int
    nbytes_read: int
    anchors: dict[int, SectionsCopy]  # every grid anchor, read and checked
    end: SpillEnd | None  # the end anchor, read and checked (its sections a copy)
    # Where the time went, ms: lock, staging (growing the read buffers), read and decode (the
    # files' reads and decompression, on the readers when overlapped), read_wait (the caller's
    # wait for them), join, sums, copy, anchors (the anchors' share), total.
    ms: dict[str, float]


class SpillOffer(msgspec.Struct, frozen=True):
    """What an entry serves of a prompt: ``matched`` rows share the prompt's tokens; the engine
    resumes at ``line`` (the end when reached, else the highest anchor at or below
    ``matched``, 0: none), reading about ``read_nbytes``."""

    entry_id: str
    matched: int
    valid: int
    line: int
    end_length: int | None
    end_reached: bool
    anchors_below: list[int]  # grid anchors at or below matched
    read_nbytes: int
    end_meta: Any
    taint: int | None
    last_used: float


class SpillError(Exception):
    pass


class SpillReadFailed(SpillError):
    """A restore stopped at a file that failed a check; the entry is deleted. Rows below
    ``intact_below`` were not written (the rows in place there are as they were). Names no
    token."""

    def __init__(self, reason: Refusal, entry: str, detail: str, intact_below: int):
        super().__init__(f"spill restore failed: {entry[:12]} {reason}: {detail}")
        self.reason: Refusal = reason
        self.entry_id = entry
        self.detail = detail
        self.intact_below = intact_below


class SpillStopped(SpillError):
    """A restore given ``stop`` stopped between two files because it said so (a request came
    during a prewarm): nothing of the rows in place was written, nor the sections; the entry
    stays as it was, unused."""


class SpillWriteFailed(SpillError):
    """A save that could not finish (an I/O error, a full disk); the entry is deleted."""

    def __init__(self, entry: str, exc: OSError):
        super().__init__(f"spill save failed: {entry[:12]} {exc.strerror or exc}")
        self.entry_id = entry
        self.errno = exc.errno


class _Bad(Exception):
    def __init__(self, reason: Refusal, detail: str):
        super().__init__(detail)
        self.reason: Refusal = reason


# -- the spill ------------------------------------------------------------------------------

@dataclass
class _Indexed:
    manifest: Manifest
    last_used: float


class SessionSpill:
    """The entries under ``root``: ``open`` them (deleting what must not be served), ``save``,
    ``offer``, ``restore``, ``delete``, ``evict``."""

    def __init__(self, root: str | os.PathLike, identity: Identity, grid: int, *,
                 budget_nbytes: int = BUDGET_NBYTES, ttl_s: float = TTL_S,
                 codec: SpillCodec | None = None, codec_version: int = CODEC_VERSION,
                 direct: bool = True, overlap: bool = True, wall=time.time,
                 guard: "WriteGuard | None" = None, turns: IoTurns | None = None):
        """``guard``: the day's write budget every written byte is added to (None: not
        counted); ``turns``: shared with the disk writer (default: the spill's own)."""
        if grid <= 0:
            raise ValueError("the grid must be positive")
        root = Path(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.identity = identity
        self.grid = grid
        self.budget_nbytes = int(budget_nbytes)
        self.ttl_s = float(ttl_s)
        self.codec_version = codec_version
        self.direct = direct
        self.wall = wall
        self._own_codec = codec is None
        self.codec = codec if codec is not None else SpillCodec()
        self.root_fd = open_folder(root)
        self.guard = guard
        self.turns = turns if turns is not None else IoTurns()
        self._lock = threading.Lock()  # the index; held briefly, never across I/O
        self.io_lock = threading.Lock()  # one save, restore, clear or sweep at a time
        self._index: dict[str, _Indexed] = {}
        self.dropped_at_open: dict[str, int] = {}
        # The codec's overlap (spec: "two writer threads"): a save cuts and compresses file
        # k+1 on the caller's thread (the rows are read on its CUDA stream, the engine's) while
        # ``_io`` writes file k; a restore reads and decompresses file k+1 on ``_io`` while the
        # caller joins, sums and copies file k. ``overlap=False``: each step in turn on the
        # caller's thread (the same bytes; the benchmark's side-by-side). Two stages: file k+1
        # is encoded into one while file k's write reads the other; each grows to the largest
        # file (a stored file is never larger than its buffers' bytes).
        self.overlap = overlap
        self._device_calls: Callable[[], ContextManager] = contextlib.nullcontext  # a save's
        self._stages = [aligned(0, pinned=False), aligned(0, pinned=False)]  # encoded bytes
        # A restore's buffers, grown on the caller's thread before its first read and reused
        # (under io_lock, one restore at a time), in slots: file i is read into the stored
        # bytes of slot i % S and decompressed into its planes, S = the files ahead + 1. File
        # i+S is submitted only after file i is checked (the caller joined its planes, and a
        # check reads its sums back, past the join's copy from pinned planes).
        self._read_bufs: list[np.ndarray] = []
        self._planes: list[torch.Tensor] = []
        # torch's work stays on the engine's OpenMP team (tandem.torch_thread)
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="spill-io-read",
                                           initializer=one_openmp_thread_here)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="spill-io",
                                      initializer=one_openmp_thread_here)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._own_codec:
            self.codec.close()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def __enter__(self) -> "SessionSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the index ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.manifest.nbytes for e in self._index.values())

    def entries(self) -> dict[str, Manifest]:
        with self._lock:
            return {k: e.manifest for k, e in self._index.items()}

    def last_used(self, eid: str) -> float | None:
        with self._lock:
            e = self._index.get(eid)
            return None if e is None else e.last_used

    def open(self) -> dict[str, int]:
        """Scan the folder: index every entry that may be served and delete the rest (a folder
        without a manifest, another fingerprint's, a bad manifest, missing or resized files,
        a symlink in an entry's place), and files no manifest names. Counts by why."""
        dropped: dict[str, int] = {}

        def drop(eid: str, why: str) -> None:
            self._remove(eid)
            dropped[why] = dropped.get(why, 0) + 1
            log.info("spill_entry_dropped", eid=eid[:12], why=why)

        index: dict[str, _Indexed] = {}
        for name in sorted(os.listdir(self.root_fd)):
            if not _is_id(name):
                continue  # not a name the spill makes: left alone
            try:
                fd = open_folder(name, dir_fd=self.root_fd, create=False)
            except (RefusedEntry, NotADirectoryError):
                drop(name, "refused")
                continue
            try:
                why, m, mtime = self._check_entry(fd, name)
            finally:
                os.close(fd)
            if m is None:
                drop(name, why)
                continue
            index[name] = _Indexed(m, mtime)
        with self._lock:
            self._index = index
        self.dropped_at_open = dropped
        log.info("spill_opened", entries=len(index), dropped=sum(dropped.values()),
                 nbytes=sum(e.manifest.nbytes for e in index.values()))
        return dropped

    def _check_entry(self, fd: int, eid: str) -> tuple[str, Manifest | None, float]:
        try:
            raw, mtime = _read_small(fd, MANIFEST)
        except FileNotFoundError:
            return "unfinished", None, 0.0
        except (RefusedEntry, OSError):
            return "refused", None, 0.0
        try:
            m = parse_manifest(raw)
        except (ValueError, msgspec.DecodeError):
            return "manifest", None, 0.0
        if m.fingerprint not in self.identity:
            return "fingerprint", None, 0.0
        if (m.grid != self.grid or entry_id(m.session, m.namespace) != eid
                or not _consistent(m)):
            return "manifest", None, 0.0
        named = {f.name: f.file_nbytes for f in m.files()}
        for name in os.listdir(fd):
            if name == MANIFEST:
                continue
            if name not in named:  # a rewrite's leftover, a temp, or no name of ours
                _unlink(fd, name)
                continue
        for name, nbytes in named.items():
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return "missing", None, 0.0
            if not _regular(st) or st.st_size != nbytes:
                return "missing", None, 0.0
        return "", m, mtime

    # -- delete and evict -----------------------------------------------------------------

    def delete(self, eid: str) -> bool:
        """Delete the entry: its manifest first, so that a crash part way leaves an entry the
        next open deletes, never a torn one served."""
        with self._lock:
            had = self._index.pop(eid, None) is not None
        return self._remove(eid) or had

    def _remove(self, eid: str) -> bool:
        if not _is_id(eid):
            raise ValueError("an entry is named by its id (64 hex digits)")
        try:
            fd = open_folder(eid, dir_fd=self.root_fd, create=False)
        except FileNotFoundError:
            return False
        except (RefusedEntry, NotADirectoryError):
            os.unlink(eid, dir_fd=self.root_fd)  # a symlink or a file in an entry's place
            fsync_folder(self.root_fd)
            return True
        try:
            if _unlink(fd, MANIFEST):
                fsync_folder(fd)
            for name in os.listdir(fd):
                if not _unlink(fd, name):
                    # a folder inside an entry is none of ours: take it out whole
                    shutil.rmtree(os.path.join(self.root, eid, name), ignore_errors=True)
        finally:
            os.close(fd)
        os.rmdir(eid, dir_fd=self.root_fd)
        fsync_folder(self.root_fd)
        return True

    def clear(self) -> dict[str, int]:
        """Delete every entry (after the save or restore under way): what went."""
        with self.io_lock:
            with self._lock:
                gone = dict(self._index)
            for eid in gone:
                self.delete(eid)
        return {"entries": len(gone), "nbytes": sum(e.manifest.nbytes for e in gone.values())}

    def sweep(self, now: float | None = None) -> list[str]:
        """``evict`` between two saves or restores (the spill writer's periodic sweep): the
        entries unused for ``ttl_s``, then the least recently used over the budget."""
        with self.io_lock:
            return self.evict(now)

    def statistics(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._index.values())
        return {"entries": len(entries),
                "nbytes": sum(e.manifest.nbytes for e in entries),
                "tokens": sum(e.manifest.valid for e in entries),
                "budget_nbytes": self.budget_nbytes, "ttl_s": self.ttl_s,
                "oldest_used": min((e.last_used for e in entries), default=None),
                "dropped_at_open": dict(self.dropped_at_open)}

    def evict(self, now: float | None = None, need_nbytes: int = 0,
              keep: str | None = None) -> list[str]:
        """Delete every entry unused for ``ttl_s``, then the least recently used until the
        entries and ``need_nbytes`` fit the budget (``keep`` is not deleted). The ids gone."""
        now = self.wall() if now is None else now
        with self._lock:
            order = sorted(self._index.items(), key=lambda kv: kv[1].last_used)
        gone: list[str] = []
        total = sum(e.manifest.nbytes for _, e in order)
        for eid, e in order:
            if eid == keep:
                continue
            if now - e.last_used > self.ttl_s:
                why = "ttl"
            elif total + need_nbytes > self.budget_nbytes:
                why = "budget"
            else:
                continue
            self.delete(eid)
            total -= e.manifest.nbytes
            gone.append(eid)
            log.info("spill_evicted", eid=eid[:12], why=why, nbytes=e.manifest.nbytes)
        return gone

    # -- save -----------------------------------------------------------------------------

    def save(self, eid: str, state: CacheState, valid: int, token_ids: Sequence[int],
             anchors: Mapping[int, SectionsCopy | Mapping[str, torch.Tensor]],
             end: SpillEnd | None, meta: EntryMeta, *, now: float | None = None,
             writer_ms: float = 0.0, stop: Callable[[], bool] | None = None,
             device_calls: Callable[[], ContextManager] | None = None) -> SaveReport:
        """Write the conversation: rows ``[0, valid)`` of every view, the newest 4 of
        ``anchors`` (grid lines at or below ``valid``), ``end`` and ``meta``, keeping every
        block and anchor of the entry's files whose content is unchanged. Raises
        ``SpillWriteFailed`` (the entry gone) on an I/O error. Under ``io_lock``, the disk
        writer waiting meanwhile; ``writer_ms``: how long the save waited in its caller's
        queue, for the log line. ``stop`` (a prewarm's): asked before each file; True raises
        ``SpillStopped`` with the entry deleted, as a failed write leaves it (the rows it held
        are still the engine's). ``device_calls``: held around each step that issues device
        work (the block sums and their copy, each buffer's planes and their copy to the
        host): the spill writer's capture-lock grant on CUDA, so that a graph capture never
        runs beside them and waits at most one buffer's copy; None (a CPU state) holds nothing."""
        t = time.perf_counter()
        with self.io_lock:
            self._device_calls = device_calls or contextlib.nullcontext
            lock_ms = _ms(t)
            try:
                with self.turns.save() as waits_ms:
                    report = self._save(eid, state, valid, token_ids, anchors, end, meta,
                                        now=now, stop=stop)
            finally:
                self._device_calls = contextlib.nullcontext
        ms = {"writer": writer_ms, "lock": lock_ms, "waits": waits_ms, **report.ms,
              "total": _ms(t)}
        report = msgspec.structs.replace(report, ms=ms)
        log.info("spill_saved", eid=eid[:12], rows=valid, skipped=report.skipped,
                 blocks_written=report.blocks_written, blocks_kept=report.blocks_kept,
                 anchors_written=report.anchors_written, anchors_kept=report.anchors_kept,
                 nbytes=report.nbytes_written, raw_nbytes=report.raw_nbytes_written,
                 evicted=report.evicted, **{f"{k}_ms": round(v, 2) for k, v in ms.items()})
        return report

    def _save(self, eid: str, state: CacheState, valid: int, token_ids: Sequence[int],
              anchors: Mapping[int, SectionsCopy | Mapping[str, torch.Tensor]],
              end: SpillEnd | None, meta: EntryMeta, *, now: float | None,
              stop: Callable[[], bool] | None = None) -> SaveReport:
        t_all = time.perf_counter()
        now = self.wall() if now is None else now
        if eid != meta.entry_id:
            raise ValueError("the entry id is not the one of the meta's session and namespace")
        if not 0 < valid <= len(token_ids):
            raise ValueError(f"valid {valid} with {len(token_ids)} token ids")
        views = _view_layouts(state)
        sections = _section_layouts(state.sections)
        for name, v in state.views.items():
            if v.tensor.shape[v.token_axis] < valid:
                raise ValueError(f"view {name!r} holds fewer than {valid} rows")
        G = self.grid
        lines = sorted(line for line in anchors if 0 < line <= valid and line % G == 0)
        lines = lines[-ANCHORS_KEPT:]
        if end is not None and not 0 < end.length <= valid:
            raise ValueError(f"an end anchor at {end.length} outside the {valid} rows")
        tokens = [int(t) for t in token_ids[:valid]]
        ms = dict.fromkeys(("staging", "sums", "copy", "compress", "write", "fsync", "anchors",
                            "manifest"), 0.0)

        t = time.perf_counter()
        with self._device_calls():
            # Every view's block sums in one tensor, off the device in one copy.
            block_sums_host = host_sums(views_block_sums(state.views, 0, valid, G))  # [V, B, 2]
            anchor_secs = {line: _tensors(anchors[line]) for line in lines}
            anchor_sums = {line: host_sums(sections_sums(anchor_secs[line])) for line in lines}
            end_sums = (host_sums(sections_sums(dict(end.sections))) if end is not None
                        else None)
        ms["sums"] = _ms(t)

        with self._lock:
            old_entry = self._index.get(eid)
        old = old_entry.manifest if old_entry is not None else None
        if old is not None and (old.views != views or old.sections != sections):
            old = None  # another layout: nothing of it can be kept
        old_blocks = {(b.start, b.stop): b for b in old.blocks} if old is not None else {}
        old_anchors = {a.stop: a for a in old.anchors} if old is not None else {}
        num_blocks = -(-valid // G)
        plan: list[tuple[int, int, FileRecord | None, list[tuple[int, int]]]] = []
        for k in range(num_blocks):
            a, b = k * G, min((k + 1) * G, valid)
            sums = [(int(block_sums_host[v, k, 0]), int(block_sums_host[v, k, 1]))
                    for v in range(len(views))]
            prev = old_blocks.get((a, b))
            keep = (prev is not None and prev.sums() == sums
                    and old.token_ids[a:b] == tokens[a:b])
            plan.append((a, b, prev if keep else None, sums))
        anchor_plan = []
        for line in lines:
            sums = _pairs(anchor_sums[line])
            prev = old_anchors.get(line)
            anchor_plan.append((line, prev if prev is not None and prev.sums() == sums
                                else None, sums))
        end_keep: FileRecord | None = None
        end_meta: Any = None
        end_kept_from_disk = False
        if end is not None:
            sums = _pairs(end_sums)
            if (old is not None and old.end is not None and old.end.file.stop == end.length
                    and old.end.file.sums() == sums):
                end_keep = old.end.file
            end_meta = end.meta
        elif (old is not None and old.end is not None and old.valid == valid
              and old.token_ids == tokens and all(p[2] is not None for p in plan)):
            # The engine gave the end's buffers back (a cache level), but the rows are the
            # ones on the disk: the end anchor there is still the state at its rows.
            end_keep, end_meta, end_kept_from_disk = old.end.file, old.end.meta, True

        kept_blocks = sum(1 for p in plan if p[2] is not None)
        kept_anchors = (sum(1 for p in anchor_plan if p[1] is not None)
                        + (1 if end_keep is not None else 0))
        new_end = end is not None and end_keep is None
        raw_need = (sum(sum(_rows_nbytes(v, b - a) for v in state.views.values())
                        for a, b, prev, _ in plan if prev is None)
                    + sum(_sections_nbytes(anchor_secs[line])
                          for line, prev, _ in anchor_plan if prev is None)
                    + (_sections_nbytes(end.sections) if new_end else 0))
        unchanged = (old is not None and raw_need == 0 and old.valid == valid
                     and old.token_ids == tokens and old.taint == meta.taint
                     and old.meta == meta.extra and old.namespace == meta.namespace
                     and [a.stop for a in old.anchors] == lines
                     and (old.end.file if old.end is not None else None) == end_keep
                     and (old.end.meta if old.end is not None else None) == end_meta)
        if unchanged:
            self._touch(eid, now)
            return SaveReport(eid, valid, 0, kept_blocks, 0, kept_anchors, 0, 0, old.nbytes,
                              0, end_kept_from_disk, "nothing",
                              dict(ms, total=_ms(t_all)))
        # Room for the new bytes (their size in the engine: the stored ones are never more),
        # the entry's own files counted as they stand.
        evicted = self.evict(now, need_nbytes=raw_need, keep=eid)
        kept_nbytes = (sum(p[2].file_nbytes for p in plan if p[2] is not None)
                       + sum(p[1].file_nbytes for p in anchor_plan if p[1] is not None)
                       + (end_keep.file_nbytes if end_keep is not None else 0))
        if raw_need + kept_nbytes > self.budget_nbytes:
            return SaveReport(eid, valid, 0, 0, 0, 0, 0, 0, 0, len(evicted), False, "budget",
                              dict(ms, total=_ms(t_all)))

        written = 0
        raw_written = 0
        pipe: _WritePipe | None = None
        try:
            fd = open_folder(eid, dir_fd=self.root_fd, create=True)
        except OSError as exc:
            raise SpillWriteFailed(eid, exc) from exc
        try:
            try:
                # Removed first: from here until the new one is renamed into place the folder
                # is a write that did not finish.
                if _unlink(fd, MANIFEST):
                    fsync_folder(fd)
                with self._lock:
                    self._index.pop(eid, None)
                pipe = _WritePipe(self, fd)
                blocks: list[FileRecord] = []
                view_list = list(state.views.items())
                def stopping(what: str) -> None:
                    if stop is not None and stop():
                        raise SpillStopped(f"save stopped before {what}")

                for a, b, prev, sums in plan:
                    if prev is not None:
                        blocks.append(prev)
                        continue
                    stopping(f"block {a}-{b}")
                    name = _file_name("blk", a, b, self.codec_version,
                                      *(s for pair in sums for s in pair))
                    rec, n, raw = self._write_file(
                        fd, name, a, b, [(v.rows(a, b), s) for (_, v), s in zip(view_list, sums)],
                        ms, pipe=pipe)
                    blocks.append(rec)
                    written += n
                    raw_written += raw
                anchor_recs: list[FileRecord] = []
                t = time.perf_counter()
                for line, prev, sums in anchor_plan:
                    if prev is not None:
                        anchor_recs.append(prev)
                        continue
                    stopping(f"anchor {line}")
                    name = _file_name("anc", line, self.codec_version,
                                      *(s for pair in sums for s in pair))
                    rec, n, raw = self._write_file(
                        fd, name, 0, line, list(zip(anchor_secs[line].values(), sums)), ms,
                        pipe=pipe)
                    anchor_recs.append(rec)
                    written += n
                    raw_written += raw
                end_rec: EndRecord | None = None
                if end_keep is not None:
                    end_rec = EndRecord(end_keep, end_meta)
                elif end is not None:
                    stopping("the end anchor")
                    sums = _pairs(end_sums)
                    name = _file_name("end", end.length, self.codec_version,
                                      *(s for pair in sums for s in pair))
                    rec, n, raw = self._write_file(
                        fd, name, 0, end.length, list(zip(dict(end.sections).values(), sums)),
                        ms, pipe=pipe)
                    end_rec = EndRecord(rec, end_meta)
                    written += n
                    raw_written += raw
                ms["anchors"] = _ms(t)
                pipe.drain()  # every file written and fsynced, or the first write's error
                for k, v in pipe.ms.items():
                    ms[k] = ms.get(k, 0.0) + v
                t = time.perf_counter()
                fsync_folder(fd)  # the files' names, before the manifest that lists them
                ms["fsync"] += _ms(t)

                t = time.perf_counter()
                m = Manifest(MANIFEST_VERSION, self.identity.fingerprint, G,
                             str(meta.namespace), meta.session, valid, meta.taint, tokens,
                             views, sections, blocks, anchor_recs, end_rec, now, meta.extra)
                data = manifest_bytes(m)
                write_atomic_at(fd, MANIFEST, data, TMP)
                self._count(len(data))
                ms["manifest"] = _ms(t)
                named = {f.name for f in m.files()}
                for name in os.listdir(fd):
                    if name != MANIFEST and name not in named:
                        _unlink(fd, name)  # the files of the old manifest no longer listed
            except BaseException as exc:
                # The manifest is gone already: what is left is no entry, and goes now rather
                # than at the next open.
                if isinstance(exc, SpillStopped):
                    log.info("spill_save_stopped", eid=eid[:12])
                else:
                    log.warning("spill_write_failed", eid=eid[:12],
                                errno=getattr(exc, "errno", None), error=type(exc).__name__)
                if pipe is not None:
                    pipe.stop()  # nothing of this save still runs when the folder goes
                os.close(fd)
                fd = -1
                try:
                    self._remove(eid)
                except OSError:
                    pass  # the next open deletes a folder without a manifest
                if isinstance(exc, OSError):
                    raise SpillWriteFailed(eid, exc) from exc
                raise
        finally:
            if fd >= 0:
                os.close(fd)
        with self._lock:
            self._index[eid] = _Indexed(m, now)
        self._touch(eid, now)
        ms["total"] = _ms(t_all)
        report = SaveReport(eid, valid, num_blocks - kept_blocks, kept_blocks,
                            len(anchor_plan) + (end_rec is not None) - kept_anchors,
                            kept_anchors, written, raw_written, m.nbytes, len(evicted),
                            end_kept_from_disk, "", ms, len(data))
        return report

    def _count(self, nbytes: int) -> None:
        if self.guard is not None and nbytes:
            self.guard.add(nbytes, "spill")

    def _write_file(self, fd: int, name: str, start: int, stop: int,
                    parts: list[tuple[torch.Tensor, tuple[int, int]]],
                    ms: dict[str, float], *, pipe: "_WritePipe") -> tuple[FileRecord, int, int]:
        """One file of the buffers ``parts`` (each with its sums), each at a 4 KiB-aligned
        offset: encoded here into one of the pipe's stages, then written by one O_DIRECT
        write and an fsync (``pipe.put``: on ``_io``, while the next file is encoded).
        (record, bytes written, raw bytes)."""
        raw_total = sum(round_up(t.numel() * t.element_size()) for t, _ in parts)
        stage = pipe.stage(raw_total)
        out: list[Part] = []
        at = 0
        raw = 0
        for tensor, (plain, weighted) in parts:
            t = time.perf_counter()
            nbytes = tensor.numel() * tensor.element_size()
            raw += nbytes
            target = memoryview(stage[at:at + nbytes])
            if self.codec_version == CODEC_VERSION:
                with self._device_calls():
                    planes = cut_planes(tensor.detach())
                    if planes.device.type != "cpu":
                        planes = host_clone(planes)  # pinned: one DMA off the device
                planes = planes.numpy()
                ms["copy"] += _ms(t)
                t = time.perf_counter()
                enc = self.codec.compress_planes(planes, tensor.dtype, list(tensor.shape),
                                                 target)
                ms["compress"] += _ms(t)
            else:
                with self._device_calls():
                    enc = self.codec.encode(tensor, self.codec_version, target)
                ms["copy"] += _ms(t)
            stored = enc.header.nbytes
            padded = round_up(stored)
            stage[at + stored:at + padded] = 0
            out.append(Part(at, enc.header, plain, weighted))
            at += padded
        pipe.put(name, at)
        return FileRecord(name, start, stop, at, out), at, raw

    def _put_file(self, fd: int, name: str, data: np.ndarray, ms: dict[str, float]) -> None:
        """Write ``data`` (aligned, a whole number of 4 KiB) as the new file ``name``: one
        O_DIRECT write, an fsync."""
        t = time.perf_counter()
        f = DirectFile.create(fd, name, self.direct)
        try:
            if data.nbytes:
                f.pwrite_from(data, 0)
                self._count(data.nbytes)  # on the disk now, whatever happens to the entry
            ms["write"] += _ms(t)
            t = time.perf_counter()
            f.finish_write()
            ms["fsync"] += _ms(t)
        finally:
            f.close()

    def _touch(self, eid: str, now: float) -> None:
        """Mark the entry used at ``now``: its manifest's mtime, which a restart reads."""
        with self._lock:
            e = self._index.get(eid)
            if e is not None:
                e.last_used = now
        try:
            os.utime(os.path.join(self.root, eid, MANIFEST), (now, now), follow_symlinks=False)
        except OSError:
            pass

    # -- offer ----------------------------------------------------------------------------

    def offer(self, token_ids: Sequence[int], namespace: Namespace | str) -> SpillOffer | None:
        """The entry of ``namespace`` that serves the most of the prompt: where it resumes
        (its end when the prompt reaches it, else its highest anchor at or below the rows the
        prompt shares), how far the tokens match, and what the read costs. None: no entry of
        the namespace shares a row."""
        with self._lock:
            candidates = [(eid, e.manifest, e.last_used) for eid, e in self._index.items()
                          if e.manifest.namespace == namespace]
        best: SpillOffer | None = None
        for eid, m, used in candidates:
            matched = common_prefix(m.token_ids, token_ids)
            if matched == 0:
                continue
            below = [a.stop for a in m.anchors if a.stop <= matched]
            end_length = m.end.file.stop if m.end is not None else None
            end_reached = end_length is not None and matched >= end_length
            line = end_length if end_reached else (below[-1] if below else 0)
            read = 0
            if line:
                read = sum(b.file_nbytes for b in m.blocks if b.start < line)
                read += sum(f.file_nbytes for f in m.anchors)
                read += m.end.file.file_nbytes if m.end is not None else 0
            o = SpillOffer(eid, matched, m.valid, line, end_length, end_reached, below, read,
                           m.end.meta if m.end is not None else None,
                           m.taint, used)
            if best is None or (o.line, o.matched, o.last_used) > (best.line, best.matched,
                                                                   best.last_used):
                best = o
        return best

    def token_ids(self, eid: str) -> list[int] | None:
        """The entry's token ids (for the end alignment), None when there is no such entry."""
        with self._lock:
            e = self._index.get(eid)
            return None if e is None else e.manifest.token_ids

    # -- restore --------------------------------------------------------------------------

    def restore(self, eid: str, state: CacheState, rows_in_place: Sequence[int], *,
                line: int | None = None, now: float | None = None,
                stop: Callable[[], bool] | None = None) -> RestoreReport:
        """Write the entry back into ``state`` up to ``line`` (default: its end anchor, else its
        highest grid anchor): every block below ``line`` the rows in place do not already hold,
        and the sections at ``line``. Every block read is summed again before a row of it is
        written, and every anchor before it is returned. On a bad file: ``SpillReadFailed``,
        the entry deleted, the rows below ``intact_below`` untouched. Under ``io_lock`` (the
        engine thread may call it beside the spill writer's save: it waits for it).

        ``stop`` (a prewarm's): asked before each file; True raises ``SpillStopped``. With it,
        the blocks over rows in place are held in their own buffers and written only once every
        file is read and checked, so that a stop leaves the rows in place as they were (the
        blocks above them go in as they are read: no read sees a row above the length)."""
        t = time.perf_counter()
        with self.io_lock:
            lock_ms = _ms(t)
            return self._restore(eid, state, rows_in_place, line=line, now=now, t_all=t,
                                 lock_ms=lock_ms, stop=stop)

    def _restore(self, eid: str, state: CacheState, rows_in_place: Sequence[int], *,
                 line: int | None, now: float | None, t_all: float,
                 lock_ms: float, stop: Callable[[], bool] | None = None) -> RestoreReport:
        now = self.wall() if now is None else now
        with self._lock:
            e = self._index.get(eid)
        if e is None:
            raise SpillReadFailed("missing", eid, "no such entry", intact_below=len(rows_in_place))
        m = e.manifest
        ends = {a.stop: a for a in m.anchors}
        if m.end is not None:
            ends[m.end.file.stop] = m.end.file
        if line is None:
            line = m.end.file.stop if m.end is not None else max(ends, default=0)
        if line not in ends:
            raise ValueError(f"the entry has no anchor at {line}")
        for name, v in state.views.items():
            if v.tensor.shape[v.token_axis] < m.valid:
                # the caller's window, not the entry: it stays for a state that holds it
                raise ValueError(f"view {name!r} holds fewer than the entry's {m.valid} rows")
        in_place = common_prefix(rows_in_place, m.token_ids)
        ms = dict.fromkeys(("read", "decode", "join", "sums", "copy", "anchors", "read_wait"),
                           0.0)
        ms["lock"] = lock_ms
        todo = [b for b in m.blocks if b.start < line and b.stop > in_place]
        skipped = sum(1 for b in m.blocks if b.start < line and b.stop <= in_place)
        intact_below = todo[0].start if todo else line
        rows_written(state.views, intact_below)  # borrowers of the rows it writes copy first
        nbytes = 0
        try:
            # The layouts, before a byte is read: the state's views and sections against the
            # manifest's, and every file's parts against the buffers they go into.
            if _view_layouts(state) != m.views or _section_layouts(state.sections) != m.sections:
                raise _Bad("layout", "the entry's buffers are not the state's")
            for b in m.blocks:
                _check_parts(b, [(v.dtype, _block_shape(v, b.stop - b.start)) for v in m.views])
            for f in m.anchors + ([m.end.file] if m.end is not None else []):
                _check_parts(f, [(s.dtype, s.shape) for s in m.sections])
            # The blocks, then the anchors and the end, in the manifest's order: files i+1 to
            # i+depth are read and decompressed on the readers while file i is joined, summed
            # and copied here.
            files = todo + m.anchors + ([m.end.file] if m.end is not None else [])
            depth = self._grow_read_buffers(files, ms)
            slots = depth + 1
            fd = open_folder(eid, dir_fd=self.root_fd, create=False)
            ahead: dict[int, Future] = {}
            submitted = 0

            def top_up(upto: int) -> None:
                nonlocal submitted
                while submitted < min(upto, len(files)):
                    ahead[submitted] = self._readers.submit(
                        self._read_file, fd, files[submitted], submitted % slots)
                    submitted += 1

            def fetch(i: int) -> _Fetched:
                if depth:  # file i and the depth after it in flight: file i-1 is checked
                    top_up(i + 1 + depth)
                t = time.perf_counter()
                got = (ahead.pop(i).result() if i in ahead
                       else self._read_file(fd, files[i], 0))
                ms["read_wait"] += _ms(t)
                return got

            try:
                top_up(depth)
                view_list = list(state.views.values())
                anchors: dict[int, SectionsCopy] = {}
                end_copy: SpillEnd | None = None
                t_anchors = time.perf_counter()
                held: list[tuple[FileRecord, list[torch.Tensor]]] = []  # over rows in place
                # Each view's block scratch, reused block after block (its rows are copied out
                # before the next block is joined into it; on a device, in stream order); a
                # held block gets its own.
                reused: list[torch.Tensor | None] = [None] * len(view_list)
                for i, f in enumerate(files):
                    if stop is not None and stop():
                        raise SpillStopped(f"stopped before file {i} of {len(files)}")
                    got = fetch(i)
                    ms["read"] += got.read_ms
                    ms["decode"] += got.decompress_ms
                    nbytes += f.file_nbytes
                    if i < len(todo):
                        hold = stop is not None and f.start < len(rows_in_place)
                        scratch = [_scratch(reused, k, _block_shape(lv, f.stop - f.start),
                                            v.tensor, fresh=hold)
                                   for k, (lv, v) in enumerate(zip(m.views, view_list))]
                        self._check_file(f, got, scratch, ms)
                        if hold:
                            held.append((f, scratch))
                            continue
                        t = time.perf_counter()
                        for v, s in zip(view_list, scratch):
                            _copy(v.rows(f.start, f.stop), s)
                        ms["copy"] += _ms(t)
                        t_anchors = time.perf_counter()
                        continue
                    copy = {s.name: torch.empty(s.shape, dtype=t0.dtype, device=t0.device)
                            for s, t0 in zip(m.sections, state.sections.values())}
                    self._check_file(f, got, list(copy.values()), ms)
                    if m.end is not None and f is m.end.file:
                        end_copy = SpillEnd(f.stop, copy, m.end.meta)
                    else:
                        anchors[f.stop] = SectionsCopy(copy)
                ms["anchors"] = _ms(t_anchors) if len(files) > len(todo) else 0.0
            finally:
                wait_all(list(ahead.values()))  # no read of the folder outlives its descriptor
                os.close(fd)
                self._trim_read_buffers()
        except (_Bad, OSError, CodecError) as exc:
            reason: Refusal = exc.reason if isinstance(exc, _Bad) else (
                "codec" if isinstance(exc, CodecError) else
                "missing" if isinstance(exc, FileNotFoundError) else "io")
            log.warning("spill_restore_failed", eid=eid[:12], why=reason)
            self.delete(eid)
            raise SpillReadFailed(reason, eid, str(exc), intact_below) from None
        t = time.perf_counter()
        for f, scratch in held:  # every file checked: the rows in place may go now
            for v, s in zip(view_list, scratch):
                _copy(v.rows(f.start, f.stop), s)
        ms["copy"] += _ms(t)
        source = end_copy.sections if (m.end is not None and line == m.end.file.stop) \
            else anchors[line].tensors
        for name, t in state.sections.items():
            _copy(t, source[name])
        self._touch(eid, now)
        ms["total"] = _ms(t_all)
        taint = m.taint if m.taint is not None and m.taint < line else None
        report = RestoreReport(eid, line, m.token_ids[:line], taint, len(todo), skipped,
                               nbytes, anchors, end_copy, ms)
        log.info("spill_restored", eid=eid[:12], line=line, blocks_read=len(todo),
                 blocks_in_place=skipped, nbytes=nbytes,
                 **{f"{k}_ms": round(v, 2) for k, v in ms.items()})
        return report

    def _grow_read_buffers(self, files: list[FileRecord], ms: dict[str, float]) -> int:
        """The files ahead (0: serial) and a slot for each and the one checked: its stored
        bytes to the largest file, its planes to the largest file's raw bytes; on the caller's
        thread (a pinned allocation is a CUDA call)."""
        t = time.perf_counter()
        read = max((f.file_nbytes for f in files), default=0)
        raw = max((sum(p.header.raw_nbytes for p in f.parts) for f in files), default=0)
        depth = (max(1, min(READ_AHEAD, READ_AHEAD_NBYTES // max(1, read + raw) - 1))
                 if self.overlap else 0)
        pinned = staging_pinned()
        for k in range(depth + 1):
            if k == len(self._read_bufs):
                self._read_bufs.append(aligned(0, pinned=False))
                self._planes.append(torch.empty(0, dtype=torch.uint8))
            if self._read_bufs[k].nbytes < read:
                self._read_bufs[k] = aligned(read, pinned=False)  # frames: decoded on the host
            if self._planes[k].numel() < raw or self._planes[k].is_pinned() != pinned:
                self._planes[k] = torch.empty(raw, dtype=torch.uint8, pin_memory=pinned)
        ms["staging"] = _ms(t)
        return depth

    def _trim_read_buffers(self) -> None:
        """Keep the slots' buffers for the next restore only while they are small."""
        kept = sum(b.nbytes for b in self._read_bufs) + sum(p.numel() for p in self._planes)
        if kept > KEEP_NBYTES:
            self._read_bufs, self._planes = [], []

    def _read_file(self, fd: int, rec: FileRecord, slot: int) -> "_Fetched":
        """Read ``rec`` whole into ``slot``'s stored bytes and decompress each part on the host
        into its planes (on a reader when the restore overlaps); raise ``_Bad`` for a file of
        another size. A part that does not decompress keeps its ``CodecError`` for
        ``_check_file``, so that the parts before it are checked first, as they would be one
        by one."""
        t = time.perf_counter()
        try:
            f = DirectFile.open_read(fd, rec.name, self.direct)
        except RefusedEntry as exc:
            raise _Bad("missing", f"{rec.name[:8]}: {exc.strerror}") from None
        try:
            if f.size != rec.file_nbytes:
                raise _Bad("layout", f"{rec.name[:8]}: {f.size} bytes, not {rec.file_nbytes}")
            buf = self._read_bufs[slot][:rec.file_nbytes]
            if rec.file_nbytes and f.pread_into(buf, 0) != rec.file_nbytes:
                raise _Bad("layout", f"{rec.name[:8]}: cut")
        finally:
            f.close()
        read_ms = _ms(t)
        t = time.perf_counter()
        planes, at = self._planes[slot], 0
        parts: list[torch.Tensor | CodecError] = []
        for part in rec.parts:
            data = memoryview(buf[part.offset:part.offset + part.header.nbytes])
            n = part.header.raw_nbytes
            try:
                parts.append(self.codec.decompress_into(data, part.header, planes[at:at + n]))
            except CodecError as exc:
                parts.append(exc)
            at += n
        return _Fetched(parts, read_ms, _ms(t))

    def _check_file(self, rec: FileRecord, got: "_Fetched", outs: list[torch.Tensor],
                    ms: dict[str, float]) -> None:
        """Join each part's planes into its ``outs`` buffer (where the rows are) and sum it
        there; raise ``_Bad`` when a sum is not the manifest's."""
        for part, planes, out in zip(rec.parts, got.parts, outs):
            if isinstance(planes, CodecError):
                raise planes
            t = time.perf_counter()
            self.codec.join_into(planes, part.header, out)
            ms["join"] += _ms(t)
            t = time.perf_counter()
            got_sums = _pairs(host_sums(block_sums(out).unsqueeze(0)))[0]
            ms["sums"] += _ms(t)
            if got_sums != (part.plain, part.weighted):
                raise _Bad("sums", f"{rec.name[:8]}: a part's sums are not the manifest's")


class _Fetched(NamedTuple):
    """A file read and decompressed: each part's planes (or the error its frames gave)."""

    parts: list[torch.Tensor | CodecError]
    read_ms: float
    decompress_ms: float


class _WritePipe:
    """A save's files in flight: each is encoded into one of the spill's two stages (on the
    caller's thread) and written from it (on ``_io``), so that file k+1 is encoded while file k
    is written. A stage is taken again only once its write has finished, and a failed write's
    error is raised there, at the next stage taken, or by ``drain``: a save goes on past a
    failed write by one file's encoding at most, and writes nothing after it. Without the
    overlap, ``put`` writes on the caller's thread."""

    def __init__(self, spill: SessionSpill, fd: int):
        self.spill, self.fd = spill, fd
        self._slots: list[Future | None] = [None, None]
        self._turn = 0
        self._writes: list[Future] = []
        self._stopped = False
        # the writer's, the waits, and growing the stages
        self.ms = {"write": 0.0, "fsync": 0.0, "stage_wait": 0.0, "staging": 0.0}

    def stage(self, nbytes: int) -> np.ndarray:
        self._turn ^= 1
        prev = self._slots[self._turn]
        if prev is not None:
            t = time.perf_counter()
            prev.result()
            self.ms["stage_wait"] += _ms(t)
        stages = self.spill._stages
        if stages[self._turn].nbytes < nbytes:
            t = time.perf_counter()
            stages[self._turn] = aligned(nbytes, pinned=False)
            self.ms["staging"] += _ms(t)
        return stages[self._turn]

    def put(self, name: str, nbytes: int) -> None:
        """Write the stage last taken, its first ``nbytes``, as the file ``name``."""
        data = self.spill._stages[self._turn][:nbytes]
        if not self.spill.overlap:
            self.spill._put_file(self.fd, name, data, self.ms)
            return
        fut = self.spill._io.submit(self._write, name, data)
        self._slots[self._turn] = fut
        self._writes.append(fut)

    def _write(self, name: str, data: np.ndarray) -> None:
        if self._stopped:
            return
        try:
            self.spill._put_file(self.fd, name, data, self.ms)
        except BaseException:
            self._stopped = True  # the files queued behind a failed write are not written
            raise

    def drain(self) -> None:
        """Wait for every write; raise the first one's error."""
        t = time.perf_counter()
        wait_all(self._writes)
        self.ms["stage_wait"] += _ms(t)
        for fut in self._writes:
            if fut.exception() is not None:
                raise fut.exception()

    def stop(self) -> None:
        """Skip the writes not started and wait until none runs (the save failed)."""
        self._stopped = True
        wait_all(self._writes)


# -- helpers --------------------------------------------------------------------------------

def make_session_spill(config: Any, identity: Identity, grid: int, *,
                       guard: "WriteGuard | None" = None) -> SessionSpill:
    """The server's spill from ``config.spill``, under the disk tier's folder (``sessions/``),
    with the tier's identity and write guard (``DiskTier.guard``: one day's count for both);
    opened."""
    s = config.spill
    spill = SessionSpill(config.disk_cache_path() / "sessions", identity, grid,
                         budget_nbytes=int(s.session_spill_gb * GB), guard=guard)
    spill.open()
    return spill


def _scratch(reused: list[torch.Tensor | None], k: int, shape: list[int], like: torch.Tensor,
             fresh: bool) -> torch.Tensor:
    """A contiguous block of ``shape`` beside ``like`` (its dtype and device): view ``k``'s
    reused buffer, grown to the block, or a new one (``fresh``: a block held to the end)."""
    numel = math.prod(shape)
    if fresh:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    buf = reused[k]
    if buf is None or buf.numel() < numel:
        buf = reused[k] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same dtype and shape); between host tensors in numpy, on this
    thread: torch's intra-op pool split a block's copy across threads whose barrier, on a
    busy machine, waited a scheduler slice (a restore's copies took 36 ms of its 46 in a
    server on 2 cores)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and \
            dst.element_size() in _SAME_SIZE and dst.dtype == src.dtype:
        as_ints = _SAME_SIZE[dst.element_size()]  # bf16 has no numpy dtype; its bits do
        np.copyto(dst.view(as_ints).numpy(), src.view(as_ints).numpy())
    else:
        dst.copy_(src)


def _ms(t: float) -> float:
    return (time.perf_counter() - t) * 1000.0


def _pairs(sums: np.ndarray) -> list[tuple[int, int]]:
    return [(int(p), int(w)) for p, w in sums]


def _tensors(sections: SectionsCopy | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(getattr(sections, "tensors", sections))


def _view_layouts(state: CacheState) -> list[ViewLayout]:
    out = []
    for name, v in state.views.items():
        axis = v.token_axis % v.tensor.dim()
        shape = [0 if i == axis else d for i, d in enumerate(v.tensor.shape)]
        out.append(ViewLayout(name, _dtype_name(v.tensor.dtype), shape, axis))
    return out


def _section_layouts(sections: Mapping[str, torch.Tensor]) -> list[SectionLayout]:
    return [SectionLayout(name, _dtype_name(t.dtype), list(t.shape))
            for name, t in sections.items()]


def _block_shape(v: ViewLayout, rows: int) -> list[int]:
    return [rows if i == v.token_axis else d for i, d in enumerate(v.shape)]


def _rows_nbytes(v, rows: int) -> int:
    t = v.tensor
    return t.numel() // t.shape[v.token_axis] * rows * t.element_size()


def _sections_nbytes(sections: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in dict(sections).values())


def _check_parts(rec: FileRecord, want: list[tuple[str, list[int]]]) -> None:
    """A file's parts are the buffers they go into (dtype, shape), in order, and tile the file
    at 4 KiB-aligned offsets."""
    if len(rec.parts) != len(want):
        raise _Bad("layout", f"{rec.name[:8]}: {len(rec.parts)} parts, not {len(want)}")
    at = 0
    for p, (dtype, shape) in zip(rec.parts, want):
        try:
            p.header.check()
        except CodecError as exc:
            raise _Bad("layout", f"{rec.name[:8]}: {exc}") from None
        if p.header.dtype != dtype or p.header.shape != list(shape) or p.offset != at:
            raise _Bad("layout", f"{rec.name[:8]}: a part of {p.header.dtype} "
                                 f"{p.header.shape} where {dtype} {shape} goes")
        at += round_up(p.header.nbytes)
    if at != rec.file_nbytes:
        raise _Bad("layout", f"{rec.name[:8]}: parts do not tile the file")


def _consistent(m: Manifest) -> bool:
    """The manifest describes one conversation: its blocks tile [0, valid) in steps of the
    grid, its anchors lie on the grid at or below valid, its names are ours."""
    if not 0 < m.valid == len(m.token_ids) or len(m.blocks) != -(-m.valid // m.grid):
        return False
    for k, b in enumerate(m.blocks):
        if (b.start, b.stop) != (k * m.grid, min((k + 1) * m.grid, m.valid)):
            return False
    if any(not 0 < a.stop <= m.valid or a.stop % m.grid for a in m.anchors):
        return False
    if m.end is not None and not 0 < m.end.file.stop <= m.valid:
        return False
    return all(_is_file_name(f.name) for f in m.files())


def _regular(st: os.stat_result) -> bool:
    import stat as _stat
    return _stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _unlink(fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        return False


def _read_small(fd: int, name: str) -> tuple[bytes, float]:
    """A small file of the entry (no symlink followed, a regular file of ours) and its mtime."""
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedEntry(exc.errno, "a symlink", name) from None
        raise
    try:
        st = os.fstat(f)
        if not _regular(st) or st.st_size > MAX_MANIFEST_NBYTES:
            raise RefusedEntry(errno.EINVAL, "not a manifest", name)
        chunks = []
        while True:
            b = os.read(f, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks), st.st_mtime
    finally:
        os.close(f)


