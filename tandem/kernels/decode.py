"""Decode's kernels for a batch of B sequences, one row a sequence, each row's bits its own.

A batched decode step runs every projection as one matmul over its B rows so that the weights are
read once a step. A sequence's logits must then be the same bits alone and in any batch at any
place (issue 14, part 3), so the matmul must give a row the same sums whatever the other rows and
however many. Measured with torch 2.13's CPU build (MKL 2024.2) on 2 threads, fp32 and bf16
(tests/kernels/test_decode_rows.py holds it on tiny's, a 0.8B-like model's and the small test
models' shapes):

- ``F.linear`` at M = 1 is a GEMV whose sums round otherwise than at any M >= 2;
- which M share bits depends on the shape: M = 2..9 on every shape with K >= 256, but only
  M = 2 at K = 64 (hidden 64) and M = 2..5 at K = 128; ``torch.mm(W, X^T)`` is one class for
  M = 2..33 at large N but not at N = 8 or 64, and reads at half F.linear's rate at M = 2;
- at a FIXED M (2, 3, 4, 6, 8, 16 tried) ``F.linear`` gives a row the same bits at every place
  of the call, whatever the other rows, on every shape tried (K 24 to 3,584, N 8 to 248,320);
- ``F.linear`` reads the weights at M = 2 as fast as the GEMV at M = 1 or faster (quiet, 2
  threads: 30.8 against 31.6 GB/s on a 248k x 1,024 head, 34.4 against 33.6 on tiny's
  248k x 256, 58 at hidden 1,024 in cache, 1.3-1.4x on tiny's small layers), at M = 3 about
  10 % slower on a head (28.6, 30.1) and at M = 4 half (15.4, 17.0).

So on torch's path every call runs at exactly TORCH_BLOCK = 2 rows: a lone row is padded (a
copy of itself, its result dropped), more go in pairs, an odd last row taking its predecessor
again (the same bits twice). One sequence's decode runs this very path at B = 1, so alone and
batched are the same bits; a step reads the weights ceil(B / 2) times, each at the GEMV's rate:
B = 2 and 4 decode 2x one sequence's tokens a second. HybridModel.forward_batch carries a lone
sequence's pad row itself, from the embedding on, so that its calls take their two rows as they
are.

Where tandem.kernels.native builds (fp32 on an x86-64 CPU with AVX-512, or AVX2 with FMA, and
a C compiler), decode's fp32 matmuls run on it instead: each output's arithmetic is fixed by
construction, so one call takes any number of rows, the weights are read once a step for the
whole batch, and a lone sequence needs no pad (``block()`` is 1). B = 4 then decodes 3.4x to
3.6x one sequence's tokens a second on `tiny` (``scripts/bench_decode.py``), against 2.0x on
torch's path.

A lone token's step on `tiny` spends more in per-call overhead (about 1 us a torch call, some
600 calls) than in its layers' weights, so these kernels and the model's step take the fewest
calls that give the same bits: torch.mm on a weight transposed once (F.linear is that mm four
dispatch layers down), views made once a batch, rows stacked rather than zeroed and copied.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tandem.kernels import reference
from tandem.kernels.native import fits as native_fits
from tandem.kernels.native import function as native_function
from tandem.kernels.native import rows_f32 as native_rows

TORCH_BLOCK = 2  # the rows of every torch decode matmul: the most read at the GEMV's rate

# Where the native kernel runs (tandem.kernels.native: fp32 on an AVX-512 or AVX2 CPU with a
# compiler), every row's bits are its own at any number of rows and the weights are read once a
# step for the whole batch: no pad row, no pairs. _native is None until the first call decides.
_native: bool | None = None


def set_native(on: bool) -> bool:
    """Decode's fp32 CPU matmuls, and a prefill's GDN middle (GdnLayer.prefill), on the native
    kernel (where it builds) or on torch's path, for this process; returns whether the native
    kernel is now in use. The two round differently: set it before a model runs, never between
    the steps or the chunks a test compares."""
    global _native
    from tandem.kernels import native

    _native = on and native.available()
    return _native


def _on() -> bool:
    """Whether decode runs on the native kernels (decided on first use, on by default)."""
    return set_native(True) if _native is None else _native


def block() -> int:
    """The rows a lone sequence's step carries (forward_batch's pad): 1 on the native kernel."""
    return 1 if _on() else TORCH_BLOCK


def rows_linear(x: torch.Tensor, weight: torch.Tensor,
                weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for x [B, K], weight [N, K]: [B, N], row b's bits a function of x[b].
    On the native kernel one call for any B; on torch's path ``weight_t``, ``weight.t()`` made
    once by a caller, saves F.linear's layers of dispatch (four calls on top of the one
    torch.mm that F.linear makes of a 2-D input: the same bits)."""
    if _on() and native_fits(x, weight):
        return native_rows(x, weight)
    wt = weight.t() if weight_t is None else weight_t
    b = x.shape[0]
    if b == TORCH_BLOCK:
        return torch.mm(x, wt)
    if b < TORCH_BLOCK:
        return torch.mm(torch.cat([x, x[:1].expand(TORCH_BLOCK - b, -1)]), wt)[:b]
    out = x.new_empty(b, wt.shape[1])
    for a in range(0, b, TORCH_BLOCK):
        s = min(a, b - TORCH_BLOCK)  # the last block reaches back to hold TORCH_BLOCK rows
        torch.mm(x[s:s + TORCH_BLOCK], wt, out=out[s:s + TORCH_BLOCK])
    return out


