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

So every call runs at exactly BLOCK = 2 rows: a lone row is padded (a copy of itself, its result
dropped), more go in pairs, an odd last row taking its predecessor again (the same bits twice).
One sequence's decode runs this very path at B = 1, so alone and batched are the same bits; a
step reads the weights ceil(B / 2) times, each at the GEMV's rate: B = 2 and 4 decode 2x one
sequence's tokens a second, as 3 rows a call would at B = 4 while costing one sequence 10 %.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 2  # the rows of every decode matmul: the most read at the GEMV's rate


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [B, K], weight [N, K]: [B, N], row b's bits a function of x[b]."""
    b = x.shape[0]
    if b == BLOCK:
        return F.linear(x, weight)
    if b < BLOCK:
        return F.linear(torch.cat([x, x[:1].expand(BLOCK - b, -1)]), weight)[:b]
    out = x.new_empty(b, weight.shape[0])
    for a in range(0, b, BLOCK):
        s = min(a, b - BLOCK)  # the last block reaches back to hold BLOCK rows
        out[s:s + BLOCK] = F.linear(x[s:s + BLOCK], weight)
    return out


def each_row(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (an elementwise op) over each row of x [B, ...] on its own. torch's vectorised CPU
    loops round sigmoid, silu and softplus otherwise in a loop's tail than in its body (measured:
    a row of a [40, L] call differs from the same row alone for L = 4 to 128), and a row's place
    in the flat tensor decides which of its elements fall in the tail; one row a call makes the
    split the row's own. Exact ops (add, mul, rsqrt) need none of this."""
    if x.shape[0] == 1:
        return fn(x[0])[None]
    return torch.stack([fn(row) for row in x.unbind(0)])


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
    return each_row(F.silu, y.to(x.dtype))


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
