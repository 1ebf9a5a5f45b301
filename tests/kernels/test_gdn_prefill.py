"""A GDN layer's prefill middle on the native kernel (csrc/gdn.c, decode.GdnLayer.prefill)
against the reference ops it replaces (reference.causal_conv1d, reference.chunk_gated_delta_rule,
hybrid.gated_rms_norm).

Gates:
- against the reference: the same values within fp32 rounding (another order of the same
  sums), on tiny's heads, repeated key heads, heads that are no multiple of a vector, and a
  0.8B-like head, with long memory (decay near 0.98, the state carries) and fast forgetting
  (decays under the floor inside a block);
- the grid gate: a chunk resumed at a multiple of the block from the state and tail a cold
  run reached there gives the cold run's bits (torch.equal on every output row, the state and
  the tail); a call cut anywhere gives the cold run's bits on the rows before the cut;
- the same bits on one thread as on two.
"""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import decode, native, reference
from tandem.models.hybrid import gated_rms_norm

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

K = 4
EPS = 1e-6


@pytest.fixture(autouse=True)
def _native(native_on):
    yield


def _layer(hk, hv, dk, dv, memory: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    conv_w = torch.randn(c, K, generator=gen) * 0.5
    if memory == "long":  # decays near 0.98 a token
        a_log = torch.log(torch.rand(hv, generator=gen) * 0.3 + 0.01)
        dt_bias = -2.0 + torch.randn(hv, generator=gen) * 0.5
    else:  # tiny's recipe: g about -4 a token, far under the floor within a block
        a_log = torch.randn(hv, generator=gen) * 0.5 + 1.0
        dt_bias = torch.randn(hv, generator=gen) + 1.0
    norm_w = torch.rand(dv, generator=gen) + 0.5
    consts = (conv_w.contiguous(), (-a_log.exp()).contiguous(), dt_bias, norm_w)
    layer = decode.GdnLayer.build(consts, (hk, hv, dk, dv), (1e-6, dk ** -0.5, EPS))
    assert layer is not None
    return layer, consts


def _inputs(T, hk, hv, dk, dv, seed=1):
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    # one projection's rows, as the layer's in_proj lays them: [a | b | qkv | z]
    rows = torch.randn(T, 2 * hv + c + hv * dv, generator=gen)
    a, b = rows[:, :hv], rows[:, hv:2 * hv]
    mixed, z = rows[:, 2 * hv:2 * hv + c], rows[:, 2 * hv + c:]
    tail = torch.randn(c, K - 1, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return mixed, a, b, z, tail, state


def _native_run(layer, mixed, a, b, z, tail, state):
    tail, state = tail.clone(), state.clone()
    out = torch.empty(mixed.shape[0], z.shape[1])
    assert layer.prefill(out, mixed, a, b, z, tail, state)
    return out, tail, state


def _reference_run(consts, dims, mixed, a, b, z, tail, state):
    conv_w, neg_a, dt_bias, norm_w = consts
    hk, hv, dk, dv = dims
    tail, state = tail.clone(), state.clone()
    n = mixed.shape[0]
    y = reference.causal_conv1d(mixed, tail, conv_w)
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    beta = torch.sigmoid(b)
    g = neg_a * F.softplus(a + dt_bias)
    o = reference.chunk_gated_delta_rule(q, k, v, g, beta, state)
    o = gated_rms_norm(o, z.reshape(n, hv, dv), norm_w, EPS)
    return o.reshape(n, hv * dv), tail, state


DIMS = {"tiny": (4, 4, 32, 32), "repeated": (2, 4, 16, 16), "odd": (1, 2, 24, 40),
        "0.8b": (2, 2, 128, 128)}


@pytest.mark.parametrize("memory", ["long", "fast"])
@pytest.mark.parametrize("dims", list(DIMS), ids=list(DIMS))
@pytest.mark.parametrize("T", [1, 5, 64, 200])
def test_against_the_reference(dims, T, memory):
    hk, hv, dk, dv = DIMS[dims]
    layer, consts = _layer(hk, hv, dk, dv, memory)
    inputs = _inputs(T, hk, hv, dk, dv)
    got = _native_run(layer, *inputs)
    want = _reference_run(consts, DIMS[dims], *inputs)
    for name, g, w in zip(("out", "tail", "state"), got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5), \
            (name, float((g - w).abs().max()), float(w.abs().max()))
    assert torch.equal(got[1], want[1])  # the tail is the last K-1 inputs, copied


@pytest.mark.parametrize("dims", ["tiny", "repeated", "odd"])
def test_resumed_on_the_grid_is_the_cold_run(dims):
    hk, hv, dk, dv = DIMS[dims]
    layer, _ = _layer(hk, hv, dk, dv, "long")
    mixed, a, b, z, tail, state = _inputs(320, hk, hv, dk, dv)
    cold, cold_tail, cold_state = _native_run(layer, mixed, a, b, z, tail, state)
    cut = 128
    first, mid_tail, mid_state = _native_run(layer, mixed[:cut], a[:cut], b[:cut], z[:cut],
                                             tail, state)
    rest, end_tail, end_state = _native_run(layer, mixed[cut:], a[cut:], b[cut:], z[cut:],
                                            mid_tail, mid_state)
    assert torch.equal(torch.cat([first, rest]), cold)
    assert torch.equal(end_tail, cold_tail)
    assert torch.equal(end_state, cold_state)
    # a call cut off the grid: the rows before the cut are the cold run's
    for cut in (1, 37, 100, 319):
        part, _, _ = _native_run(layer, mixed[:cut], a[:cut], b[:cut], z[:cut], tail, state)
        assert torch.equal(part, cold[:cut]), cut


def test_the_same_bits_on_one_thread():
    hk, hv, dk, dv = DIMS["tiny"]
    layer, _ = _layer(hk, hv, dk, dv, "long")
    inputs = _inputs(1024, hk, hv, dk, dv)
    two = _native_run(layer, *inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _native_run(layer, *inputs)
    finally:
        torch.set_num_threads(threads)
    for g, w in zip(one, two):
        assert torch.equal(g, w)


def test_remembers():
    """The kernel carries the state: the same rows from another state give other outputs
    (a kernel that dropped the state would pass the comparisons above only by luck)."""
    hk, hv, dk, dv = DIMS["tiny"]
    layer, _ = _layer(hk, hv, dk, dv, "long")
    mixed, a, b, z, tail, state = _inputs(130, hk, hv, dk, dv)
    out, _, _ = _native_run(layer, mixed, a, b, z, tail, state)
    other, _, _ = _native_run(layer, mixed, a, b, z, tail, state * 2)
    assert not torch.allclose(out[-1], other[-1], rtol=1e-3, atol=1e-4)
