"""The head's screen: greedy decode's token without reading the head's fp32 bytes, the same
token the full head's argmax gives.

A decode step on `tiny` reads 271 MB of weights, 254 of them the tied head (248,320 x 256,
fp32): at this machine's read rate the head is most of a token's time. Greedy decoding needs
only the largest logit's index. The screen keeps the head's rows as int8 with a scale a row (a
quarter of the bytes) and, per row, a radius: a bound, per unit of the hidden row's |x|_1, on
how far the row's screened logit can lie from the fp32 logit the native kernels compute for it.
For row n with scale s, int8 row q, largest |weight| m and largest |W[n, k] - s q[k]| e:

    |logit - screened| <= |x|_1 (e + g (m + 127 s)),   g = (2K + 16) 2^-24

the first term the quantisation's error, the second both sums' rounding (each output is at most
K FMAs and a lane tree of 4 additions, every partial sum under |x|_1 m; the screened sum's
terms are under |x|_1 127 s, and its product by s rounds once), with K the row's length. The
radius is that bracket, widened by 2^-10 and rounded up to fp32; the kernel adds a subnormal
margin. csrc/rows.c's tandem_head_argmax_rows_f32 (1 to 4 inputs, the screen read once for
them) screens every row, takes M, the largest lower bound among them, and computes exactly
(the full head's arithmetic for that row, so its very bits) every row whose upper bound
reaches M: the largest logit's rows are always among them, ties included, and the first index
of the largest (or of the first NaN) is the argmax's answer. A row that is not finite has an
infinite radius and is always computed. An input the bound does not cover (not finite, or
large enough that a sum could overflow) gets the full head.

The screen is used only where the logits themselves are not wanted: a greedy position with no
logprobs, no logits processors and no grammar (tandem.engine: DecodeStep.greedy and
VerifyStep.greedy). It costs the head's bytes over four in memory (tiny: 66 MB; the 0.8B-like:
256 MB), built once at load (``engine.head_screen`` turns it off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Rows screened in one step at most. Up to 4 share one read of the screen (csrc/rows.c); more
# would read it again for each 4, where the full head is read once for every row of a step.
ROWS_MAX = 4

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
    q: torch.Tensor       # [N, K] int8
    scale: torch.Tensor   # [N] fp32
    radius: torch.Tensor  # [N] fp32, per unit of |x|_1; inf for a row that is not finite
    wmax: float           # the largest |weight| of the finite rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.radius))


def build(weight: torch.Tensor) -> HeadScreen:
    """The screen of a head [N, K] (fp32, contiguous, on the CPU): its rows quantised by the
    native kernel (csrc/rows.c's tandem_head_screen_rows_f32, each row's error in double), the
    radii from them here."""
    from tandem.kernels.native import function

    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError("the screen takes a contiguous fp32 head [N, K]")
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    m, e = np.empty(n, dtype=np.float64), np.empty(n, dtype=np.float64)
    finite = np.empty(n, dtype=np.uint8)
    function("tandem_head_screen_rows_f32")(
        weight.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), m.ctypes.data, e.ctypes.data,
        finite.ctypes.data, torch.get_num_threads())
    g = (2 * k + 16) * 2.0 ** -24
    radius = (e + g * (m + 127 * scale.numpy().astype(np.float64))) * (1 + 2.0 ** -10)
    radius[finite == 0] = math.inf
    # fp32, rounded up: never under the float64 bound
    r32 = radius.astype(np.float32)
    r32 = np.where(r32.astype(np.float64) < radius, np.nextafter(r32, np.float32(np.inf)), r32)
    wmax = float(m[finite != 0].max()) if finite.any() else 0.0
    return HeadScreen(q, scale, torch.from_numpy(r32.astype(np.float32)),
                      float(np.nextafter(np.float32(wmax), np.float32(np.inf))))


def argmax_rows(xs: torch.Tensor, weight: torch.Tensor, screen: HeadScreen,
                threads: int | None = None) -> tuple[list[int], torch.Tensor, int]:
    """csrc/rows.c's tandem_head_argmax_rows_f32 for 1 to 4 rows xs [R, K] at once over the head
    ``weight`` and its screen, the screen read once for them all (as the native step calls it;
    this is the same call for tests and benchmarks): each row's token (-1 where the screen does
    not take the row), the screened logits [R, N], and how many rows were computed exactly
    over them all."""
    import ctypes

    from tandem.kernels.native import function

    r, (n, k) = xs.shape[0], weight.shape
    if not 1 <= r <= 4:
        raise ValueError("1 to 4 rows at once")
    xs = xs.contiguous()
    ptrs = (ctypes.c_void_p * r)(*(xs[i].data_ptr() for i in range(r)))
    approx = torch.empty(r, n, dtype=torch.float32)
    tokens, exact = (ctypes.c_long * r)(), ctypes.c_long(0)
    function("tandem_head_argmax_rows_f32")(
        ptrs, r, k, weight.data_ptr(), n, screen.q.data_ptr(), screen.scale.data_ptr(),
        screen.radius.data_ptr(), screen.wmax, approx.data_ptr(), tokens, ctypes.byref(exact),
        threads if threads is not None else torch.get_num_threads())
    return list(tokens), approx, int(exact.value)


def argmax(x: torch.Tensor, weight: torch.Tensor, screen: HeadScreen,
           threads: int | None = None) -> tuple[int, torch.Tensor, int]:
    """``argmax_rows`` for one row x [K]: its token, its screened logits [N], the rows computed
    exactly."""
    tokens, approx, exact = argmax_rows(x[None], weight, screen, threads)
    return tokens[0], approx[0], exact
