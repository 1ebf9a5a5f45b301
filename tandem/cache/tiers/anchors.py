"""Grid anchors: the state at grid lines the prefill passed (spec: "Resident prefix").

A copy at line L is the state after rows [0, L) of the rows in place; at or below ``taint`` it
is a cold grid prefill's, bit for bit. Eviction drops the unprotected anchor whose loss costs the
least re-read (the gap to the anchor below it); the newest ``keep_newest`` and the lines a pin
would keep are protected.
"""

from __future__ import annotations

import structlog

from tandem.cache.copies import SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.devices import host_clone
from tandem.models.base import CacheState

log = structlog.get_logger()

LEVEL = "anchors"


class Anchors:
    def __init__(self, memory: MemoryAccountant, *, chunk: int, keep_newest: int,
                 pin_every: int, pin_max: int) -> None:
        self.memory = memory
        self.chunk = chunk
        self.keep_newest = keep_newest
        self.pin_every, self.pin_max = pin_every, pin_max
        self.copies: dict[int, SectionsCopy] = {}
        self.taken = 0
        self.evictions = 0
        self.writing: int | None = None  # the line a copy is being written into

    def __contains__(self, line: int) -> bool:
        return line in self.copies

    def best(self, limit: int) -> int:
        """The highest anchored line at or under ``limit`` (0: none)."""
        return max((line for line in self.copies if line <= limit), default=0)

    def lines(self) -> list[int]:
        return sorted(self.copies)

    def protected(self) -> set[int]:
        newest = sorted(self.copies)[-self.keep_newest:]
        keepers = {line for line in self.copies
                   if line % (self.pin_every * self.chunk) == 0
                   and line <= self.pin_every * self.pin_max * self.chunk}
        return set(newest) | keepers

    def take(self, line: int, state: CacheState) -> None:
        """The state in place as the anchor at ``line``, evicting to make room."""
        if line in self.copies:
            self.writing = line  # a copy cut short is not the state at its line
            self.copies[line].copy_from(state)
            self.writing = None
            return
        nbytes = SectionsCopy.nbytes_of(state)
        while not self.memory.reserve(LEVEL, nbytes):
            if not self.evict_one(protect=line):
                return
        self.copies[line] = SectionsCopy.take(state)
        self.taken += 1

    def add(self, line: int, copy: SectionsCopy, *, clone: bool = False) -> bool:
        """A copy made elsewhere (a pin's or a park's coming back) as the anchor at ``line``,
        when its level has room; the copy (with ``clone``, a clone of it, made only then) is
        then the tier's."""
        if line in self.copies or not self.memory.reserve(LEVEL, copy.nbytes):
            return False
        self.copies[line] = (SectionsCopy({k: host_clone(t) for k, t in copy.tensors.items()})
                             if clone else copy)
        return True

    def evict_one(self, protect: int) -> bool:
        keep = self.protected() | {protect}
        lines = sorted(self.copies)
        candidates = [(line - (lines[i - 1] if i else 0), line)
                      for i, line in enumerate(lines) if line not in keep]
        if not candidates:
            return False
        _, line = min(candidates)
        self.drop(line)
        self.evictions += 1
        return True

    def drop(self, line: int) -> None:
        copy = self.copies.pop(line)
        self.memory.release(LEVEL, copy.nbytes)

    def drop_above(self, line: int) -> None:
        for above in [x for x in self.copies if x > line]:
            self.drop(above)

    def drop_interrupted(self) -> None:
        """After a failure: the copy a failure cut short goes."""
        if self.writing in self.copies:
            self.drop(self.writing)
        self.writing = None

    def shed(self, need_nbytes: int, protect: int = -1) -> None:
        """Give back ``need_nbytes`` of copies, cheapest loss first; the copy at ``protect``
        (a restore's, under way) stays."""
        before = self.memory.held[LEVEL]
        while self.memory.held[LEVEL] > before - need_nbytes:
            if not self.evict_one(protect=protect):
                rest = [line for line in self.copies if line != protect]
                if not rest:
                    break
                self.drop(min(rest))

    def check_invariants(self, rows_in_place: int) -> None:
        for line in self.copies:
            assert line % self.chunk == 0 and 0 < line <= rows_in_place, (line, rows_in_place)
        assert self.memory.held[LEVEL] == sum(c.nbytes for c in self.copies.values()), \
            "anchor bytes"
