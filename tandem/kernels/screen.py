"""The head's screen: greedy decode's token without reading the head's fp32 bytes, the same
token the full head's argmax gives.

A decode step on `tiny` reads 271 MB of weights, 254 of them the tied head (248,320 x 256,
fp32): at this machine's read rate the head is most of a token's time. Greedy decoding needs
only the largest logit's index. The screen keeps the head's rows as int8 with a scale a row (a
quarter of the bytes) and, per row, two radii bounding how far the row's screened logit can lie
from the fp32 logit the native kernels compute for it.

The screened logit of row n (scale s, int8 row q) for an input x is s (t S): the input is
quantised to int16, xq = round(x / t) with t = max|x| / X (csrc/rows.c; |xq| <= X, small
enough that S = sum_k q[k] xq[k] is an exact int32 sum), d = max_k |x[k] - t xq[k]| its
error. With m the row's largest |weight|, e its largest |W[n, k] - s q[k]| and Q1 = sum_k
|q[k]|:

    sum_k W x - s t S = sum_k (W - s q) x + s sum_k q (x - t xq)   so within  e |x|_1 + s Q1 d;
    the fp32 logit lies within g m |x|_1 of sum_k W x   (g = (2K + 16) 2^-24: at most K FMAs
        and a lane tree of 4 additions, every partial sum under m |x|_1);
    s (t S) in float lies within 4 2^-24 127 s (|x|_1 + K d) of s t S   (three roundings of
        a value under 127 s sum_k |t xq[k]|),

so |logit - screened| <= |x|_1 radius[n] + d rq[n], with

    radius = e + g m + 4 2^-24 127 s,   rq = s (Q1 + 4 2^-24 127 K),

each widened by 2^-10 and rounded up to fp32; the kernel adds a subnormal margin.
csrc/rows.c's tandem_head_argmax_rows_f32 (1 to 4 inputs, the screen read once for them)
screens every row in integer sums (vpmaddwd: 16 products a uop, twice the fp32 FMA's lanes,
which matters when 4 inputs share the read), takes M, the largest lower bound among them, and
computes exactly (the full head's arithmetic for that row, so its very bits) every row whose
upper bound reaches M: the largest logit's rows are always among them, ties included, and the
first index of the largest (or of the first NaN) is the argmax's answer. A row that is not
finite has an infinite radius and is always computed. An input the bound does not cover (not
finite, or large enough that a sum could overflow) gets the full head.

The screen is used only where the logits themselves are not wanted: a greedy position with no
logprobs, no logits processors and no grammar (tandem.engine: DecodeStep.greedy and
VerifyStep.greedy, and the prompt's last position, whose prefill leaves a HeadRow: its logits
computed only when read). It costs the head's bytes over four in memory (tiny: 66 MB; the
0.8B-like: 256 MB), built once at load (``engine.head_screen`` turns it off).
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Rows one screen call takes: up to 4 share one read of the screen (csrc/rows.c).
ROWS_MAX = 4
# Rows a step screens at most, in calls of ROWS_MAX (csrc/step.c's head), each reading the
# screen once. Since the screen's rows are packed (BLOCK), four rows cost a read of a quarter of
# the head's bytes and little more, so even eight such reads beat the fp32 head's one, which
# does 8-lane fp32 FMAs for every row. forward_batch at 12, 16, 24 and 32 greedy rows, in one
# process, alternated: tiny 20.5, 26.3, 34.5 and 43.3 ms screened against 38.9, 45.3, 47.8 and
# 72.9 with the full head; the 0.8B-like 283, 427, 473 and 622 against 337, 501, 583 and 734.
# Past it the full head is read.
STEP_ROWS_MAX = 32

# Rows a block of the packed screen (csrc/rows.c's SCREEN_BLOCK): in a block the columns go in
# pairs, each pair's BLOCK rows with their two weights side by side, so that one vpmaddwd by an
# input's pair gives 8 rows' sums in 8 lanes (no horizontal sum a row) and an input's pair is
# read once for 16 rows.
BLOCK = 16


def unpack(q: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The packed rows ``q`` of a screen as [n, k] int8, row after row (for tests)."""
    return q.permute(0, 2, 1, 3).reshape(-1, q.shape[1] * 2)[:n, :k]


_enabled = True


