"""Copies of a sequence's state taken through the adapter: sections whole, views by rows.

A cache never names a section or a token axis; it iterates ``cache_state()`` (spec: "The caches
know no model"). Copies are plain tensors owned by whichever tier made them, in host memory:
a CPU state's copies are its clones, a device state's are pinned (tandem.devices.host_clone),
so that a restore is one DMA and the copies never take device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.devices import host_clone
from tandem.models.base import CacheState


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
        for name, v in state.views.items():
            src = self.tensors[name].narrow(v.token_axis, start - self.start, stop - start)
            v.rows(start, stop).copy_(src)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    @staticmethod
    def nbytes_of(state: CacheState, num_rows: int) -> int:
        return state.row_nbytes() * num_rows
