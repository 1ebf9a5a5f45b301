"""Triton kernels for the GDN's causal conv1d (prefill with its tail, the decode step, decode rows).

Each one computes what its torch reference in ``reference.py`` / ``decode.py`` computes, on CUDA
tensors (``tandem.kernels`` registers them for CUDA only; a CPU tensor keeps the reference), and
is held to it under ``TRITON_INTERPRET=1`` (tests/kernels/test_triton_conv.py).

The grid gate: an output element is the K taps of its own channel, summed in tap order in fp32
by the one program that owns it, with no reduction across programs, so its bits depend on its K
inputs and its weights only, never on T, on the block it falls in, or on where the call started.
A prefill cut anywhere (the conv tail concatenated in every call, the first included) gives the
same bits cold and resumed, and so does the tail.

The tail is written by a second launch after the convolution, since the convolution's programs
read the old tail while it is replaced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # rows of x a program convolves
BLOCK_C = 128  # channels a program owns


@triton.jit
def _conv_kernel(x, tail, w, y, T, C, sx_t, st_c, st_k, sw_c, sw_k, sy_t,
                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pt = tl.program_id(0) * BT + tl.arange(0, BT)
    pc = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = pt < T, pc < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = pt + j - (K - 1)  # the input of tap j: x's row src, or tail column K-1+src
        from_x = src >= 0
        # addresses kept in range where masked off (the interpreter checks them too)
        xv = tl.load(x + tl.where(from_x, src, 0)[:, None] * sx_t + pc[None, :],
                     mask=(from_x & mt)[:, None] & mc[None, :], other=0.0)
        tv = tl.load(tail + pc[None, :] * st_c + tl.where(from_x, 0, K - 1 + src)[:, None] * st_k,
                     mask=((src < 0) & mt)[:, None] & mc[None, :], other=0.0)
        # the reference casts the tail to x's dtype before the fp32 arithmetic
        val = tl.where(from_x[:, None], xv.to(tl.float32),
                       tv.to(x.dtype.element_ty).to(tl.float32))
        wj = tl.load(w + pc * sw_c + j * sw_k, mask=mc, other=0.0).to(tl.float32)
        acc += val * wj[None, :]
    # silu of the sum rounded to x's dtype, as F.silu(y.to(x.dtype)) takes it
    r = acc.to(y.dtype.element_ty).to(tl.float32)
    out = r / (1.0 + tl.exp(-r))
    tl.store(y + pt[:, None] * sy_t + pc[None, :], out.to(y.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _tail_kernel(x, tail, T, C, sx_t, st_c, st_k,
                 K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    pc = tl.program_id(0) * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    mc, mk = pc < C, rk < K - 1
    src = T + rk - (K - 1)  # new tail column rk: x's row src, or old tail column rk + T
    from_x = src >= 0
    xv = tl.load(x + tl.where(from_x, src, 0)[None, :] * sx_t + pc[:, None],
                 mask=mc[:, None] & (from_x & mk)[None, :], other=0.0)
    tv = tl.load(tail + pc[:, None] * st_c + tl.where(from_x, 0, rk + T)[None, :] * st_k,
                 mask=mc[:, None] & ((src < 0) & mk)[None, :], other=0.0)
    # every value is loaded before any is stored: a program reads and writes its own channels
    val = tl.where(from_x[None, :], xv.to(tail.dtype.element_ty),
                   tv.to(x.dtype.element_ty).to(tail.dtype.element_ty))
    tl.store(tail + pc[:, None] * st_c + rk[None, :] * st_k, val,
             mask=mc[:, None] & mk[None, :])


def _conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
          y: torch.Tensor) -> torch.Tensor:
    n, c = x.shape
    k = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    grid = (triton.cdiv(n, BLOCK_T), triton.cdiv(c, BLOCK_C))
    if n:
        _conv_kernel[grid](x, tail, weight, y, n, c, x.stride(0), tail.stride(0), tail.stride(1),
                           weight.stride(0), weight.stride(1), y.stride(0),
                           K=k, BT=BLOCK_T, BC=BLOCK_C)
    if k > 1:
        _tail_kernel[(triton.cdiv(c, BLOCK_C),)](x, tail, n, c, x.stride(0), tail.stride(0),
                                                 tail.stride(1), K=k,
                                                 BK=triton.next_power_of_2(k - 1), BC=BLOCK_C)
    return y


def causal_conv1d(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d: x [T, C], tail [C, K-1] (updated in place), weight [C, K]."""
    return _conv(x, tail, weight, torch.empty(x.shape, dtype=x.dtype, device=x.device))


def causal_conv1d_step(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d_step (x [1, C]): the same kernel at T = 1."""
    return causal_conv1d(x, tail, weight)


def causal_conv1d_rows(x: torch.Tensor, tails: list[torch.Tensor],
                       weight: torch.Tensor) -> torch.Tensor:
    """decode.causal_conv1d_rows: one launch a sequence on its own row and tail (so a row's bits
    are its own whatever the batch), rows past len(tails) a copy of row 0's."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for b, tail in enumerate(tails):
        _conv(x[b:b + 1], tail, weight, y[b:b + 1])
    if x.shape[0] > len(tails):
        y[len(tails):] = y[:1]
    return y


CUDA_OPS = {
    "causal_conv1d": causal_conv1d,
    "causal_conv1d_step": causal_conv1d_step,
    "causal_conv1d_rows": causal_conv1d_rows,
}
