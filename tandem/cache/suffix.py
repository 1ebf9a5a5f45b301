"""The persistent suffix store (spec: "Persistent suffix store"): an append-only log of the token
ids this engine has read and written, kept on disk across restarts, with a suffix array over it
that the lookup drafter reads, so text from an earlier session can be drafted.

Pure logic, no asyncio. The log holds token ids and never text. Each document ends with SEPARATOR,
an id no context token equals, so no match spans two documents. `build_index` sorts a snapshot of
the log and may run on another thread while `add_request` appends on the engine thread: it reads
one (buffer, length, generation) tuple, assigned whole, and a buffer is only ever written past the
length published with it. `swap` installs the result; lookups read whichever index is current.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np
import pydivsufsort
import structlog

log = structlog.get_logger(__name__)

SEPARATOR = 0xFFFFFFFF
_SEPARATOR_KEY = struct.pack(">I", SEPARATOR)
FORMAT = 1
RECENT_REQUESTS = 4  # a request is deduped against the seqs of this many before it
JOIN_NUM_TOKENS = 8  # tokens before the parting point appended again, so join n-grams survive
MAX_SCAN = 64  # SA entries of a match's range scanned for the most recent occurrence
TOKENS_FILE = "tokens.u32"
META_FILE = "meta.json"
LOCK_FILE = "lock"
_REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the tandem package


class SuffixStoreError(Exception):
    pass


class TokenizerMismatch(SuffixStoreError):
    pass


class SuffixIndex:
    """A suffix array over one immutable snapshot of the log, read backwards. A match of the
    context's last n tokens is then a match of the context's reversed tail's first n, and the
    suffixes that share a longer prefix sit together: one binary search for the whole reversed
    tail finds the longest match beside where it lands. The reversed log is kept as big-endian
    bytes, so comparing byte slices orders them as the suffix array does (ids compared as
    unsigned, a suffix that ends first sorts first), one C call a comparison."""

    def __init__(self, tokens: np.ndarray, generation: int):
        backwards = np.ascontiguousarray(tokens[::-1])
        self.keys = backwards.astype(">u4").tobytes()
        self.backwards = np.frombuffer(self.keys, dtype=">u4")  # a view of keys, no second copy
        self.sa = pydivsufsort.divsufsort(backwards) if len(tokens) else np.empty(0, np.int32)
        # Item access on a memoryview returns a Python int, faster than numpy indexing.
        self._sa = memoryview(np.ascontiguousarray(self.sa, dtype=np.int32)).cast("B").cast("i")
        # The SA is sorted by first token: the suffixes that start with id t are the entries
        # [_first[t], _first[t + 1]). A search starts there instead of spanning the array.
        counts = np.bincount(backwards[backwards != SEPARATOR])
        first = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        self._first = memoryview(first).cast("B").cast("q")
        self.num_tokens = len(tokens)
        self.generation = generation

    def _bound(self, pattern: bytes, lo: int, hi: int, upper: bool) -> int:
        """First SA entry in [lo, hi) whose first len(pattern) bytes are >= pattern (> if upper)."""
        keys, sa, width = self.keys, self._sa, len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            start = 4 * sa[mid]
            key = keys[start:start + width]
            if key < pattern or (upper and key == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _common_num_tokens(self, pattern: bytes, entry: int) -> int:
        start = 4 * self._sa[entry]
        key = self.keys[start:start + len(pattern)]
        n = 0
        while 4 * n < len(key) and key[4 * n:4 * n + 4] == pattern[4 * n:4 * n + 4]:
            n += 1
        return n

    def lookup(self, context: Sequence[int], k: int, *, min_ngram: int = 2,
               max_ngram: int = 16) -> list[int]:
        """Up to k tokens that followed the most recent occurrence of the longest suffix of
        context (min_ngram to max_ngram tokens) in the log; [] when none matches, or when no
        token follows any scanned occurrence of the longest match."""
        longest = min(max_ngram, len(context))
        if k <= 0 or self.num_tokens == 0 or longest < min_ngram:
            return []
        tail = context[len(context) - longest:]
        if tail[-1] + 1 >= len(self._first):
            return []
        lo, hi = self._first[tail[-1]], self._first[tail[-1] + 1]
        pattern = struct.pack(f">{longest}I", *tail[::-1])
        at = self._bound(pattern, lo, hi, upper=False)
        # The entries that share most with pattern are the ones on either side of where it lands.
        n = max((self._common_num_tokens(pattern, entry) for entry in (at - 1, at)
                 if lo <= entry < hi), default=0)
        if n < min_ngram:
            return []
        # The entries that start with the n-token match are contiguous around `at`.
        prefix = pattern[:4 * n]
        lo = self._bound(prefix, max(at - MAX_SCAN, lo), at, upper=False)
        hi = self._bound(prefix, at, min(lo + MAX_SCAN, hi), upper=True)
        # An entry r of the backwards log is a match ending at num_tokens - r in the log, followed
        # by backwards[r - 1]: the most recent match is the smallest r that something follows.
        keys, sa = self.keys, self._sa
        r = min((sa[i] for i in range(lo, hi)
                 if sa[i] > 0 and keys[4 * sa[i] - 4:4 * sa[i]] != _SEPARATOR_KEY), default=0)
        if r == 0:
            return []
        start = max(r - k, 0)
        follow = struct.unpack(f">{r - start}I", keys[4 * start:4 * r])[::-1]
        if SEPARATOR in follow:
            follow = follow[:follow.index(SEPARATOR)]
        return list(follow)


class PersistentSuffixStore:
    def __init__(self, directory: Path, *, tokenizer_sha256: str, cap_mb: float = 192,
                 scope: str = "all", readonly: bool = False):
        if scope not in ("all", "outputs"):
            raise ValueError(f"suffix store scope must be 'all' or 'outputs', not {scope!r}")
        self.directory = Path(directory).resolve()
        if (_REPO_ROOT / ".git").exists() and self.directory.is_relative_to(_REPO_ROOT):
            raise SuffixStoreError(f"suffix store {self.directory} is inside the repository "
                                   f"{_REPO_ROOT}; it must live outside it")
        self.tokenizer_sha256 = tokenizer_sha256
        self.cap_nbytes = int(cap_mb * (1 << 20))
        self.scope = scope
        self.readonly = readonly
        self._tokens_path = self.directory / TOKENS_FILE
        self._meta_path = self.directory / META_FILE
        self._recent: deque[np.ndarray] = deque(maxlen=RECENT_REQUESTS)
        self.index: SuffixIndex | None = None
        self.appended_total = 0
        self.deduped_total = 0
        self.readonly_skipped = 0  # requests not appended because the store is read-only
        self.forgotten_total = 0
        self.rebuilds = 0
        self.rebuild_ms_total = 0.0
        self.rebuild_ms_last = 0.0
        if not readonly or self.directory.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)  # explicit: mkdir's mode is masked by the umask
        self._lock = None
        self.busy = False  # another process writes this store: opened read-only instead
        if not readonly:
            self._take_writer_lock()
        tokens = self._open()
        self._log = (tokens, len(tokens), 0)  # buffer, length, generation; assigned whole
        self.documents = int(np.count_nonzero(tokens == SEPARATOR))
        if not self.readonly:
            self._enforce_cap()
        log.info("suffix_store_opened", directory=str(self.directory), tokens=self.num_tokens,
                 documents=self.documents, readonly=self.readonly, scope=scope)

    # -- opening -------------------------------------------------------------------------------

    def _take_writer_lock(self) -> None:
        """One writer a store: two processes appending to one log would interleave documents
        and each keep a log in memory the file no longer is. A second writer (a `tandem
        generate` beside a server on the same home) opens the store read-only instead."""
        lock = open(self.directory / LOCK_FILE, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            self.readonly = self.busy = True
            log.warning("suffix_store_busy", directory=str(self.directory),
                        action="opened read-only")
            return
        self._lock = lock

    def close(self) -> None:
        """Give the writer's lock back (the process's exit does too)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _open(self) -> np.ndarray:
        recorded = self._read_meta()
        if recorded is not None and recorded != self.tokenizer_sha256:
            raise TokenizerMismatch(
                f"suffix store {self.directory} was written with tokenizer {recorded[:12]}, "
                f"this server's is {self.tokenizer_sha256[:12]}")
        if not self.readonly and recorded is None:
            self._write_meta()  # a new store, or one written before the fingerprint existed
        if not self._tokens_path.exists():
            return np.empty(0, np.uint32)
        nbytes = self._tokens_path.stat().st_size
        whole = nbytes // 4
        if nbytes % 4:
            log.warning("suffix_store_torn_tail", directory=str(self.directory), nbytes=nbytes,
                        kept_tokens=whole, readonly=self.readonly)
            if not self.readonly:
                os.truncate(self._tokens_path, 4 * whole)
        tokens = np.fromfile(self._tokens_path, dtype="<u4", count=whole)
        tokens = tokens.astype(np.uint32, copy=False)  # no copy on a little-endian host
        if len(tokens) and tokens[-1] != SEPARATOR:
            # A write cut short mid-document: end it, so the next document cannot join it.
            tokens = np.append(tokens, np.uint32(SEPARATOR))
            if not self.readonly:
                self._append_file(tokens[-1:])
        return tokens

    def _read_meta(self) -> str | None:
        """The recorded tokenizer sha256, or None for a store that has none (new or older)."""
        if not self._meta_path.exists():
            return None
        try:
            meta = json.loads(self._meta_path.read_text())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT}")
            recorded = meta.get("tokenizer_sha256")
            if recorded is not None and not isinstance(recorded, str):
                raise ValueError("tokenizer_sha256 is not a string")
            return recorded
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            if self.readonly:
                raise SuffixStoreError(
                    f"suffix store {self.directory}: {META_FILE} is corrupt ({e})") from e
            log.warning("suffix_store_corrupt_meta", directory=str(self.directory),
                        error=str(e), action="started empty")
            self._tokens_path.unlink(missing_ok=True)
            self._meta_path.unlink(missing_ok=True)
            return None

    def _write_meta(self) -> None:
        meta = {"format": FORMAT, "tokenizer_sha256": self.tokenizer_sha256}
        tmp = self._meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self._meta_path)

    # -- writing -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self._log[1]

    def add_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """Append what this request adds beyond the last four; returns the tokens appended."""
        if self.readonly:
            self.readonly_skipped += 1
            return 0
        ids = list(output_ids) if self.scope != "all" else [*prompt_ids, *output_ids]
        if ids and (min(ids) < 0 or max(ids) >= SEPARATOR):
            # the separator, or an id past any vocabulary (an image's key)
            raise ValueError("a token id the suffix store cannot hold")
        seq = np.array(ids, dtype=np.uint32)  # a copy: it is kept for the next requests
        parted = max((_common_prefix(seq, seen) for seen in self._recent), default=0)
        if parted == len(seq):
            self.deduped_total += len(seq)
            return 0
        start = max(parted - JOIN_NUM_TOKENS, 0)
        doc = np.append(seq[start:], np.uint32(SEPARATOR))
        self._append_file(doc)  # first: a write that fails (OSError) changes nothing here
        self._recent.append(seq)
        buf, n, generation = self._log
        if n + len(doc) > len(buf):
            grown = np.empty(max(2 * len(buf), n + len(doc), 1024), np.uint32)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:n + len(doc)] = doc  # past n: a snapshot being read ends at or before n
        self._log = (buf, n + len(doc), generation + 1)
        self.documents += 1
        self.appended_total += len(doc) - 1
        self.deduped_total += start
        self._enforce_cap()
        return len(doc) - 1

    def _append_file(self, tokens: np.ndarray) -> None:
        with open(self._tokens_path, "ab") as f:
            f.write(tokens.astype("<u4").tobytes())

    def _enforce_cap(self) -> None:
        """Over the cap, forget the oldest half: cut at the first document boundary at or after
        half the log, and rewrite the file atomically (temp file + os.replace)."""
        buf, n, generation = self._log
        if 4 * n <= self.cap_nbytes:
            return
        cut = 0
        while 4 * (n - cut) > self.cap_nbytes:
            half = cut + (n - cut) // 2
            ends = np.flatnonzero(buf[max(half - 1, cut):n] == SEPARATOR)
            cut = max(half - 1, cut) + int(ends[0]) + 1  # the log always ends with a separator
        kept = buf[cut:n].copy()
        tmp = self._tokens_path.with_suffix(".tmp")
        kept.astype("<u4").tofile(tmp)
        os.replace(tmp, self._tokens_path)
        forgotten_docs = int(np.count_nonzero(buf[:cut] == SEPARATOR))
        self._log = (kept, len(kept), generation + 1)
        self.documents -= forgotten_docs
        self.forgotten_total += cut
        log.info("suffix_store_forgot", forgotten_tokens=cut, forgotten_documents=forgotten_docs,
                 kept_tokens=len(kept), cap_nbytes=self.cap_nbytes)

    # -- the index -----------------------------------------------------------------------------

    @property
    def needs_rebuild(self) -> bool:
        _, n, generation = self._log
        return n > 0 if self.index is None else self.index.generation != generation

    def build_index(self) -> SuffixIndex:
        """Sort a snapshot of the log. Seconds at tens of millions of tokens: run it off the
        engine thread, then hand the result to `swap`."""
        buf, n, generation = self._log
        # buf[:n] is never written again (appends go past n, forgetting makes a new buffer), and
        # the index copies it into its own bytes: the snapshot needs no copy of its own.
        return SuffixIndex(buf[:n], generation)

    def swap(self, index: SuffixIndex, build_ms: float = 0.0) -> None:
        """Install ``index`` whole; ``build_ms``: what its build took, as the caller timed it
        (the core reads no clock)."""
        self.index = index
        self.rebuilds += 1
        self.rebuild_ms_last = build_ms
        self.rebuild_ms_total += build_ms
        log.info("suffix_store_indexed", tokens=index.num_tokens, build_ms=round(build_ms, 1))

    def lookup(self, context: Sequence[int], k: int, *, min_ngram: int = 2,
               max_ngram: int = 16) -> list[int]:
        index = self.index  # read once: a swap from another thread replaces it whole
        if index is None:
            return []
        return index.lookup(context, k, min_ngram=min_ngram, max_ngram=max_ngram)

    def statistics(self) -> dict:
        return {"tokens": self.num_tokens, "documents": self.documents,
                "indexed_tokens": self.index.num_tokens if self.index is not None else 0,
                "appended_total": self.appended_total, "deduped_total": self.deduped_total,
                "readonly_skipped": self.readonly_skipped, "forgotten_total": self.forgotten_total,
                "busy": self.busy,
                "rebuilds": self.rebuilds, "rebuild_ms_total": self.rebuild_ms_total,
                "rebuild_ms_last": self.rebuild_ms_last}

    def check_invariants(self) -> None:
        buf, n, _ = self._log
        tokens = buf[:n]
        assert n == 0 or tokens[-1] == SEPARATOR, "the log ends inside a document"
        assert self.documents == int(np.count_nonzero(tokens == SEPARATOR))
        assert self.readonly or 4 * n <= self.cap_nbytes, "the log is over its cap"
        if not self.readonly:
            on_disk = np.fromfile(self._tokens_path, dtype="<u4") if n else np.empty(0, np.uint32)
            assert np.array_equal(on_disk, tokens), "the file and the log in memory differ"


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m
