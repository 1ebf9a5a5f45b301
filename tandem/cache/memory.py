"""The memory policy every cache asks before it copies (spec: "Memory", Budget.LEVELS).

A simple accountant: each level has its own budget, and every copy is reserved at its level
before it is made and released when it is dropped. The memory governor (tandem/cache/governor.py)
puts the three machine limits above these through ``gate``: a reserve within its level's budget
still needs the governor's yes (the total under the ceiling less the slack, making room by
shedding cheaper levels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# Cheapest first: the order in which a governor sheds them.
LEVELS = ("store", "prompt_end", "anchors", "end", "stash", "park", "pin")


@dataclass
class MemoryAccountant:
    budgets: dict[str, int]  # level -> bytes it may hold
    held: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    # (level, nbytes) -> may the machine hold that much more? Called on the thread that
    # reserves (the engine thread), after the level's own budget said yes.
    gate: Callable[[str, int], bool] | None = None

    def __post_init__(self):
        unknown = set(self.budgets) - set(LEVELS)
        if unknown:
            raise ValueError(f"unknown memory levels {sorted(unknown)}; known: {LEVELS}")
        for level in LEVELS:
            self.held.setdefault(level, 0)
            self.refused.setdefault(level, 0)

    def room(self, level: str) -> int:
        return self.budgets.get(level, 0) - self.held[level]

    def reserve(self, level: str, nbytes: int) -> bool:
        """Room for ``nbytes`` more at ``level``, taken now; False (and counted) when none."""
        if nbytes > self.room(level):
            self.refused[level] += 1
            return False
        if self.gate is not None and nbytes and not self.gate(level, nbytes):
            self.refused[level] += 1
            return False
        self.held[level] += nbytes
        return True

    def release(self, level: str, nbytes: int) -> None:
        if nbytes > self.held[level]:
            raise AssertionError(f"release of {nbytes} bytes at {level} holding {self.held[level]}")
        self.held[level] -= nbytes

    def check_invariants(self) -> None:
        for level, nbytes in self.held.items():
            assert 0 <= nbytes <= self.budgets.get(level, 0), (level, nbytes)
