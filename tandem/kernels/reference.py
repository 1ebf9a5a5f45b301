"""Pure-torch reference ops for Gated DeltaNet layers and sparse mixture-of-experts blocks.

Every op takes one sequence (no batch axis) and runs in fp32 inside, whatever the model dtype.
Shapes never depend on where a sequence was cut except through the caller's chunking, so a
prefill resumed on the same grid runs exactly the arithmetic a cold one ran (DESIGN.md: the two
gates). The naive per-token loops in ``naive.py`` are the specification these are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GDN_CHUNK = 64  # the chunk of the delta rule's WY form; every prefill grid line is a multiple
LOG_FLOOR = -30.0  # log decays below it count as 0 in the chunked rule (chunk_gated_delta_rule)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution with SiLU, continuing from ``tail``.

    x: [T, C] the new inputs; tail: [C, K-1] the previous K-1 inputs (zeros at token 0), updated
    in place to the last K-1 inputs; weight: [C, K]. Returns [T, C] in x's dtype, contiguous.

    The tail is concatenated for every call, the first chunk included, so a cold chunk and a
    resumed one convolve the same shapes. The K taps are K shifted multiply-adds over the
    [T, C] rows in fp32, elementwise, so each output's arithmetic does not depend on T. F.conv1d
    wanted [C, T]: two transposes and a strided result, 1.3 to 1.4 times these passes' time at
    tiny's 1,024 x 384 (one thread).
    """
    n, width = x.shape[0], weight.shape[1] - 1
    full = torch.cat([tail.transpose(0, 1).to(x.dtype), x], dim=0).float()  # [K-1+T, C]
    taps = weight.float().transpose(0, 1)  # [K, C]
    y = full[:n] * taps[0]
    for j in range(1, width + 1):
        y.addcmul_(full[j:j + n], taps[j])
    tail.copy_(full[n:].transpose(0, 1))
    return F.silu(y.to(x.dtype))


