"""Copies of a sequence's state taken through the adapter: sections whole, views by rows.

A cache never names a section or a token axis; it iterates ``cache_state()`` (spec: "The caches
know no model"). Copies are plain tensors owned by whichever tier made them, in host memory:
a CPU state's copies are its clones, a device state's are pinned (tandem.devices.host_clone),
so that a restore is one DMA and the copies never take device memory.

``LentRows`` is a ``RowsCopy`` not taken yet: rows ``[0, stop)`` of a live sequence that still
holds them (tandem.models.rows.lend), copied only when the sequence is about to write over them
or give them back. The state store's snapshots lend the rows of the slot they were taken from:
a conversation kept in its slot holds its rows once, not once more for each of its snapshots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.devices import host_clone
from tandem.models.base import CacheState
from tandem.models.rows import LENDING_LOCK, lend, rows_written


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class SectionsCopy:
    """Every section of the state at one position, in the state's order."""

    tensors: dict[str, torch.Tensor]

    @classmethod
    def take(cls, state: CacheState) -> "SectionsCopy":
        return cls({name: host_clone(t) for name, t in state.sections.items()})

    def copy_from(self, state: CacheState) -> None:
        """Refill this copy in place (the end anchor's two buffers, turn after turn)."""
        for name, t in state.sections.items():
            self.tensors[name].copy_(t)

    def restore(self, state: CacheState) -> None:
        for name, t in state.sections.items():
            t.copy_(self.tensors[name])

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    @staticmethod
    def nbytes_of(state: CacheState) -> int:
        return state.section_nbytes()


@dataclass
class RowsCopy:
    """Rows [start, stop) of every view, each along its own token axis."""

    start: int
    stop: int
    tensors: dict[str, torch.Tensor]

    @classmethod
    def take(cls, state: CacheState, start: int, stop: int) -> "RowsCopy":
        return cls(start, stop, {name: host_clone(v.rows(start, stop))
                                 for name, v in state.views.items()})

    def restore(self, state: CacheState, start: int | None = None, stop: int | None = None) -> None:
        """Write rows [start, stop) (default: all held) back in place."""
        start = self.start if start is None else start
        stop = self.stop if stop is None else stop
        if not self.start <= start <= stop <= self.stop:
            raise ValueError(f"rows [{start}, {stop}) outside the copy [{self.start}, {self.stop})")
        rows_written(state.views, start)
        for name, v in state.views.items():
            src = self.tensors[name].narrow(v.token_axis, start - self.start, stop - start)
            v.rows(start, stop).copy_(src)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    @staticmethod
    def nbytes_of(state: CacheState, num_rows: int) -> int:
        return state.row_nbytes() * num_rows


# Tests set it (tests/conftest.py): every lend also takes a witness copy, and every read of the
# lent rows and every copy taken from them checks that they still hold the witness's bits, so
# the whole suite proves that each path writing a sequence's rows calls ``rows_written``.
CHECK_LENT = os.environ.get("TANDEM_CHECK_LENT") == "1"


class LentRowsChanged(AssertionError):
    """Lent rows were written over without ``rows_written`` (a missing hook)."""


class LentRows:
    """Rows ``[0, stop)`` of a live sequence, read in place until it writes over them; then a
    copy of them taken just before (``take_copies``, from ``rows_written``). Restored as a
    ``RowsCopy`` is: into the sequence that lent them it writes nothing (they are in place).

    The borrowers of one sequence that copy at one write (a conversation's snapshots, turn
    after turn, when it leaves its slot) copy each row once: the copy is cut into segments at
    their stops, ``[0, s1)``, ``[s1, s2)``, ..., and a borrower holds the segments below its
    stop. What the copies hold is then the longest living borrower's rows, never more than the
    sum the store counts for them, and a segment goes with the last borrower that holds it."""

    start = 0

    def __init__(self, state: CacheState, stop: int):
        self.stop = stop
        self._views = state.views
        self._row_nbytes = state.row_nbytes()
        self._copy: tuple[RowsCopy, ...] | None = None  # its segments, once copied
        self._witness = RowsCopy.take(state, 0, stop) if CHECK_LENT else None
        lend(state.views, self)

    @classmethod
    def take(cls, state: CacheState, start: int, stop: int) -> "LentRows":
        if start != 0:
            raise ValueError("rows are lent from row 0")
        return cls(state, stop)

    @property
    def lent(self) -> bool:
        return self._copy is None

    @property
    def nbytes(self) -> int:
        return self._row_nbytes * self.stop

    def lends_to(self, state: CacheState) -> bool:
        """Whether ``state`` is the sequence these rows are still read from."""
        return self._copy is None and state.views is self._views

    def _check(self) -> None:
        if self._witness is None:
            return
        for name, v in self._views.items():
            if not torch.equal(v.rows(0, self.stop), self._witness.tensors[name]):
                raise LentRowsChanged(f"rows of view {name!r} below {self.stop} were written "
                                      "over while lent")

    @classmethod
    def take_copies(cls, group: "list[LentRows]") -> None:
        """Copy the rows of borrowers of one sequence now, before it writes over them
        (``rows_written``, under the lending lock): each row once, in segments cut at their
        stops."""
        with LENDING_LOCK:
            group = sorted((b for b in group if b._copy is None), key=lambda b: b.stop)
            segments: list[RowsCopy] = []
            below = 0
            for b in group:
                b._check()
                if b.stop > below:
                    segments.append(RowsCopy(below, b.stop, {
                        name: host_clone(v.rows(below, b.stop)) for name, v in b._views.items()}))
                    below = b.stop
                b._copy = tuple(segments)
                b._witness = None

    def restore(self, state: CacheState, start: int | None = None, stop: int | None = None) -> None:
        """Write rows [start, stop) (default: all held) into ``state``, as ``RowsCopy.restore``."""
        start = 0 if start is None else start
        stop = self.stop if stop is None else stop
        if not 0 <= start <= stop <= self.stop:
            raise ValueError(f"rows [{start}, {stop}) outside the lent [0, {self.stop})")
        if self.lends_to(state):
            self._check()  # the rows are in place, as lent: nothing to write
            return
        rows_written(state.views, start)  # the target's own borrowers copy first
        with LENDING_LOCK:
            if self._copy is not None:
                for segment in self._copy:
                    a, b = max(start, segment.start), min(stop, segment.stop)
                    if a < b:
                        segment.restore(state, a, b)
                return
            self._check()
            for name, v in state.views.items():
                v.rows(start, stop).copy_(self._views[name].rows(start, stop))
