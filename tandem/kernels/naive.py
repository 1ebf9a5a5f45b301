"""Naive per-token loops in float64: the specification the reference ops are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_naive(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor):
    """x [T, C], tail [C, K-1], weight [C, K] -> (y [T, C], new tail), every token on its own."""
    x, tail, weight = x.double(), tail.double(), weight.double()
    window = torch.cat([tail, x.T], dim=1)
    width = weight.shape[1]
    ys = []
    for t in range(x.shape[0]):
        cols = window[:, t:t + width]  # the K inputs ending at token t
        ys.append(F.silu((cols * weight).sum(dim=1)))
    return torch.stack(ys), window[:, -(width - 1):]


def gdn_naive(q, k, v, g, beta, state):
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv] -> (o, state)."""
    rep = v.shape[1] // q.shape[1]
    q = q.double().repeat_interleave(rep, dim=1)
    k = k.double().repeat_interleave(rep, dim=1)
    v, g, beta, s = v.double(), g.double(), beta.double(), state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        qt = q[t] / torch.sqrt((q[t] ** 2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
        kt = k[t] / torch.sqrt((k[t] ** 2).sum(-1, keepdim=True) + 1e-6)
        s = s * torch.exp(g[t])[:, None, None]
        pred = torch.einsum("hk,hkv->hv", kt, s)
        delta = (v[t] - pred) * beta[t][:, None]
        s = s + torch.einsum("hk,hv->hkv", kt, delta)
        outs.append(torch.einsum("hk,hkv->hv", qt, s))
    return torch.stack(outs), s


def moe_naive(x, gate_up, down, top_w, top_i):
    """The routed experts as transformers' Qwen3_5MoeExperts runs them: a loop over every expert,
    in the input's dtype (not float64), so that the grouped op is held to torch.equal."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        rows, slot = torch.where(top_i == e)
        if rows.numel() == 0:
            continue
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * top_w[rows, slot, None]
        out.index_add_(0, rows, y)
    return out