# ATen's vectorised CPU loop (vectorized_loop) takes 2 vectors a step, at most 64 elements (bf16
# on AVX-512), at least 16 (fp32 on AVX2), and hands what is left of its range to the scalar
# function; a call under ATen's grain (32,768 elements) runs on one thread, its range unsplit.
_STEP, _SCALAR_ONLY, _GRAIN = 64, 16, 32768


def each_row(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (ONE elementwise op) over each row of x [B, ...] as it is on that row alone.
    torch's vectorised CPU loops round sigmoid, silu and softplus otherwise in a loop's tail
    than in its body (measured: a row of a [40, L] call differs from the same row alone for L =
    4 to 128), and which elements fall in the tail is decided by a loop's range. One call over
    the batch gives each row its own bits where the ranges are the rows' own or split alike, on
    one thread: rows apart in memory (a projection's slice: ATen cannot merge them and runs the
    loop a row at a time; a row itself in runs, each its own range alone too), or contiguous rows of a multiple of every loop's step (no row has a
    tail), or fewer elements than the smallest step (every element scalar, as alone). Else a
    call a row. Exact ops (add, mul, rsqrt) need none of this."""
    if x.shape[0] == 1:
        return fn(x)
    key = (x.shape, x.stride())
    whole = _WHOLE.get(key)
    if whole is None:
        whole = _WHOLE[key] = _one_call_is_each_row(x)
    if whole:
        return fn(x)
    return torch.stack([fn(row) for row in x.unbind(0)])


_WHOLE: dict[tuple, bool] = {}  # each_row's answer by shape and strides (a few a model)


def _one_call_is_each_row(x: torch.Tensor) -> bool:
    rows, numel = x.shape[0], x.numel()
    if numel >= _GRAIN:
        return False
    width = numel // rows
    expected = 1  # a row one run of memory: the strides of a contiguous row
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            # the loop runs over a row's own runs, the same alone and in the batch
            return x.stride(-1) == 1 or x.shape[-1] == 1
        expected *= size
    return numel < _SCALAR_ONLY or x.stride(0) != width or width % _STEP == 0


def causal_conv1d_rows(x: torch.Tensor, tails: list[torch.Tensor],
                       weight: torch.Tensor) -> torch.Tensor:
    """The GDN conv of one decode token for each of B sequences, with SiLU: x [R, C] (R >= B;
    rows past B pad a lone sequence to TORCH_BLOCK rows), tails[b] [C, K-1] (sequence b's last K-1
    inputs, updated in place), weight [C, K] fp32. Returns [R, C] in x's dtype, a pad row a
    copy of row 0's. Each row is a multiply and a sum over the K taps on its own tail
    (F.conv1d's depthwise kernel cost 55-105 us a call at [C, K]), the same ops whatever B.
    Where the native kernel runs and every tensor is fp32, csrc/gdn.c's conv: one call."""
    if _on() and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 \
            and _all_fit(tails) and _all_fit([weight]) \
            and weight.shape[1] <= _MAX_TAPS:
        c, taps = weight.shape
        y = torch.empty(x.shape[0], c, dtype=torch.float32)
        native_function("tandem_conv_rows_f32")(
            len(tails), x.data_ptr(), x.stride(0), _pointers(tails, tails), weight.data_ptr(),
            c, taps, y.data_ptr(), c)
        return _pad(y, len(tails))
    cols = x.unsqueeze(-1)  # [R, C, 1]
    same = x.dtype == torch.float32
    out = []
    for b, tail in enumerate(tails):
        full = torch.cat([tail if tail.dtype == x.dtype else tail.to(x.dtype), cols[b]], dim=1)
        out.append(((full if same else full.float()) * weight).sum(-1))
        tail.copy_(full[:, 1:])
    y = torch.stack(out + out[:1] * (x.shape[0] - len(tails)))
    return each_row(F.silu, y if same else y.to(x.dtype))


def recurrent_gated_delta_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               decay: torch.Tensor, beta: torch.Tensor,
                               states: list[torch.Tensor]) -> torch.Tensor:
    """One decode token of the gated delta rule for each of B sequences, on prepared inputs:
    q, k [R, Hv, dk] fp32 (L2-normalised, q scaled, heads repeated to v's; R >= B, rows past B
    a pad), v [R, Hv, dv] fp32, decay (exp of the log decay) and beta [R, Hv] fp32; states[b]
    [Hv, dk, dv] fp32, updated in place. Returns o [R, Hv, dv] fp32, a pad row a copy of row
    0's. Sequence b's arithmetic is its own rows' alone."""
    r, h, dv = v.shape
    if _on() and _all_fit(states) and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                            for t in (q, k, v, decay, beta)):
        # contiguous at every R (a slice's rows lie apart, but one row is always one run): the
        # same kernel for a row alone and batched
        q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
        n, dk = len(states), q.shape[-1]
        o = torch.empty(r, h, dv, dtype=torch.float32)
        native_function("tandem_delta_rows_f32")(
            n, q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
            _pointers(states, states), h, dk, dv, o.data_ptr(), torch.get_num_threads())
        return _pad(o, n)
    # Every row's operands as the per-head [H, 1, d] and [H, d, 1] matrices bmm takes, viewed
    # once for the batch (a view per row and operand cost as much as the arithmetic).
    k_rows = k.unsqueeze(2)  # [R, H, 1, dk]
    k_cols = k_rows.transpose(2, 3)  # [R, H, dk, 1]
    q_rows, v_rows = q.unsqueeze(2), v.unsqueeze(2)
    decay4, beta4 = decay.reshape(r, h, 1, 1), beta.reshape(r, h, 1, 1)
    out = []
    for b, s in enumerate(states):
        s.mul_(decay4[b])
        kb = k_rows[b]
        delta = (v_rows[b] - torch.bmm(kb, s)) * beta4[b]  # [H, 1, dv]
        s.baddbmm_(k_cols[b], delta)  # s + k^T delta
        out.append(torch.bmm(q_rows[b], s))
    return torch.stack(out + out[:1] * (r - len(states))).view(r, h, dv)


