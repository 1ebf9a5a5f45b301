"""The capture lock's FIFO as a pure class: who holds the engine's device work, and who waits.

The engine's own generations and outside holders (the writers that copy staged rows, the
compaction preparer; a test's `RequestCaptureLock`) queue in arrival order; at most one holds the
lock (the engine's generations as one group holder, which those behind it in line may join
while no outside holder waits ahead of them). The engine actor owns one instance and maps its messages onto it; nothing here knows
asyncio, a clock or the engine, so a test drives it alone and a new kind of holder plugs in
without a change to the engine.

Invariants (`check_invariants`): at most one holder; the holder is not also waiting; nobody
waits twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class CaptureLockMisuse(RuntimeError):
    """A release by someone who does not hold the lock, or a holder queued twice: a protocol
    bug, never a request's fault."""


class CaptureLockFifo(Generic[T]):
    def __init__(self) -> None:
        self._waiting: deque[T] = deque()
        self.holder: T | None = None

    def enqueue(self, item: T) -> None:
        """``item`` waits behind everyone already queued."""
        if item is self.holder or any(w is item for w in self._waiting):
            raise CaptureLockMisuse("a holder is queued twice")
        self._waiting.append(item)

    def withdraw(self, item: T) -> None:
        """``item`` leaves the queue before it got the lock (cancelled, drained)."""
        for i, waiting in enumerate(self._waiting):
            if waiting is item:
                del self._waiting[i]
                return
        raise CaptureLockMisuse("withdrawn without waiting")

    def grant_next(self) -> T | None:
        """The next in line takes the lock if it is free; that one, else None."""
        if self.holder is not None or not self._waiting:
            return None
        self.holder = self._waiting.popleft()
        return self.holder

    def peek(self) -> T | None:
        """The first in line, left there."""
        return self._waiting[0] if self._waiting else None

    def join_holder(self, holder: T) -> T:
        """The first in line leaves the queue to join ``holder``, which holds the lock or takes
        it now (the engine's generations hold it as one group: requests in different slots
        run at once). Returns the one that left."""
        if self.holder is not None and self.holder is not holder:
            raise CaptureLockMisuse("joined a holder that does not hold the lock")
        if not self._waiting:
            raise CaptureLockMisuse("nobody waits to join")
        self.holder = holder
        return self._waiting.popleft()

    def take(self, holder: T) -> None:
        """``holder`` takes the free lock without waiting in line (the engine's generations,
        back after an outside holder they paused for)."""
        if self.holder is not None:
            raise CaptureLockMisuse("taken while held")
        self.holder = holder

    def release(self, item: T) -> None:
        if self.holder is not item:
            raise CaptureLockMisuse("released by one who does not hold it")
        self.holder = None

    def waiting(self) -> Iterator[T]:
        """Those in line, first first (a copy: withdrawing while iterating is safe)."""
        return iter(tuple(self._waiting))

    def clear(self) -> None:
        self._waiting.clear()

    def check_invariants(self) -> None:
        ids = [id(w) for w in self._waiting]
        assert len(ids) == len(set(ids)), "one holder waits twice"
        assert self.holder is None or id(self.holder) not in ids, "the holder is also waiting"
