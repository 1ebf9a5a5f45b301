"""The state store: whole snapshots keyed by the tokens that produced them (spec: "State store").

One store serves two uses:

- the prefix cache: a snapshot at the longest ``prefix_chunk`` line of a prefill that fits the
  entry cap (``boundaries`` of them, 0: every line), taken between chunks (``on_chunk``). A request
  that starts with those tokens resumes there, on the grid, bit for bit a cold prefill's;
- the session cache: the conversation's state after its turn (``put_session``). The next turn
  forwards only its new message; decoding wrote those rows, so the resume holds the greedy gate.

Two halves, split where the threads are. ``StoreCore`` is the store itself: the entries, their
index by token hash, the LRU order, the budget at the memory level ``store``, the counters. It is
pure (no engine, no asyncio, no clock) and is owned by the ``store`` actor
(tandem/actors/store.py), which maps messages onto it. ``StateStore`` is the engine thread's
side: it decides what to snapshot, clones and restores the engine's buffers through the adapter
(``cache_state()``, copies.py), and asks the core through a port (the core itself in a test, the
actor's port in the server). A snapshot's room is reserved in the core *before* it is cloned,
evicting the least recently used entries; a put that cannot be made is declined before anything
is cloned. An entry offered to the engine is leased until the engine is done reading it, so no
eviction frees it under a restore. Every hit compares the stored tokens with the prompt element
by element: the hash only picks the bucket, since a collision would answer one request with
another's state.

Every entry belongs to the namespace of the request that wrote it (tandem/cache/namespace.py):
the bucket is picked by (namespace, hash) and the compare checks the namespace too, so a
request is never offered another namespace's snapshot of the very same tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import structlog

from tandem.cache.copies import LentRows, RowsCopy, SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.resident import SequenceEngine
from tandem.tokens import common_prefix

log = structlog.get_logger()

LEVEL = "store"
SAID_MAX = 4096  # conversations whose decline reason was logged, newest kept


def token_hash(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of token ids: a hint that picks a bucket, never an answer."""
    h = hashlib.blake2b(digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass
class StoreEntry:
    key_ids: list[int]  # the tokens of rows [0, n)
    kind: str  # "prefix" or "session"
    sections: SectionsCopy
    rows: RowsCopy | LentRows  # lent by the slot it was taken from while that slot keeps them
    taint: int | None  # the lowest row decoding wrote (session snapshots), None: all prefill
    nbytes: int
    key_hash: int
    namespace: Namespace = SHARED  # of the request whose rows it copied

    @property
    def n(self) -> int:
        return len(self.key_ids)


@dataclass
class StoreStats:
    prefix_puts: int = 0
    session_puts: int = 0
    prefix_hits: int = 0
    session_hits: int = 0
    misses: int = 0
    evictions: int = 0
    declined_big: int = 0
    declined_short: int = 0
    refused: int = 0  # no room after evicting everything (the memory policy said no)
    collisions: int = 0  # a bucket's entry whose tokens differed from the prompt's
    shed: int = 0
    counters: dict = field(default_factory=dict)


class StorePort(Protocol):
    """What the engine thread asks of the store's core: ``StoreCore`` itself, or the store
    actor's port, whose every call is a message to the actor."""

    def offer(self, prompt_ids: list[int],
              namespace: Namespace = SHARED) -> tuple[int, StoreEntry | None]: ...
    def release(self, entry: StoreEntry, hit: bool) -> None: ...
    def holds(self, key_ids: list[int], namespace: Namespace = SHARED) -> bool: ...
    def admit(self, key_ids: list[int], kind: str, nbytes: int,
              namespace: Namespace = SHARED) -> str: ...
    def insert(self, entry: StoreEntry) -> None: ...
    def cancel(self, nbytes: int) -> None: ...
    def decline(self, reason: str, who: str, conversation: str | None, detail: str) -> None: ...
    def shed(self, need_nbytes: int) -> int: ...
    def statistics(self) -> dict: ...
    def check_invariants(self, alone: bool = True) -> None: ...


class StoreCore:
    """The entries and their bookkeeping; every method is one step the actor runs whole."""

    def __init__(self, memory: MemoryAccountant, *, entry_nbytes: int,
                 hash_fn: Callable[[Sequence[int]], int] = token_hash):
        self.memory = memory
        self.reserved = 0  # the rooms admitted and not filled or cancelled yet
        self.entry_nbytes = entry_nbytes
        self.hash_fn = hash_fn
        self._entries: OrderedDict[int, StoreEntry] = OrderedDict()  # id -> entry, LRU first
        # (namespace, hash) -> entries
        self._buckets: dict[tuple[Namespace, int], list[StoreEntry]] = {}
        self._leased: dict[int, int] = {}  # id -> offers the engine has not released
        self._said: OrderedDict[str, None] = OrderedDict()
        self.stats = StoreStats()
        # check_invariants' key hashes: the entries whose hash was checked (id -> entry), and
        # the turn of the one checked again each call
        self._hash_checked: dict[int, StoreEntry] = {}
        self._hash_turn = 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookup ----------------------------------------------------------------------------

    def offer(self, prompt_ids: list[int],
              namespace: Namespace = SHARED) -> tuple[int, StoreEntry | None]:
        """The longest entry of ``namespace`` whose tokens start the prompt with at least one
        token left to forward: (its length, the entry, leased until ``release``), or (0, None),
        a miss."""
        entry, collisions = self._longest(prompt_ids, namespace)
        self.stats.collisions += collisions
        if entry is None:
            self.stats.misses += 1
            return 0, None
        self._leased[id(entry)] = self._leased.get(id(entry), 0) + 1
        return entry.n, entry

    def peek(self, prompt_ids: list[int], namespace: Namespace = SHARED) -> int:
        """Where ``offer`` would resume the prompt (0: nowhere), with nothing leased, counted
        or moved in the LRU order (a peek's)."""
        entry, _ = self._longest(prompt_ids, namespace)
        return 0 if entry is None else entry.n

    def _longest(self, prompt_ids: list[int], namespace: Namespace
                 ) -> tuple[StoreEntry | None, int]:
        """The entry ``offer`` takes (None: a miss), and the hash collisions met on the way."""
        prompt = list(prompt_ids)
        limit = len(prompt) - 1
        collisions = 0
        for n in sorted({e.n for e in self._entries.values()}, reverse=True):
            if n > limit:
                continue
            head = prompt[:n]
            for entry in self._buckets.get((namespace, self.hash_fn(head)), ()):
                if entry.n != n:
                    continue
                # Element by element: the hash is only a hint.
                if entry.namespace == namespace and entry.key_ids == head:
                    return entry, collisions
                collisions += 1
        return None, collisions

    def release(self, entry: StoreEntry, hit: bool) -> None:
        """The engine is done with an offered entry; ``hit``: it restored it."""
        key = id(entry)
        left = self._leased.get(key, 0) - 1
        if left > 0:
            self._leased[key] = left
        else:
            self._leased.pop(key, None)
        if not hit:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
        if entry.kind == "prefix":
            self.stats.prefix_hits += 1
        else:
            self.stats.session_hits += 1

    def holds(self, key_ids: list[int], namespace: Namespace = SHARED) -> bool:
        """Whether an entry of exactly these tokens is held in ``namespace`` (compared element
        by element)."""
        return self._find(list(key_ids), namespace) is not None

    # -- puts ------------------------------------------------------------------------------

    def _find(self, key_ids: list[int], namespace: Namespace) -> StoreEntry | None:
        for entry in self._buckets.get((namespace, self.hash_fn(key_ids)), ()):
            if entry.namespace == namespace and entry.key_ids == key_ids:
                return entry
        return None

    def admit(self, key_ids: list[int], kind: str, nbytes: int,
              namespace: Namespace = SHARED) -> str:
        """Before a snapshot is cloned: "held" when the same tokens are held already (touched),
        "reserved" when room for ``nbytes`` was made (evicting least recently used entries)
        and the caller must now ``insert`` or ``cancel``, "refused" when none can be."""
        same = self._find(key_ids, namespace)
        if same is not None:
            if not (kind == "prefix" and same.kind == "session"):
                self._entries.move_to_end(id(same))
                return "held"
            # The same tokens held as a session's state (decoding wrote it): the prefill's
            # state replaces it, since a resume there is then a cold prefill's bit for bit.
            if id(same) not in self._leased:
                self._drop(same)
        if not self._reserve(nbytes):
            self.stats.refused += 1
            return "refused"
        return "reserved"

    def _reserve(self, nbytes: int) -> bool:
        if nbytes > self.entry_nbytes or nbytes > self.memory.budgets.get(LEVEL, 0):
            return False
        while not self.memory.reserve(LEVEL, nbytes):
            if not self._evict_lru():
                return False
        self.reserved += nbytes
        return True

    def insert(self, entry: StoreEntry) -> None:
        """A snapshot cloned into the room ``admit`` reserved; the store owns it from here."""
        same = self._find(entry.key_ids, entry.namespace)
        if same is not None and id(same) not in self._leased:
            self._drop(same)
        self._entries[id(entry)] = entry
        self.reserved -= entry.nbytes  # the room admit reserved for it
        self._buckets.setdefault((entry.namespace, entry.key_hash), []).append(entry)
        if entry.kind == "prefix":
            self.stats.prefix_puts += 1
        else:
            self.stats.session_puts += 1

    def cancel(self, nbytes: int) -> None:
        """A reservation whose snapshot was not cloned after all."""
        self.reserved -= nbytes
        self.memory.release(LEVEL, nbytes)

    def decline(self, reason: str, who: str, conversation: str | None, detail: str) -> None:
        """A session put declined before anything was cloned: counted, and said once per
        conversation (``who``)."""
        if reason == "big":
            self.stats.declined_big += 1
        else:
            self.stats.declined_short += 1
        if who in self._said:
            return
        self._said[who] = None
        while len(self._said) > SAID_MAX:
            self._said.popitem(last=False)
        log.info("store_put_declined", reason=reason, conversation=conversation, detail=detail)

    # -- giving memory back ----------------------------------------------------------------

    def _drop(self, entry: StoreEntry) -> None:
        del self._entries[id(entry)]
        key = (entry.namespace, entry.key_hash)
        bucket = self._buckets[key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[key]
        self.memory.release(LEVEL, entry.nbytes)

    def _lru_free(self) -> StoreEntry | None:
        """The least recently used entry no restore is reading."""
        for key, entry in self._entries.items():
            if key not in self._leased:
                return entry
        return None

    def _evict_lru(self) -> bool:
        entry = self._lru_free()
        if entry is None:
            return False
        self._drop(entry)
        self.stats.evictions += 1
        return True

    def shed(self, need_nbytes: int) -> int:
        """The governor's call: drop least recently used entries until ``need_nbytes`` are
        freed (or none is left); the bytes freed."""
        freed = 0
        while freed < need_nbytes and (entry := self._lru_free()) is not None:
            freed += entry.nbytes
            self._drop(entry)
            self.stats.shed += 1
        return freed

    def clear(self) -> None:
        while (entry := self._lru_free()) is not None:
            self._drop(entry)

    # -- reporting -------------------------------------------------------------------------

    def statistics(self) -> dict:
        s = self.stats
        return {
            "entries": len(self._entries),
            "prefix_entries": sum(1 for e in self._entries.values() if e.kind == "prefix"),
            "session_entries": sum(1 for e in self._entries.values() if e.kind == "session"),
            "bytes": self.memory.held[LEVEL], "budget_bytes": self.memory.budgets.get(LEVEL, 0),
            "entry_cap_bytes": self.entry_nbytes, "leased": sum(self._leased.values()),
            "prefix_puts": s.prefix_puts, "session_puts": s.session_puts,
            "prefix_hits": s.prefix_hits, "session_hits": s.session_hits, "misses": s.misses,
            "evictions": s.evictions, "declined_big": s.declined_big,
            "declined_short": s.declined_short, "refused": s.refused,
            "collisions": s.collisions, "shed": s.shed,
        }

    def check_invariants(self, alone: bool = True) -> None:
        """``alone``: no other generation runs, so no room reserved for one is unfilled."""
        held = self.memory.held[LEVEL]
        assert self.reserved >= 0, "a room given back twice"
        assert held == sum(e.nbytes for e in self._entries.values()) + self.reserved, \
            "store bytes"
        assert not alone or self.reserved == 0, "a room reserved and never filled"
        assert held <= self.memory.budgets.get(LEVEL, 0), "store over its budget"
        indexed = [e for bucket in self._buckets.values() for e in bucket]
        assert len(indexed) == len(self._entries), "bucket index out of step"
        for key, bucket in self._buckets.items():
            assert all((e.namespace, e.key_hash) == key for e in bucket), "entry in a wrong bucket"
        for entry in self._entries.values():
            assert entry.nbytes <= self.entry_nbytes, "an entry over the cap"
            assert entry.rows.stop == entry.n and entry.rows.start == 0, "rows and key differ"
        # The key hash of each entry put since the last call, and of one more in turn: hashing
        # every entry's key ids each call cost milliseconds of the loop's per request once the
        # store held a few long conversations; a key list changed after its put (an alias of a
        # list that grows) is still found, one entry a call.
        checked = self._hash_checked
        for key in [k for k, e in checked.items() if self._entries.get(k) is not e]:
            del checked[key]
        entries = list(self._entries.values())
        again = entries[self._hash_turn % len(entries)] if entries else None
        self._hash_turn += 1
        for entry in entries:
            if checked.get(id(entry)) is not entry or entry is again:
                assert entry.key_hash == self.hash_fn(entry.key_ids), "entry under a wrong hash"
                checked[id(entry)] = entry
        assert set(self._leased) <= set(self._entries), "a lease on an entry no longer held"


@dataclass(frozen=True)
class SessionPut:
    """A session snapshot to admit: the rows in place as its key, their taint, its bytes."""

    key_ids: list[int]
    taint: int | None
    nbytes: int
    namespace: Namespace = SHARED


class StateStore:
    """The engine thread's side of the store: what to snapshot, the clones and the restores."""

    def __init__(self, engine: SequenceEngine, port: StorePort, *, entry_nbytes: int,
                 boundaries: int = 1, session_trim: bool = False,
                 hash_fn: Callable[[Sequence[int]], int] = token_hash):
        if boundaries < 0:
            raise ValueError("boundaries must be >= 0")
        self.engine = engine
        self.port = port
        self.chunk = engine.prefix_chunk
        self.entry_nbytes = entry_nbytes
        self.boundaries = boundaries
        # Cut a pending verify commit back to the committed tokens before a session put (off:
        # such a put is declined, and the end anchor trims instead).
        self.session_trim = session_trim
        self.hash_fn = hash_fn
        self._planned: set[int] = set()  # grid lines of the running prefill to snapshot
        # The lines the loop admitted before the prefill (the plan's), with the store's
        # verdict: a "reserved" one is cloned and inserted (told) or cancelled (told).
        self._admitted: dict[int, str] = {}
        self._namespace: Namespace = SHARED  # of the running prefill
        # The state's sizes, read once here (on the engine thread): a snapshot's bytes are
        # then known anywhere without touching the engine.
        state = engine.cache_state()
        self._section_nbytes = SectionsCopy.nbytes_of(state)
        self._row_nbytes = RowsCopy.nbytes_of(state, 1)

    def snapshot_nbytes(self, num_tokens: int) -> int:
        return self._section_nbytes + self._row_nbytes * num_tokens

    # -- lookup and restore ----------------------------------------------------------------

    def offer(self, prompt_ids: Sequence[int],
              namespace: Namespace = SHARED) -> tuple[int, StoreEntry | None]:
        """The core's longest entry of ``namespace`` for the prompt, leased: ``restore`` it or
        ``release`` it."""
        return self.port.offer(list(prompt_ids), namespace)

    def release(self, entry: StoreEntry) -> None:
        self.port.release(entry, False)

    def holds(self, key_ids: Sequence[int], namespace: Namespace = SHARED) -> bool:
        return self.port.holds(list(key_ids), namespace)

    def restore(self, entry: StoreEntry, prompt_ids: Sequence[int],
                namespace: Namespace = SHARED) -> int:
        """Write an offered entry back into the engine's buffers and put the engine at its
        length. The tokens and the namespace are compared again here: nothing is restored for
        a prompt they do not start, nor for another namespace's request."""
        n = entry.n
        try:
            if list(prompt_ids[:n]) != entry.key_ids or entry.namespace != namespace:
                raise ValueError("a state store entry restored for a prompt it does not start")
            eng = self.engine
            state = eng.cache_state()
            entry.sections.restore(state)
            entry.rows.restore(state, 0, n)
            eng.resume_at(n, entry.key_ids, taint=entry.taint)
        except BaseException:
            self.port.release(entry, False)
            raise
        self.port.release(entry, True)
        return n

    # -- the prefix cache ------------------------------------------------------------------

    def plan_prefix(self, prompt_ids: Sequence[int], start: int,
                    namespace: Namespace = SHARED) -> list[int]:
        """The grid lines of the prefill from ``start`` to snapshot: the longest ``boundaries``
        lines above ``start`` whose snapshot fits the entry cap (0: every such line), in the
        prefill's ``namespace``."""
        self._namespace = namespace
        lines = [line for line in range((start // self.chunk + 1) * self.chunk,
                                        len(prompt_ids) + 1, self.chunk)
                 if self.snapshot_nbytes(line) <= self.entry_nbytes]
        if self.boundaries:
            lines = lines[-self.boundaries:]
        self._planned = set(lines)
        return sorted(self._planned)

    def admitted(self, lines: dict[int, str], namespace: Namespace = SHARED) -> None:
        """The prefill's prefix lines as the plan brings them, each admitted by the store
        before the prefill (its verdict): at those lines nothing is asked during the prefill."""
        self._namespace = namespace
        self._planned = set()
        self._admitted = dict(lines)

    def on_chunk(self, end: int) -> None:
        """After a prefill chunk: a prefix snapshot at a planned line, only when no row below it
        was written by decoding (taint), so that its resume is a cold prefill's bit for bit."""
        if end in self._admitted:
            verdict = self._admitted.pop(end)
            if verdict != "reserved":
                return
            eng = self.engine
            if eng.taint is not None and eng.taint < end:
                self.port.cancel(self.snapshot_nbytes(end))
                return
            self._clone(list(eng.token_ids[:end]), "prefix", None, self._namespace,
                        self.snapshot_nbytes(end))
            return
        if end not in self._planned:
            return
        self._planned.discard(end)
        eng = self.engine
        if eng.taint is not None and eng.taint < end:
            return
        self._put(list(eng.token_ids[:end]), "prefix", None, self._namespace)

    def end_prefill(self) -> None:
        """The prefill is over (or failed): admitted lines it never reached give their room
        back."""
        for line, verdict in self._admitted.items():
            if verdict == "reserved":
                self.port.cancel(self.snapshot_nbytes(line))
        self._admitted = {}
        self._planned = set()

    # -- the session cache -----------------------------------------------------------------

    def put_session(self, committed_ids: Sequence[int], conversation: str | None,
                    namespace: Namespace = SHARED) -> bool:
        """After a turn: the state of the rows in place, keyed by their tokens, when they are
        the conversation's committed tokens. Declined, before anything is cloned, when the
        engine is ahead of them (declined_short) or the snapshot is over the cap
        (declined_big)."""
        put = self.session_put(committed_ids, conversation, namespace)
        if put is None:
            return False
        return self._put(put.key_ids, "session", put.taint, namespace)

    def session_put(self, committed_ids: Sequence[int], conversation: str | None,
                    namespace: Namespace = SHARED) -> "SessionPut | None":
        """``put_session``'s first half, which asks nothing: the snapshot to admit, or None
        when it is declined (the decline told)."""
        eng = self.engine
        n = eng.length
        if n == 0:
            return None
        committed = list(committed_ids)
        if n > len(committed) or eng.token_ids != committed[:n]:
            # The rows run past the committed tokens (a generation that stopped inside an
            # accepted verify block). session_trim cuts the pending commit back to them;
            # otherwise, or when the state already absorbed them, the put is declined here,
            # before anything is cloned or settled (spec: SRV-253).
            keep = common_prefix(eng.token_ids, committed)
            if not (self.session_trim and keep > 0 and eng.trim_pending(keep)):
                self._decline("short", conversation, committed,
                              f"the engine is {n} rows in, past the {keep} of the "
                              f"{len(committed)} committed tokens it shares")
                return None
            n = eng.length
        nbytes = self.snapshot_nbytes(n)
        if nbytes > self.entry_nbytes:
            self._decline("big", conversation, committed,
                          f"a {n}-token snapshot is {nbytes} bytes, over the entry cap of "
                          f"{self.entry_nbytes}")
            return None
        return SessionPut(list(eng.token_ids), eng.taint, nbytes, namespace)

    def put_admitted(self, put: "SessionPut", verdict: str) -> bool:
        """``put_session``'s second half, the store's verdict asked on the loop: a reserved
        room is filled (the snapshot told to the store). The rows in place must still be
        ``put.key_ids``."""
        if verdict != "reserved":
            return verdict == "held"
        assert self.engine.token_ids == put.key_ids, "the rows moved under a session put"
        self._clone(put.key_ids, "session", put.taint, put.namespace, put.nbytes)
        return True

    def _decline(self, reason: str, conversation: str | None, committed: list[int],
                 detail: str) -> None:
        who = conversation or f"head:{self.hash_fn(committed[:self.chunk]):x}"
        self.port.decline(reason, who, conversation, detail)

    def _put(self, key_ids: list[int], kind: str, taint: int | None,
             namespace: Namespace) -> bool:
        n = len(key_ids)
        nbytes = self.snapshot_nbytes(n)
        verdict = self.port.admit(key_ids, kind, nbytes, namespace)
        if verdict != "reserved":
            return verdict == "held"
        self._clone(key_ids, kind, taint, namespace, nbytes)
        return True

    def _clone(self, key_ids: list[int], kind: str, taint: int | None, namespace: Namespace,
               nbytes: int) -> None:
        """The snapshot of the rows in place as ``key_ids``, into the room the store reserved;
        it moves to the store (inserted)."""
        n = len(key_ids)
        try:
            eng = self.engine
            eng.settle()
            state = eng.cache_state()
            entry = StoreEntry(key_ids=key_ids, kind=kind, sections=SectionsCopy.take(state),
                               rows=LentRows.take(state, 0, n),
                               taint=taint if taint is not None and taint < n else None,
                               nbytes=nbytes, key_hash=self.hash_fn(key_ids),
                               namespace=namespace)
        except BaseException:
            self.port.cancel(nbytes)
            raise
        self.port.insert(entry)

    # -- memory and reporting --------------------------------------------------------------

    def shed(self, need_nbytes: int) -> int:
        return self.port.shed(need_nbytes)

    def statistics(self) -> dict:
        return self.port.statistics()

    def check_invariants(self, alone: bool = True) -> None:
        self.port.check_invariants(alone)