# -- the native GDN middle (csrc/gdn.c) ---------------------------------------------------------

_MAX_TAPS = 16  # gdn.c's conv holds a channel's taps in a 16-float array


def _all_fit(tensors) -> bool:
    """fp32 CPU tensors, each one run of memory (a state, a tail, a constant)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


def _pointers(*groups: list[torch.Tensor]):
    addresses = [t.data_ptr() for group in groups for t in group]
    return (ctypes.c_void_p * len(addresses))(*addresses)


def _pad(out: torch.Tensor, n: int) -> torch.Tensor:
    """Rows past the n sequences a copy of row 0's, as the torch path pads."""
    if out.shape[0] > n:
        out[n:] = out[0]
    return out


class _GdnConsts(ctypes.Structure):
    _fields_ = [("conv_w", ctypes.c_void_p), ("neg_a", ctypes.c_void_p),
                ("dt_bias", ctypes.c_void_p), ("norm_w", ctypes.c_void_p),
                ("taps", ctypes.c_long), ("hk", ctypes.c_long), ("hv", ctypes.c_long),
                ("dk", ctypes.c_long), ("dv", ctypes.c_long), ("l2_eps", ctypes.c_float),
                ("q_scale", ctypes.c_float), ("eps", ctypes.c_float)]  # gdn.c's gdn_layer


