"""The reference ops against naive per-token loops in float64, on fresh random inputs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.kernels import reference
from tandem.kernels.naive import conv_naive, gdn_naive


def _gdn_inputs(seq_len, hk=2, hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, hk, dk, generator=gen)
    k = torch.randn(seq_len, hk, dk, generator=gen)
    v = torch.randn(seq_len, hv, dv, generator=gen)
    g = -torch.rand(seq_len, hv, generator=gen) * 2
    beta = torch.rand(seq_len, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [1, 5, 64, 100, 200])
def test_chunk_rule_matches_the_per_token_loop(seq_len):
    q, k, v, g, beta, state = _gdn_inputs(seq_len)
    want_o, want_s = gdn_naive(q, k, v, g, beta, state)
    s = state.clone()
    o = reference.chunk_gated_delta_rule(q, k, v, g, beta, s)
    assert torch.allclose(o.double(), want_o, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s.double(), want_s, atol=1e-4, rtol=1e-4)


def test_recurrent_step_matches_the_per_token_loop_for_every_token():
    q, k, v, g, beta, state = _gdn_inputs(20, seed=3)
    want_o, want_s = gdn_naive(q, k, v, g, beta, state)
    s = state.clone()
    outs = [reference.recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                 beta[t:t + 1], s) for t in range(20)]
    assert torch.allclose(torch.cat(outs).double(), want_o, atol=1e-5, rtol=1e-5)
    assert torch.allclose(s.double(), want_s, atol=1e-5, rtol=1e-5)


def test_chunk_rule_in_two_pieces_continues_the_state():
    q, k, v, g, beta, state = _gdn_inputs(192, seed=5)
    want_o, want_s = gdn_naive(q, k, v, g, beta, state)
    s = state.clone()
    o1 = reference.chunk_gated_delta_rule(q[:128], k[:128], v[:128], g[:128], beta[:128], s)
    o2 = reference.chunk_gated_delta_rule(q[128:], k[128:], v[128:], g[128:], beta[128:], s)
    assert torch.allclose(torch.cat([o1, o2]).double(), want_o, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s.double(), want_s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq_len", [1, 3, 50])
def test_causal_conv_matches_the_per_token_loop_and_keeps_the_tail(seq_len):
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(seq_len, 12, generator=gen)
    tail = torch.randn(12, 3, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    want_y, want_tail = conv_naive(x, tail, weight)
    t = tail.clone()
    y = reference.causal_conv1d(x, t, weight)
    assert y.is_contiguous()  # the rows the delta rule reads, not a transposed view
    assert torch.allclose(y.double(), want_y, atol=1e-5)
    assert torch.allclose(t.double(), want_tail, atol=0)


def test_the_decode_conv_step_matches_the_per_token_loop_and_keeps_the_tail_token_after_token():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20, 384, generator=gen)
    tail = torch.randn(384, 3, generator=gen)
    weight = torch.randn(384, 4, generator=gen)
    want_y, want_tail = conv_naive(x, tail, weight)
    t = tail.clone()
    y = torch.cat([reference.causal_conv1d_step(x[i:i + 1], t, weight) for i in range(20)])
    assert y.shape == (20, 384)
    assert torch.allclose(y.double(), want_y, atol=1e-5)
    assert torch.equal(t.double(), want_tail)


class _Subnormals(TorchDispatchMode):
    """Records the ops whose float results hold a subnormal value (0 < |x| < 1.2e-38); views and
    uninitialised buffers (torch.empty, read before they are written) are not results."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or "empty" in str(func):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                a = t.abs()
                if bool(((a > 0) & (a < torch.finfo(t.dtype).tiny)).any()):
                    self.ops.append(str(func))
        return out


def test_the_chunk_rule_on_fast_forgetting_decays_forms_no_subnormal_and_matches_the_loop():
    # tiny's recipe: g near -4 a token, so a 64-token chunk spans decays down to exp(-250).
    # Subnormal floats take a CPU's slow path (exp 170x, a multiply 30x); the kernel floors the
    # decays instead, and the result still matches the per-token loop.
    q, k, v, g, beta, state = _gdn_inputs(256, seed=9)
    g = g * 4 - 0.5
    want_o, want_s = gdn_naive(q, k, v, g, beta, state)
    s = state.clone()
    with _Subnormals() as seen:
        o = reference.chunk_gated_delta_rule(q, k, v, g, beta, s)
    assert seen.ops == []
    assert torch.allclose(o.double(), want_o, atol=1e-5, rtol=1e-4)
    assert torch.allclose(s.double(), want_s, atol=1e-5, rtol=1e-4)