def set_enabled(on: bool) -> None:
    """Whether a model on the native step builds its head's screen (the ``head_screen`` knob;
    off, greedy decode reads the whole head as before: the same tokens)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@dataclass
class HeadScreen:
    q: torch.Tensor       # int8 rows packed [N / BLOCK, K / 2, BLOCK, 2] (``unpack``)
    scale: torch.Tensor   # [N] fp32
    radius: torch.Tensor  # [N] fp32, per unit of |x|_1; inf for a row that is not finite
    rq: torch.Tensor      # [N] fp32, per unit of the input's int16 error d
    wmax: float           # the largest |weight| of the finite rows
    file: "RowsFile | None" = None  # where the exact pass reads the head's rows (None: mapping)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.scale, self.radius, self.rq))


class Screened(NamedTuple):
    tokens: list[int]     # each row's token, -1 where the screen does not take the row
    approx: torch.Tensor  # the screened logits [R, N]
    exact: int            # rows computed exactly, over every input
    xerr: list[float]     # each input's int16 error d (0 where not taken)


class _FileC(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_long), ("offset", ctypes.c_long)]  # csrc/kernels.h head_file


class RowsFile:
    """A weight matrix [N, K] (fp32, the file's mapping) as rows its file holds: its open file
    and the offset of its bytes, for reads that map none of its pages (pread copies from the
    page cache; a load through the mapping maps the touched page's whole folio, which the
    kernel makes up to megabytes, so a few rows a token map the whole head within a hundred
    tokens). The screen's build, its exact pass and the embedding lookup read through it; the
    bytes are the mapping's, so every result has the same bits.

    ``open`` checks the extent's length and the first and last rows against the mapping (a
    page each) and gives None where they differ or the file cannot be read: then the mapping
    is read as before."""

    def __init__(self, fd: int, offset: int, rows: int, row_bytes: int):
        self.fd, self.offset, self.rows, self.row_bytes = fd, offset, rows, row_bytes
        self.c = _FileC(fd, offset)
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, extent, weight: torch.Tensor) -> "RowsFile | None":
        if extent is None or weight.dtype != torch.float32 or weight.dim() != 2 \
                or not weight.is_contiguous() or weight.device.type != "cpu" \
                or extent.nbytes != weight.numel() * 4 or weight.shape[0] == 0:
            return None
        try:
            fd = os.open(extent.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        n, k = weight.shape
        f = cls(fd, extent.offset, n, 4 * k)
        for j in (0, n - 1):
            row = torch.empty(k, dtype=torch.float32)
            if not f.read_into(row.numpy(), j) or not torch.equal(row, weight[j]):
                f.close()
                return None
        return f

    def read_into(self, out: np.ndarray, first: int) -> bool:
        """Rows first.. (as many as ``out`` holds, contiguous) from the file: False where the
        read falls short."""
        view, got = memoryview(out).cast("B"), 0
        at = self.offset + first * self.row_bytes
        try:
            while got < len(view):
                r = os.preadv(self.fd, [view[got:]], at + got)
                if r <= 0:
                    return False
                got += r
        except OSError:
            return False
        return True

    def gather(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` (int64) [n, K] by pread (csrc/rows.c's tandem_gather_rows_fd); None
        where an id is not a row or a read fell short."""
        from tandem.kernels.native import function, held

        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.to(torch.long).contiguous()
        n = ids.numel()
        out = torch.empty(n, self.row_bytes // 4, dtype=torch.float32)
        # a decode step's few rows (microseconds) keep the GIL; a prompt's let go of it
        fn = (held if n <= HELD_ROWS else function)("tandem_gather_rows_fd")
        if fn(self.fd, self.offset, self.row_bytes, self.rows, ids.data_ptr(), n,
              out.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return out

    def close(self) -> None:
        self._close()


def _up(v: np.ndarray) -> torch.Tensor:
    """float64 values as fp32, rounded up: never under them."""
    r32 = v.astype(np.float32)
    r32 = np.where(r32.astype(np.float64) < v, np.nextafter(r32, np.float32(np.inf)), r32)
    return torch.from_numpy(r32.astype(np.float32))


# Rows a gather reads keeping the GIL (RowsFile.gather): a decode step's, not a prompt's.
HELD_ROWS = 64

# Rows of the head one read of its file takes while the screen is built from the file.
BUILD_CHUNK_BYTES = 2 << 20


def build(weight: torch.Tensor, file: RowsFile | None = None) -> HeadScreen:
    """The screen of a head [N, K] (fp32, contiguous, on the CPU): its rows quantised by the
    native kernel (csrc/rows.c's tandem_head_screen_rows_f32, each row's error in double), the
    radii from them here.

    ``file`` (RowsFile.open's, where the head is its file's mapping): the rows are read from
    the file a chunk at a time into one buffer rather than through the mapping, and the exact
    pass reads its few rows from it too, so greedy decode maps none of the head's pages: the
    process keeps a quarter of the head's bytes resident rather than five quarters (tiny:
    254 MB it does not hold; the 0.8B-like: 1 GB). A read that falls short reads the mapping."""
    from tandem.kernels.native import function

    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError("the screen takes a contiguous fp32 head [N, K]")
    n, k = weight.shape
    q = torch.zeros(-(-n // BLOCK), (k + 1) // 2, BLOCK, 2, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    m, e, q1 = (np.empty(n, dtype=np.float64) for _ in range(3))
    finite = np.empty(n, dtype=np.uint8)
    rows_f32 = function("tandem_head_screen_rows_f32")
    threads = torch.get_num_threads()

    def quantise(ptr: int, lo: int, hi: int) -> None:
        rows_f32(ptr, hi - lo, k, q.data_ptr(), scale.data_ptr() + 4 * lo,
                 m.ctypes.data + 8 * lo, e.ctypes.data + 8 * lo, q1.ctypes.data + 8 * lo,
                 finite.ctypes.data + lo, lo, threads)

    if file is not None and (file.rows, file.row_bytes) != (n, 4 * k):
        raise ValueError("the rows' file is not this head's")
    chunk = max(1, BUILD_CHUNK_BYTES // (4 * k * BLOCK)) * BLOCK  # whole blocks a read
    buf = np.empty(min(chunk, n) * k, dtype=np.float32) if file is not None else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        if buf is not None and file.read_into(buf[:(hi - lo) * k], lo):
            quantise(buf.ctypes.data, lo, hi)
        else:
            quantise(weight.data_ptr() + lo * k * 4, lo, hi)
    g, u = (2 * k + 16) * 2.0 ** -24, 4 * 2.0 ** -24 * 127
    s = scale.numpy().astype(np.float64)
    radius = (e + g * m + u * s) * (1 + 2.0 ** -10)
    radius[finite == 0] = math.inf
    rq = s * (q1 + u * k) * (1 + 2.0 ** -10)
    wmax = float(m[finite != 0].max()) if finite.any() else 0.0
    return HeadScreen(q, scale, _up(radius), _up(rq),
                      float(np.nextafter(np.float32(wmax), np.float32(np.inf))), file)


def argmax_rows(xs: torch.Tensor, weight: torch.Tensor, screen: HeadScreen,
                threads: int | None = None, approx: torch.Tensor | None = None) -> Screened:
    """csrc/rows.c's tandem_head_argmax_rows_f32 for 1 to 4 rows xs [R, K] at once over the head
    ``weight`` and its screen, the screen read once for them all (as the native step calls it;
    this is the same call for tests and benchmarks). ``approx``: scratch for the screened
    logits, at least [R, N] fp32 contiguous (allocated here without it)."""
    from tandem.kernels.native import function

    r, (n, k) = xs.shape[0], weight.shape
    if not 1 <= r <= 4:
        raise ValueError("1 to 4 rows at once")
    xs = xs.contiguous()
    ptrs = (ctypes.c_void_p * r)(*(xs[i].data_ptr() for i in range(r)))
    if approx is None:
        approx = torch.empty(r, n, dtype=torch.float32)
    elif approx.dtype != torch.float32 or not approx.is_contiguous() or approx.numel() < r * n:
        raise ValueError("approx: [R, N] fp32 contiguous")
    approx = approx.view(-1)[:r * n].view(r, n)
    tokens, exact, xerr = (ctypes.c_long * r)(), ctypes.c_long(0), (ctypes.c_double * r)()
    function("tandem_head_argmax_rows_f32")(
        ptrs, r, k, weight.data_ptr(), n, screen.q.data_ptr(), screen.scale.data_ptr(),
        screen.radius.data_ptr(), screen.rq.data_ptr(), screen.wmax, approx.data_ptr(), tokens,
        ctypes.byref(exact), xerr, threads if threads is not None else torch.get_num_threads(),
        ctypes.byref(screen.file.c) if screen.file is not None else None)
    return Screened(list(tokens), approx, int(exact.value), list(xerr))


def argmax(x: torch.Tensor, weight: torch.Tensor, screen: HeadScreen,
           threads: int | None = None) -> tuple[int, torch.Tensor, int, float]:
    """``argmax_rows`` for one row x [K]: its token, its screened logits [N], the rows computed
    exactly, its int16 error."""
    out = argmax_rows(x[None], weight, screen, threads)
    return out.tokens[0], out.approx[0], out.exact, out.xerr[0]