class GdnLayer:
    """A GDN layer's decode middle on the native kernel (csrc/gdn.c), between its in_proj and
    its out_proj: its constants checked and packed once a layer (``build``), then one call a
    step (a wave of a ragged step). A row's bits are a function of its own inputs, tail and
    state alone: the same at any place of any call, on any thread count."""

    def __init__(self, consts: tuple[torch.Tensor, ...], dims: tuple[int, int, int, int],
                 scalars: tuple[float, float, float]):
        self._consts = consts  # kept alive: the struct holds their addresses
        conv_w, neg_a, dt_bias, norm_w = consts
        self.dims = dims
        self._struct = _GdnConsts(conv_w.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
                                  norm_w.data_ptr(), conv_w.shape[1], *dims, *scalars)
        self._ref = ctypes.byref(self._struct)
        self.address = ctypes.addressof(self._struct)  # for a plan that holds it (step.py)

    @classmethod
    def build(cls, consts: tuple[torch.Tensor, ...], dims: tuple[int, int, int, int],
              scalars: tuple[float, float, float]) -> "GdnLayer | None":
        """``consts``: the conv taps [C, K], -exp(A_log) and dt_bias [hv], the norm's weight
        [dv]; ``dims`` (hk, hv, dk, dv); ``scalars`` (l2norm's eps, q's scale, the norm's eps).
        None where the native kernel is off or the constants are not fp32 CPU runs of memory
        of those shapes."""
        hk, hv, dk, dv = dims
        conv_w, neg_a, dt_bias, norm_w = consts
        if not (_on() and _all_fit(consts) and hk > 0 and hv % hk == 0
                and conv_w.dim() == 2 and conv_w.shape[0] == 2 * hk * dk + hv * dv
                and 1 <= conv_w.shape[1] <= _MAX_TAPS
                and neg_a.shape == (hv,) and dt_bias.shape == (hv,) and norm_w.shape == (dv,)):
            return None
        return cls(consts, dims, scalars)

    @staticmethod
    def fits(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
             sections: list[torch.Tensor]) -> bool:
        """Whether a step's operands are the kernel's, of a model whose rows and sections are
        fp32 on the CPU: [R, width] rows whose elements are adjacent (a projection's slices),
        the sequences' tails and states (``sections``) runs of memory."""
        return (all(t.stride(1) == 1 for t in (mixed, a, b, z))
                and all(t.is_contiguous() for t in sections))

    def __call__(self, out: torch.Tensor, rows: list[int] | None, mixed: torch.Tensor,
                 a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, tails: tuple[list, list],
                 states: tuple[list, list]) -> None:
        """The middle for the sequences' rows ``rows`` of the inputs (None: rows 0..len - 1):
        mixed [., C] (q, k, v before the conv), a, b [., hv], z [., hv dv]; each row's tail
        [C, K-1] read from ``tails[0][r]`` and written to ``tails[1][r]``, its state [hv, dk,
        dv] from ``states[0][r]`` to ``states[1][r]`` (the same tensors for a decode, which
        advances in place; a verify row's own copy). Writes ``out``'s rows [hv dv] (fp32, rows
        ``out.stride(0)`` apart), ready for out_proj."""
        n = len(tails[0])
        index = None if rows is None else (ctypes.c_long * n)(*rows)
        native_function("tandem_gdn_rows_f32")(
            self._ref, n, index, mixed.data_ptr(), mixed.stride(0), a.data_ptr(), a.stride(0),
            b.data_ptr(), b.stride(0), z.data_ptr(), z.stride(0),
            _pointers(tails[0], tails[1], states[0], states[1]), out.data_ptr(),
            out.stride(0), torch.get_num_threads())

    def prefill(self, out: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                z: torch.Tensor, tail: torch.Tensor, state: torch.Tensor) -> bool:
        """The layer's middle over a prefill chunk of one sequence (csrc/gdn.c,
        ``tandem_gdn_prefill_f32``): the conv of its rows, the gates and the delta rule in
        blocks of reference.GDN_CHUNK from the chunk's first row, the gated norm. Operands as
        ``__call__``'s for T rows (``fits``); the sequence's tail [C, K-1] and state [hv, dk,
        dv] advance in place. False, with nothing written, where the kernel could not allocate
        its buffers (the caller then takes the reference path)."""
        if reference.GDN_CHUNK != _PREFILL_BLOCK:
            return False
        return native_function("tandem_gdn_prefill_f32")(
            self._ref, mixed.shape[0], mixed.data_ptr(), mixed.stride(0), a.data_ptr(),
            a.stride(0), b.data_ptr(), b.stride(0), z.data_ptr(), z.stride(0), tail.data_ptr(),
            state.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads()) == 0


_PREFILL_BLOCK = 64  # gdn.c's CH: the block the native prefill's delta rule runs in
