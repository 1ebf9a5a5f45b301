"""Triton kernels for the gated delta rule: the chunked prefill, the decode step, the verify block
(every position's state kept) and the batched decode rows.

Each computes what its torch reference computes (``reference.chunk_gated_delta_rule``,
``recurrent_gated_delta_step``, ``recurrent_gated_delta_block``,
``decode.recurrent_gated_delta_rows``) on CUDA tensors; ``tandem.kernels`` registers them for
CUDA only and a CPU tensor keeps the reference. They are held to the references under
``TRITON_INTERPRET=1`` (tests/kernels/test_triton_gdn.py). Inputs in any float dtype; the
arithmetic and the state are fp32.

The grid gate (DESIGN.md: a resumed prefill gives the bits a cold one gave on the same grid):

- The chunks are the call's own rows ``[i*64, (i+1)*64)``; the prefill's grid lines are multiples
  of 64 (reference.GDN_CHUNK), so a chunk of a resumed call is a chunk of the cold call with the
  same rows, and a short last chunk is padded by masked loads (g = 0, k = beta = 0), which leaves
  the state as the reference's padding does.
- ``_chunk_prepare`` (one program a (chunk, head)) reads its chunk's rows only: the in-chunk
  cumulative decay, the UT transform's inverse by blocked forward substitution in a fixed order,
  and ``u``, ``w``. ``_chunk_state`` (one program a (head, block of dv)) walks the chunks in order,
  the state in fp32 registers, loaded from and stored to the fp32 state: a resumed call starts
  from exactly the bits the cold call carried at the cut.
- Every reduction is one program's tl.sum / tl.dot / tl.cumsum over a fixed shape: no atomics,
  no split of a reduction across programs, nothing whose shape or order depends on T or on the
  start row. A program's arithmetic for chunk i is the same instructions on the same values
  cold and resumed, so outputs, states and tails are the same bits (torch.equal).

Dots run at IEEE fp32 (``DOT_PRECISION``): TF32 would round the operands to 10 mantissa bits,
1e-3 off the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.reference import GDN_CHUNK, LOG_FLOOR

DOT_PRECISION = "ieee"
BLOCK_V = 32  # the state's dv columns a program carries (its [dk, BLOCK_V] fp32 in registers)
L2_EPS = 1e-6


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot takes dimensions of 16 or more


@triton.jit
def _floored_exp(x, floor):
    # exp(x) for x <= 0, exactly 0 below the floor (reference._floored_exp)
    return tl.where(x >= floor, tl.exp(tl.minimum(tl.maximum(x, floor), 0.0)), 0.0)


@triton.jit
def _load_qk(ptr, pos, mt, hk, st, sh, rk, mk, DK, eps, scale):
    x = tl.load(ptr + pos[:, None] * st + hk * sh + rk[None, :],
                mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + eps) * scale)[:, None]


@triton.jit
def _unit_lower_inverse(a, rows, cols, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A strictly lower [BT, BT], by forward substitution in a fixed order:
    first the 16 x 16 diagonal blocks, their row i of each at once (row i = e_i - A[i, :] inv),
    then the block rows in order (inv_b = D_b (I_b - A[b, :] inv)). 16 + BT/16 steps of dots
    rather than BT steps of reductions."""
    SUB: tl.constexpr = 16
    eye = tl.where(rows == cols, 1.0, 0.0)
    a_diag = tl.where(rows // SUB == cols // SUB, a, 0.0)
    inv_diag = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(SUB):
        sel = rows % SUB == i
        step = eye - tl.dot(tl.where(sel, a_diag, 0.0), inv_diag, input_precision=PREC)
        inv_diag = tl.where(sel, step, inv_diag)
    inv = tl.zeros([BT, BT], dtype=tl.float32)
    for b in range(BT // SUB):
        # block b's rows of inv are still 0, so A's diagonal block adds nothing here
        sel = rows // SUB == b
        rhs = tl.where(sel, eye - tl.dot(tl.where(sel, a, 0.0), inv, input_precision=PREC), 0.0)
        inv += tl.dot(inv_diag, rhs, input_precision=PREC)
    return inv


@triton.jit
def _chunk_prepare(k, v, g, beta, u, w, gcum, T, RATIO, DK, DV,
                   sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, HV, eps, floor,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr):
    """One chunk of one head: its cumulative log decay and the UT transform's u, w (fp32 in
    the [Tp, HV, d] scratch). (I + A) [u | w] = [beta v | beta k exp(gcum)], A the strict lower
    part of (beta k k^T) * decay."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // RATIO
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    pos = c * BT + rt
    mt, mk = pos < T, rk < DK
    kc = _load_qk(k, pos, mt, hk, sk_t, sk_h, rk, mk, DK, eps, 1.0)
    gc = tl.load(g + pos * sg_t + h * sg_h, mask=mt, other=0.0).to(tl.float32)
    bc = tl.load(beta + pos * sb_t + h * sb_h, mask=mt, other=0.0).to(tl.float32)
    gc_cum = tl.cumsum(gc, axis=0)
    rows = rt[:, None]
    cols = rt[None, :]
    diff = gc_cum[:, None] - gc_cum[None, :]
    decay = tl.where((rows >= cols) & (diff >= floor),
                     tl.exp(tl.minimum(tl.maximum(diff, floor), 0.0)), 0.0)
    kb = kc * bc[:, None]
    a = tl.dot(kb, tl.trans(kc), input_precision=PREC) * decay
    a = tl.where(rows > cols, a, 0.0)
    inv = _unit_lower_inverse(a, rows, cols, BT, PREC)
    g_exp = _floored_exp(gc_cum, floor)
    # w's rows past the floor are 0 (the reference solves them as 0); the live rows are a
    # prefix, and a prefix's rows of the solve do not read the rows after it
    wc = tl.dot(inv, kb * g_exp[:, None], input_precision=PREC)
    wc = tl.where((g_exp > 0.0)[:, None], wc, 0.0)
    out = pos[:, None] * HV + h
    tl.store(w + out * DK + rk[None, :], wc, mask=mt[:, None] & mk[None, :])
    tl.store(gcum + pos * HV + h, gc_cum, mask=mt)
    for vb in range(0, tl.cdiv(DV, BV)):
        rv = vb * BV + tl.arange(0, BV)
        mv = rv < DV
        vc = tl.load(v + pos[:, None] * sv_t + h * sv_h + rv[None, :],
                     mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        uc = tl.dot(inv, vc * bc[:, None], input_precision=PREC)
        tl.store(u + out * DV + rv[None, :], uc, mask=mt[:, None] & mv[None, :])


@triton.jit
def _chunk_state(q, k, u, w, gcum, s, o, T, RATIO, DK, DV,
                 sq_t, sq_h, sk_t, sk_h, ss_h, ss_k, so_t, so_h, HV, eps, scale, floor,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """The chunks of one head in order, for the state's columns [vb*BV, (vb+1)*BV):
    v_new = u - w S; o = (q exp(gcum)) S + (q k^T * decay) v_new;
    S' = exp(g_last) S + (k exp(g_last - gcum))^T v_new."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    hk = h // RATIO
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    smask = mk[:, None] & mv[None, :]
    s_ptr = s + h * ss_h + rk[:, None] * ss_k + rv[None, :]
    state = tl.load(s_ptr, mask=smask, other=0.0)
    rows = rt[:, None]
    cols = rt[None, :]
    for c in range(0, tl.cdiv(T, BT)):
        pos = c * BT + rt
        mt = pos < T
        qc = _load_qk(q, pos, mt, hk, sq_t, sq_h, rk, mk, DK, eps, scale)
        kc = _load_qk(k, pos, mt, hk, sk_t, sk_h, rk, mk, DK, eps, 1.0)
        at = pos[:, None] * HV + h
        wc = tl.load(w + at * DK + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        uc = tl.load(u + at * DV + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        gc_cum = tl.load(gcum + pos * HV + h, mask=mt, other=0.0)
        # the padded rows' cumulative decay is the last real row's (g = 0 there)
        g_last = tl.sum(tl.where(rt == tl.minimum(T - c * BT, BT) - 1, gc_cum, 0.0), axis=0)
        gc_cum = tl.where(mt, gc_cum, g_last)
        diff = gc_cum[:, None] - gc_cum[None, :]
        decay = tl.where((rows >= cols) & (diff >= floor),
                         tl.exp(tl.minimum(tl.maximum(diff, floor), 0.0)), 0.0)
        v_new = uc - tl.dot(wc, state, input_precision=PREC)
        intra = tl.dot(qc, tl.trans(kc), input_precision=PREC) * decay
        oc = (tl.dot(qc * _floored_exp(gc_cum, floor)[:, None], state, input_precision=PREC)
              + tl.dot(intra, v_new, input_precision=PREC))
        tl.store(o + pos[:, None] * so_t + h * so_h + rv[None, :], oc.to(o.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        k_end = kc * _floored_exp(g_last - gc_cum, floor)[:, None]
        state = (state * _floored_exp(g_last, floor)
                 + tl.dot(tl.trans(k_end), v_new, input_precision=PREC))
    tl.store(s_ptr, state, mask=smask)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_size: int = GDN_CHUNK) -> torch.Tensor:
    """reference.chunk_gated_delta_rule: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    state [Hv, dk, dv] fp32, updated in place. Returns o [T, Hv, dv] in v's dtype."""
    seq_len, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v = _rows_view(q), _rows_view(k), _rows_view(v)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if seq_len == 0:
        return o
    s = state if state.stride(-1) == 1 else state.contiguous()
    bk, bv = _block(dk), min(_block(dv), BLOCK_V)
    n_chunks = triton.cdiv(seq_len, chunk_size)
    u = torch.empty(seq_len, hv, dv, dtype=torch.float32, device=v.device)
    w = torch.empty(seq_len, hv, dk, dtype=torch.float32, device=v.device)
    gcum = torch.empty(seq_len, hv, dtype=torch.float32, device=v.device)
    _chunk_prepare[(n_chunks, hv)](
        k, v, g, beta, u, w, gcum, seq_len, hv // hk, dk, dv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), hv, L2_EPS, LOG_FLOOR,
        BT=chunk_size, BK=bk, BV=bv, PREC=DOT_PRECISION)
    _chunk_state[(hv, triton.cdiv(dv, bv))](
        q, k, u, w, gcum, s, o, seq_len, hv // hk, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), s.stride(0), s.stride(1),
        o.stride(0), o.stride(1), hv, L2_EPS, dk ** -0.5, LOG_FLOOR,
        BT=chunk_size, BK=bk, BV=bv, PREC=DOT_PRECISION)
    if s is not state:
        state.copy_(s)
    return o


@triton.jit
def _recurrent(q, k, v, g, beta, s_in, s_out, states, o, T, RATIO, DK, DV,
               sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
               ss_h, ss_k, HV, eps, scale,
               BK: tl.constexpr, BV: tl.constexpr, PREPARED: tl.constexpr,
               KEEP: tl.constexpr, WRITE: tl.constexpr):
    """The rule a token at a time for one head's columns [vb*BV, (vb+1)*BV): S = S exp(g);
    S += k^T (beta (v - k S)); o = q S. PREPARED: q, k already normalised (q scaled) and g the
    decay itself. KEEP: the state after each token to states [T, HV, DK, DV]. WRITE: the last
    state to s_out."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    hk = h // RATIO
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    smask = mk[:, None] & mv[None, :]
    at = h * ss_h + rk[:, None] * ss_k + rv[None, :]
    state = tl.load(s_in + at, mask=smask, other=0.0)
    for t in range(0, T):
        qt = tl.load(q + t * sq_t + hk * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + t * sk_t + hk * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + t * sv_t + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + t * sg_t + h * sg_h).to(tl.float32)
        bt = tl.load(beta + t * sb_t + h * sb_h).to(tl.float32)
        if PREPARED:
            decay = gt
        else:
            qt = qt * (tl.rsqrt(tl.sum(qt * qt, axis=0) + eps) * scale)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + eps)
            decay = tl.exp(gt)
        state = state * decay
        delta = (vt - tl.sum(kt[:, None] * state, axis=0)) * bt
        state = state + kt[:, None] * delta[None, :]
        ot = tl.sum(qt[:, None] * state, axis=0)
        tl.store(o + t * so_t + h * so_h + rv, ot.to(o.dtype.element_ty), mask=mv)
        if KEEP:
            tl.store(states + t * HV * DK * DV + h * DK * DV + rk[:, None] * DV + rv[None, :],
                     state, mask=smask)
    if WRITE:
        tl.store(s_out + at, state, mask=smask)


def _run_recurrent(q, k, v, g, beta, state, o, states=None, write=True, prepared=False):
    seq_len, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v = _rows_view(q), _rows_view(k), _rows_view(v)
    s = state if state.stride(-1) == 1 else state.contiguous()
    bk, bv = _block(dk), min(_block(dv), BLOCK_V)
    _recurrent[(hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, s, s, states if states is not None else s, o, seq_len, hv // hk, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
        s.stride(0), s.stride(1), hv, L2_EPS, dk ** -0.5,
        BK=bk, BV=bv, PREPARED=prepared, KEEP=states is not None, WRITE=write)
    if write and s is not state:
        state.copy_(s)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """reference.recurrent_gated_delta_step: one token (T = 1; any T runs in order)."""
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _run_recurrent(q, k, v, g, beta, state, o)
    return o


def recurrent_gated_delta_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor):
    """reference.recurrent_gated_delta_block: (o [T, Hv, dv], states [T, Hv, dk, dv] fp32, the
    state after each token); ``state`` is read, never written."""
    seq_len, hv, dv = v.shape
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    states = torch.empty(seq_len, hv, q.shape[-1], dv, dtype=torch.float32, device=v.device)
    _run_recurrent(q, k, v, g, beta, state, o, states=states, write=False)
    return o, states


def recurrent_gated_delta_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               decay: torch.Tensor, beta: torch.Tensor,
                               states: list[torch.Tensor]) -> torch.Tensor:
    """decode.recurrent_gated_delta_rows on prepared inputs (q, k [R, Hv, dk] normalised, q
    scaled, decay = exp(g)): one launch a sequence on its own row and state, rows past
    len(states) a copy of row 0's. Returns o [R, Hv, dv] fp32."""
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b, s in enumerate(states):
        _run_recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], decay[b:b + 1], beta[b:b + 1], s,
                       o[b:b + 1], prepared=True)
    if v.shape[0] > len(states):
        o[len(states):] = o[:1]
    return o


CUDA_OPS = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "recurrent_gated_delta_step": recurrent_gated_delta_step,
    "recurrent_gated_delta_block": recurrent_gated_delta_block,
    "recurrent_gated_delta_rows": recurrent_gated_delta_rows,
}
