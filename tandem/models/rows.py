"""Rows backed as they are written, and given back to the OS: the pages of every view above a row.

A model allocates its views for the whole window with ``empty_rows``: a fresh anonymous mapping
on a CPU, so a page is backed only once a forward writes a row in it (``torch.empty`` may hand
back heap pages an earlier tensor already touched, and ``torch.zeros`` touches every page). ``release_rows(state, start)`` hands back the
pages that hold only rows at or above ``start`` (``madvise(MADV_DONTNEED)``), so a sequence cut
back to ``start`` (a slot whose conversation left) holds the rows it keeps and no more. The rows
above ``start`` read as zeros afterwards; no reader sees them before a forward writes them again
(the engine reads rows under its length only), and the writes back them again page by page.

Each view is released along its token axis: for a contiguous CPU tensor, rows ``[start,
window)`` of each index of the axes before the token axis are one contiguous byte range, whose
whole pages are released; the page that also holds row ``start - 1`` stays. A view that is not
contiguous, not on a CPU, or on a platform without ``madvise`` is left as it is, and the result
says which and why.

Rows may also be *lent* (``lend``): a cache entry that would copy rows ``[0, stop)`` of a live
sequence refers to them instead, while the sequence keeps them as they are. Every write of a
sequence's rows at or above some row first calls ``rows_written(views, start)``, which has each
borrower of rows above ``start`` take its copy then, from the rows still intact: the engine
when its length goes back (a forward writes at the length and above), every restore into a
sequence, the park's swaps and ``release_rows``. A borrower thus holds the very bits it would
have copied when lent, and the machine holds them once while the sequence keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch

from tandem.models.base import ModelState, View

MADV_DONTNEED = 4  # Linux: private anonymous pages read as zeros after it, backed on next write
PAGE = mmap.PAGESIZE


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised tensor whose pages no one has touched: on a Linux CPU a private
    anonymous mapping of its own (page-aligned, read as zeros until written, its pages backed
    one by one as they are written), which the tensor keeps alive; elsewhere ``torch.empty``."""
    device = torch.device(device or "cpu")
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if device.type != "cpu" or _MADVISE is None or nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


@dataclass(frozen=True)
class Released:
    """What ``release_rows`` handed back."""

    nbytes: int  # bytes of whole pages released, over every view
    skipped: dict[str, str] = field(default_factory=dict)  # view name -> why it was kept


def why_not_releasable(view: View) -> str | None:
    """Why ``release_rows`` would keep this view's pages, or None when it can release them."""
    t = view.tensor
    if _MADVISE is None:
        return f"no madvise on {sys.platform}"
    if t.device.type != "cpu":
        return f"a {t.device.type} tensor (its allocator owns the pages)"
    if not t.is_contiguous():
        return "not contiguous along its token axis"
    return None


def view_ranges(view: View, start: int) -> list[tuple[int, int]]:
    """The page-aligned byte ranges ``[lo, hi)`` (addresses) that hold only rows >= start."""
    t = view.tensor
    axis = view.token_axis
    window = t.shape[axis]
    start = max(0, start)
    if start >= window or t.numel() == 0:
        return []
    outer = math.prod(t.shape[:axis])
    row = math.prod(t.shape[axis + 1:]) * t.element_size()
    base = t.data_ptr()
    ranges = []
    for o in range(outer):
        lo = base + (o * window + start) * row
        hi = base + (o + 1) * window * row
        lo = -(-lo // PAGE) * PAGE  # the page holding row start - 1 stays
        hi = hi // PAGE * PAGE  # the page shared with the next plane (or the next block) stays
        if hi > lo:
            ranges.append((lo, hi))
    return ranges


def release_rows(state: ModelState, start: int) -> Released:
    """Give back the pages of every view that hold only rows at or above ``start``."""
    rows_written(state.views, start)
    nbytes = 0
    skipped: dict[str, str] = {}
    for name, view in state.views.items():
        why = why_not_releasable(view)
        if why is not None:
            skipped[name] = why
            continue
        for lo, hi in view_ranges(view, start):
            if _MADVISE(lo, hi - lo, MADV_DONTNEED) != 0:
                err = ctypes.get_errno()
                skipped[name] = f"madvise failed: errno {err}"
                break
            nbytes += hi - lo
    return Released(nbytes=nbytes, skipped=skipped)


def resident_nbytes(tensor: torch.Tensor) -> int | None:
    """Bytes of the tensor's pages backed in RAM (mincore), None where it cannot be told; for
    the tests and benchmarks, which hold a view's resident size to its written rows."""
    if _MADVISE is None or tensor.device.type != "cpu":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lo = tensor.data_ptr() // PAGE * PAGE
    hi = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE) * PAGE
    pages = (hi - lo) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(lo), hi - lo, vec) != 0:
        return None
    return sum(b & 1 for b in vec) * PAGE


# -- rows lent to a cache ------------------------------------------------------------------------

class Borrower(Protocol):
    """What borrows rows ``[0, stop)`` of a sequence (tandem.cache.copies.LentRows)."""

    stop: int

    @property
    def lent(self) -> bool: ...  # still reading the sequence's rows (no copy of its own yet)

    @property
    def nbytes(self) -> int: ...

    @classmethod
    def take_copies(cls, group: list) -> None: ...  # copy them now, from the intact rows


# The lock every borrower's read of a sequence's rows and every ``rows_written`` hold: a
# restore on the spill writer's thread may write a slot's rows while the engine thread reads a
# borrower's rows from that slot; the borrower copies first, then the write goes on.
LENDING_LOCK = threading.RLock()
_LENT: dict[int, list] = {}  # id(views dict) -> [weakref to a Borrower], oldest first


def lend(views: Mapping[str, View], borrower: Borrower) -> None:
    """Register ``borrower`` as reading rows ``[0, borrower.stop)`` of the sequence whose views
    these are (the dict a ``ModelState`` and its ``CacheState`` share); it keeps ``views``
    alive itself, so the key is not reused while it lives."""
    with LENDING_LOCK:
        live = [r for r in _LENT.get(id(views), ()) if (b := r()) is not None and b.lent]
        live.append(weakref.ref(borrower))
        _LENT[id(views)] = live


def rows_written(views: Mapping[str, View], start: int) -> None:
    """Rows at or above ``start`` of this sequence are about to be written (or given back):
    every live borrower of rows above ``start`` takes its copy first."""
    key = id(views)
    if key not in _LENT:  # unlocked peek: only the engine's threads lend or write rows
        return
    with LENDING_LOCK:
        keep, copy = [], []
        for ref in _LENT.get(key, ()):
            b = ref()
            if b is None or not b.lent:
                continue
            if b.stop > start:
                copy.append(b)
            else:
                keep.append(ref)
        if copy:
            # one sequence's rows, each copied once; should it raise, the write does not
            # happen and every borrower not copied yet stays registered
            type(copy[0]).take_copies(copy)
        if keep:
            _LENT[key] = keep
        else:
            _LENT.pop(key, None)


def lent_nbytes() -> int:
    """Bytes borrowers would copy were every sequence's rows written now: what the caches count
    and do not hold yet (the memory governor adds them to what it measures)."""
    with LENDING_LOCK:
        return sum(b.nbytes for refs in _LENT.values() for r in refs
                   if (b := r()) is not None and b.lent)