def causal_conv1d_step(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """causal_conv1d for one decode token (x: [1, C]) as a multiply and a sum over the K taps:
    F.conv1d's depthwise kernel costs 55-105 us a call at decode's [C, K] against 3 us for
    this (C 384, K 4), about 5 % of a `tiny` token. Its sum rounds in another order than
    causal_conv1d's (1 ulp apart), so decode uses it and prefill, whose grid gates want the same
    bits cold and resumed, keeps causal_conv1d."""
    width = weight.shape[1] - 1
    full = torch.cat([tail.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K]
    y = (full.float() * weight.float()).sum(dim=-1)  # [C], fp32 as conv1d accumulates
    tail.copy_(full[:, full.shape[1] - width:])
    return F.silu(y.to(x.dtype))[None, :]


def _prepare(q, k, v, g, beta, scale_q: bool = True):
    """To fp32, heads first, q and k L2-normalised, q scaled, q/k heads repeated to v's."""
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v = (t.transpose(0, 1).to(torch.float32) for t in (q, k, v))  # [H, T, d]
    g, beta = (t.transpose(0, 1).to(torch.float32) for t in (g, beta))  # [H, T]
    q, k = l2norm(q), l2norm(k)
    if scale_q:
        q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def _floored_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0, every x below LOG_FLOOR taken as exactly 0 (chunk_gated_delta_rule)."""
    return torch.where(x >= LOG_FLOOR, x.clamp(LOG_FLOOR, 0.0).exp(), 0.0)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_size: int = GDN_CHUNK) -> torch.Tensor:
    """The gated delta rule over a prefill chunk in its chunked (WY) form.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay, <= 0), beta: [T, Hv]; state: [Hv, dk, dv]
    fp32, updated in place. Returns o: [T, Hv, dv] in v's dtype.

    T is padded to a multiple of ``chunk_size`` with g = 0 and beta = k = 0, which leaves the state
    untouched, so every inner chunk has the same shape. Every chunk's intra-chunk work is batched
    over (chunk, head) in one call an op; the state passes from chunk to chunk through
    ``S' = M S + c`` (one baddbmm a chunk, M and c batched beforehand), and each chunk's output
    reads its entry state in one batched matmul after the loop.

    Decays below exp(LOG_FLOOR) are taken as 0: with a fast-forgetting model (tiny's recipe,
    g about -4 a token) a 64-token chunk spans decays down to exp(-250), and exp's results and
    the products below fp32's normal range (1.2e-38) take a CPU's microcode path, 20 to 170
    times slower an element (about half of tiny's old chunk). A dropped term is below 1e-13 of
    the state it decays, a millionth of fp32's rounding. With the floor every product the
    kernel forms is at least exp(2 * LOG_FLOOR) times its operands, inside the normal range:
    ``w``'s rows where the chunk's own decay has fallen under the floor are solved as 0 (their
    triangular system rows are zeroed), instead of carrying chains of ever smaller products.
    """
    out_dtype = v.dtype
    seq_len, num_k_heads = q.shape[0], q.shape[1]
    heads, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    if heads != num_k_heads:
        q = q.repeat_interleave(heads // num_k_heads, dim=1)
        k = k.repeat_interleave(heads // num_k_heads, dim=1)
    q, k, v, g, beta = (t.to(torch.float32) for t in (q, k, v, g, beta))
    pad = (-seq_len) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n = (seq_len + pad) // chunk_size
    # [n, H, C, d], contiguous: a chunk's heads side by side, so that the state of chunk i is
    # states[i], one block, and every batched matmul reads dense operands.
    q, k, v = (t.reshape(n, chunk_size, heads, t.shape[-1]).transpose(1, 2).contiguous()
               for t in (q, k, v))
    g, beta = (t.reshape(n, chunk_size, heads).transpose(1, 2).contiguous() for t in (g, beta))
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)

    k_beta = k * beta.unsqueeze(-1)
    g_cum = g.cumsum(dim=-1)  # [n, H, C], non-increasing along the chunk
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)
    decay = torch.where(lower & (diff >= LOG_FLOOR), diff.clamp(LOG_FLOOR, 0.0).exp(), 0.0)
    g_exp = _floored_exp(g_cum)
    # (I + strict_lower(beta k k^T * decay)) [u | w] = [beta v | beta k * exp(g_cum)]: the UT
    # transform of the chunk's updates (solve_triangular reads the strict lower part only).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                      unitriangular=True)
    live = (g_exp > 0).unsqueeze(-1)  # the rows of w above the floor: a prefix of each chunk
    w = torch.linalg.solve_triangular(system * live, k_beta * g_exp.unsqueeze(-1), upper=False,
                                      unitriangular=True)
    uw = torch.cat([u, w], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    k_to_end = k * _floored_exp(g_cum[..., -1:] - g_cum).unsqueeze(-1)
    intra_uw = intra @ uw  # [n, H, C, dv + dk]
    end_uw = k_to_end.transpose(-1, -2) @ uw  # [n, H, dk, dv + dk]
    # S' = S * decay_C + k_to_end^T (u - w S) = (decay_C I - k_to_end^T w) S + k_to_end^T u
    step = torch.diag_embed(g_exp[..., -1:].expand(n, heads, dk)) - end_uw[..., dv:]
    add = end_uw[..., :dv].contiguous()
    states = torch.empty(n + 1, heads, dk, dv, dtype=torch.float32, device=q.device)
    states[0] = state
    for i in range(n):
        torch.baddbmm(add[i], step[i], states[i], out=states[i + 1])
    state.copy_(states[n])
    # o = q_decayed S + intra (u - w S) = intra u + (q_decayed - intra w) S
    read = q * g_exp.unsqueeze(-1) - intra_uw[..., dv:]
    out = torch.baddbmm(intra_uw[..., :dv].reshape(n * heads, chunk_size, dv),
                        read.reshape(n * heads, chunk_size, dk),
                        states[:n].reshape(n * heads, dk, dv))
    out = out.view(n, heads, chunk_size, dv).transpose(1, 2).reshape(n * chunk_size, heads, dv)
    return out[:seq_len].to(out_dtype)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One decode token of the gated delta rule: shapes as chunk_gated_delta_rule with T = 1."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [H, 1, d]
    s = state * g.exp().unsqueeze(-1)  # [H, dk, dv] * [H, 1, 1]
    kv_mem = k @ s  # [H, 1, dv]
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.transpose(-1, -2) @ delta
    state.copy_(s)
    return (q @ s).transpose(0, 1).to(out_dtype)


def recurrent_gated_delta_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor):
    """A speculative verify block: the decode step over T tokens, keeping every position's state.

    Shapes as chunk_gated_delta_rule. Returns (o [T, Hv, dv] in v's dtype, states [T, Hv, dk, dv]
    fp32: the state after each token). ``state`` is read, never written: the caller lands the
    accepted position's state (Engine.settle), so a rejected tail costs nothing to undo. Each
    token runs the arithmetic of ``recurrent_gated_delta_step`` on its own slice.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [H, T, d]
    s = state
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * g[:, t:t + 1].exp().unsqueeze(-1)
        kt = k[:, t:t + 1]
        delta = (v[:, t:t + 1] - kt @ s) * beta[:, t:t + 1].unsqueeze(-1)
        s = s + kt.transpose(-1, -2) @ delta
        states.append(s)
        outs.append(q[:, t:t + 1] @ s)
    return torch.cat(outs, dim=1).transpose(0, 1).to(out_dtype), torch.stack(states)


# -- sparse mixture of experts ------------------------------------------------------------------

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# On a CPU torch's grouped_mm walks every group, the empty ones too (about 1.7 us a group for
# the two calls), where a Python loop costs about 13 us an expert that received rows (one
# thread, hidden 64): the loop is the cheaper below one hit expert in 8.
CPU_LOOP_RATIO = 8


def _swiglu_experts(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """``down_e(silu(gate_e r) * up_e r)`` for the rows of each expert e, ``counts[e]`` of them,
    in expert order. Both paths run one GEMM an expert on the same operands: the same bits."""
    ends = counts.cumsum(0).to(torch.int32)
    grouped = _GROUPED_MM is not None
    if grouped and rows.device.type == "cpu":
        grouped = int(torch.count_nonzero(counts)) * CPU_LOOP_RATIO >= gate_up.shape[0]
    elif grouped:
        grouped = rows.dtype == torch.bfloat16  # CUDA's grouped GEMM takes bfloat16 only
    if grouped:
        gate, up = _GROUPED_MM(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return _GROUPED_MM(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    out = rows.new_empty(rows.shape[0], down.shape[1])
    bounds = ends.tolist()
    for e in torch.nonzero(counts).flatten().tolist():  # the experts that received rows
        a, b = bounds[e] - int(counts[e]), bounds[e]
        gate, up = F.linear(rows[a:b], gate_up[e]).chunk(2, dim=-1)
        out[a:b] = F.linear(F.silu(gate) * up, down[e])
    return out


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
    """The routed SwiGLU experts of a sparse MoE block, over the tokens routed to each.

    x: [T, H]; gate_up: [E, 2I, H] (each expert's gate rows, then its up rows: transformers'
    fused layout); down: [E, H, I]; top_w: [T, k] in x's dtype; top_i: [T, k] expert ids.
    Returns [T, H]: sum over j of top_w[t, j] * down_e(silu(gate_e x) * up_e x), e = top_i[t, j].

    The T * k (token, expert) pairs are sorted by expert, so each expert is one GEMM over every
    row routed to it and only the routed experts' weights are read (never copied: a gather of
    each pair's weights, ``gate_up[top_i]`` then bmm, was 20x slower at decode). On a CPU the
    work is bound by reading those weights (12 MiB an expert at 35B-A3B's shapes in fp32); the
    path decides the overhead around it. At prefill most experts receive rows, and two grouped
    matmuls cost two dispatches where a loop paid one round an expert (up to 512): 2 to 3x
    faster at 64 to 512 tokens of 256 experts (hidden 64, one thread). At decode (1 token,
    top-8 of 256) only 8 experts receive a row, and a loop over those 8 beats grouped_mm's walk
    over all 256 groups (175 us against 520 us, hidden 64); ``CPU_LOOP_RATIO`` picks the path.
    No path loops over the experts that received nothing.

    The sum over a token's k experts is taken in ascending expert order, one rounding an add, as
    a per-expert loop (transformers') adds them: the two agree bit for bit (naive.moe_naive). An
    index_add_ of all the rows at once does not: in bf16 it sums a token's rows before rounding.
    """
    num_tokens, k = top_i.shape
    top_i, slot = torch.sort(top_i, dim=-1)  # each token's experts ascending
    top_w = top_w.gather(-1, slot)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, expert) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    y = _swiglu_experts(x.index_select(0, order // k), gate_up, down, counts)
    pairs = torch.empty_like(y)
    pairs[order] = y  # back in (token, ascending expert) order
    pairs = pairs.view(num_tokens, k, -1) * top_w[..., None]
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + pairs[:, j]
    return out
