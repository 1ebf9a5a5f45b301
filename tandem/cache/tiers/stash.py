"""The guest stash (spec: "A guest keeps no end anchor"): the resident rows a short unrelated
request writes over, copied before it runs and put back after it. ``sections`` is None when the
end anchor already holds the live state (the stash restores its sections from there)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace

LEVEL = "stash"


@dataclass
class Stashed:
    rows: RowsCopy
    sections: SectionsCopy | None
    token_ids: list[int]
    taint: int | None
    nbytes: int


class Stash:
    def __init__(self, memory: MemoryAccountant, *, guest_max: int, stash_margin: int) -> None:
        self.memory = memory
        self.guest_max = guest_max
        self.stash_margin = stash_margin
        self.stashed: Stashed | None = None
        self.active = False  # a guest runs
        self.start = 0  # the guest's start
        self.namespace: Namespace = SHARED  # of the guest's rows
        self.guests = 0
        self.refused = 0

    def is_guest(self, prompt_len: int, rows_in_place: int) -> bool:
        return prompt_len <= self.guest_max and 4 * prompt_len < rows_in_place

    def stop(self, rows_in_place: int, prompt_len: int, max_tokens: int) -> int:
        """The rows a guest may write over: its prompt and output, and a margin."""
        return min(rows_in_place, prompt_len + max_tokens + 2 * self.stash_margin)

    def begin(self, start: int, namespace: Namespace) -> None:
        self.active = True
        self.start = start
        self.namespace = namespace
        self.guests += 1

    def put(self, stashed: Stashed) -> None:
        """The copy, its bytes reserved by the caller."""
        self.stashed = stashed

    def take_back(self) -> Stashed | None:
        """The guest ends: the stash leaves the tier (its bytes are released)."""
        stashed, self.stashed = self.stashed, None
        self.active = False
        if stashed is not None:
            self.memory.release(LEVEL, stashed.nbytes)
        return stashed

    def drop(self) -> None:
        if self.stashed is not None:
            self.memory.release(LEVEL, self.stashed.nbytes)
            self.stashed = None

    def check_invariants(self) -> None:
        assert self.memory.held[LEVEL] == (self.stashed.nbytes if self.stashed else 0), \
            "stash bytes"
        if self.stashed is None:
            assert not self.active, "a guest runs with no stash"
