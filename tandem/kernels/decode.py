"""Decode's matmul over the rows of a batch, one row a sequence, each row's bits its own.

A batched decode step runs every projection as one matmul over its B rows so that the weights are
read once a step. A sequence's logits must then be the same bits alone and in any batch at any
place (issue 14, part 3), so the kernel must give a row the same sums whatever the other rows and
however many. Measured with torch 2.13's CPU build (MKL 2024.2) on 2 and 1 threads, fp32 and
bf16, for every decode shape of `tiny` and of a Qwen3.5-0.8B-like model (hidden 256 to 1,024,
outputs 256 to 248,320; tests/kernels/test_decode_rows.py holds it):

- ``F.linear`` at M = 1 is a GEMV whose sums round in another order than any M >= 2;
- ``F.linear`` at M = 2..9 (2..12 for K >= 512) is one kernel, the same bits per row whatever
  the other rows and their number; at M >= 12 to 16 it blocks otherwise and the bits move;
- ``torch.mm(W, X^T)`` is one class for M = 2..33, but reads the weights at about half
  ``F.linear``'s rate at M = 2, where ``F.linear`` matches the GEMV (57 GB/s at hidden 1,024 out
  of cache; 24-27 GB/s on tiny's 248k-row head, numpy's rate on the same matrix).

So every call runs at 2 <= M <= BLOCK rows: one row is padded to two (a stride-0 copy of itself,
the second result dropped), a batch above BLOCK goes in blocks. A single sequence's decode runs
this very path at B = 1, so alone and batched are the same bits. F.linear reads the weights at
M = 2..3 as fast as at 1 and slower per call above (about 1/2 at 4 rows, 1/3 at 8), still 2-2.7
rows' worth a read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 8  # the most rows one matmul takes: the invariant class is 2..9 on every shape measured


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [B, K], weight [N, K]: [B, N], row b's bits a function of x[b]."""
    b = x.shape[0]
    if b == 1:
        return F.linear(x.expand(2, -1), weight)[:1]
    if b <= BLOCK:
        return F.linear(x, weight)
    out = x.new_empty(b, weight.shape[0])
    for a in range(0, b, BLOCK):
        e = min(a + BLOCK, b)
        s = a - 1 if e - a == 1 else a  # a lone last row runs beside its predecessor (M = 2)
        out[s:e] = F.linear(x[s:e], weight)
    return out


def causal_conv1d_rows(x: torch.Tensor, tails: list[torch.Tensor],
                       weight: torch.Tensor) -> torch.Tensor:
    """The GDN conv of one decode token for each of B sequences, with SiLU: x [B, C], tails[b]
    [C, K-1] (sequence b's last K-1 inputs, updated in place), weight [C, K] fp32. Returns
    [B, C] in x's dtype. Each row is a multiply and a sum over the K taps on its own tail
    (F.conv1d's depthwise kernel cost 55-105 us a call at [C, K]), the same ops whatever B."""
    y = torch.empty(x.shape, dtype=torch.float32)
    for b, tail in enumerate(tails):
        full = torch.cat([tail.to(x.dtype), x[b, :, None]], dim=1)  # [C, K]
        torch.sum(full.float() * weight, dim=-1, out=y[b])
        tail.copy_(full[:, 1:])
    return F.silu(y.to(x.dtype))


def recurrent_gated_delta_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               decay: torch.Tensor, beta: torch.Tensor,
                               states: list[torch.Tensor]) -> torch.Tensor:
    """One decode token of the gated delta rule for each of B sequences, on prepared inputs:
    q, k [B, Hv, dk] fp32 (L2-normalised, q scaled, heads repeated to v's), v [B, Hv, dv] fp32,
    decay (exp of the log decay) and beta [B, Hv] fp32; states[b] [Hv, dk, dv] fp32, updated in
    place. Returns o [B, Hv, dv] fp32. Sequence b's arithmetic is its own rows' alone."""
    o = torch.empty(v.shape, dtype=torch.float32)
    for b, s in enumerate(states):
        s.mul_(decay[b, :, None, None])
        kb = k[b, :, None, :]  # [H, 1, dk]
        delta = (v[b, :, None, :] - torch.bmm(kb, s)) * beta[b, :, None, None]  # [H, 1, dv]
        s.baddbmm_(kb.transpose(1, 2), delta)  # s + k^T delta
        torch.bmm(q[b, :, None, :], s, out=o[b, :, None, :])
    return o
