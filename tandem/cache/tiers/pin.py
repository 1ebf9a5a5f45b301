"""The pinned head (spec: "A compaction"): the old prompt's rows up to its longest pin line
with those anchors, kept when a compaction replaces the prompt (tandem/cache/keep.py chooses and
takes the copies)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.cache.keep import Pinned
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import Namespace
from tandem.tokens import common_prefix

LEVEL = "pin"


class Pin:
    def __init__(self, memory: MemoryAccountant, *, chunk: int, pin_every: int,
                 pin_max: int) -> None:
        self.memory = memory
        self.chunk = chunk
        self.pin_every, self.pin_max = pin_every, pin_max
        self.pinned: Pinned | None = None
        self.pins = 0
        self.hits = 0

    def offer(self, prompt: Sequence[int], limit: int, namespace: Namespace) -> int:
        pin = self.pinned
        return pin.offer(prompt, limit) if pin is not None and pin.namespace == namespace else 0

    def covers(self, rows: Sequence[int], namespace: Namespace) -> bool:
        """The head pinned is a head of ``rows``, of the same namespace."""
        pin = self.pinned
        return (pin is not None and pin.namespace == namespace
                and common_prefix(pin.token_ids, list(rows)) >= len(pin.token_ids))

    def put(self, pinned: Pinned) -> None:
        self.drop()
        self.pinned = pinned
        self.pins += 1

    def drop(self) -> None:
        if self.pinned is not None:
            self.memory.release(LEVEL, self.pinned.nbytes)
            self.pinned = None

    def check_invariants(self) -> None:
        pin = self.pinned
        assert self.memory.held[LEVEL] == (pin.nbytes if pin else 0), "pin bytes"
        if pin is not None:
            assert pin.rows.start == 0 and pin.rows.stop == len(pin.token_ids), "pin rows"
            for line in pin.anchors:
                assert line % self.chunk == 0 and 0 < line <= len(pin.token_ids), line
