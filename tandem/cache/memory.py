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
# Who holds each: the resident actor, the park actor, the store actor (one accountant each).
RESIDENT_LEVELS = ("prompt_end", "anchors", "end", "stash")
PARK_LEVELS = ("park", "pin")


def _take_back(held: dict[str, int], level: str, nbytes: int) -> None:
    """``nbytes`` at ``level`` go back; never more than is held there."""
    if nbytes > held[level]:
        raise AssertionError(f"release of {nbytes} bytes at {level} holding {held[level]}")
    held[level] -= nbytes


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
        _take_back(self.held, level, nbytes)

    def part(self, levels: tuple[str, ...]) -> "MemoryAccountant":
        """An accountant of its own for ``levels``, with their budgets: one owner's."""
        return MemoryAccountant({level: self.budgets[level] for level in levels
                                 if level in self.budgets})

    def holding(self) -> dict[str, int]:
        """The bytes held at each level this accountant has a budget for."""
        return {level: self.held[level] for level in self.budgets}

    def check_invariants(self) -> None:
        for level, nbytes in self.held.items():
            assert 0 <= nbytes <= self.budgets.get(level, 0), (level, nbytes)


class Accounts:
    """Several owners' accountants seen as one: each level's reserve, release and room go to
    the accountant whose budgets hold it (the resident's, the park's). ``held`` and
    ``budgets`` are read-only views made at each access; ``gate`` is set on every one."""

    def __init__(self, *accountants: MemoryAccountant) -> None:
        self.accountants = accountants
        self._by_level = {level: a for a in accountants for level in a.budgets}

    def _of(self, level: str) -> MemoryAccountant:
        return self._by_level.get(level, self.accountants[0])

    @property
    def held(self) -> dict[str, int]:
        return {level: a.held[level] for level, a in self._by_level.items()}

    @property
    def budgets(self) -> dict[str, int]:
        return {level: a.budgets[level] for level, a in self._by_level.items()}

    @property
    def gate(self) -> Callable[[str, int], bool] | None:
        return self.accountants[0].gate

    @gate.setter
    def gate(self, gate: Callable[[str, int], bool] | None) -> None:
        for a in self.accountants:
            a.gate = gate

    def room(self, level: str) -> int:
        return self._of(level).room(level)

    def reserve(self, level: str, nbytes: int) -> bool:
        return self._of(level).reserve(level, nbytes)

    def release(self, level: str, nbytes: int) -> None:
        self._of(level).release(level, nbytes)

    def check_invariants(self) -> None:
        for a in self.accountants:
            a.check_invariants()


class Share:
    """One slot's part of an accountant several slots share (tandem/cache/slots.py): reserves
    and releases go to the shared budgets (and its gate), and the part counts its own, so each
    slot's tiers check their bytes exactly and the shared level is the sum of the parts."""

    def __init__(self, shared: MemoryAccountant) -> None:
        self.shared = shared
        self.held = {level: 0 for level in LEVELS}

    @property
    def budgets(self) -> dict[str, int]:
        return self.shared.budgets

    @property
    def refused(self) -> dict[str, int]:
        return self.shared.refused

    @property
    def gate(self) -> Callable[[str, int], bool] | None:
        return self.shared.gate

    @gate.setter
    def gate(self, gate: Callable[[str, int], bool] | None) -> None:
        self.shared.gate = gate

    def room(self, level: str) -> int:
        return self.shared.room(level)

    def reserve(self, level: str, nbytes: int) -> bool:
        if not self.shared.reserve(level, nbytes):
            return False
        self.held[level] += nbytes
        return True

    def release(self, level: str, nbytes: int) -> None:
        _take_back(self.held, level, nbytes)
        self.shared.release(level, nbytes)

    def holding(self) -> dict[str, int]:
        return {level: self.held[level] for level in self.budgets}

    def check_invariants(self) -> None:
        for level, nbytes in self.held.items():
            assert 0 <= nbytes <= self.shared.held[level], (level, nbytes)
        self.shared.check_invariants()


def check_shares(shared: MemoryAccountant, shares: list["Share"]) -> None:
    """The shared levels hold exactly what their parts hold."""
    for level in shared.budgets:
        assert shared.held[level] == sum(s.held[level] for s in shares), level
