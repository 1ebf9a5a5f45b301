"""The native GDN decode middle (tandem/kernels/csrc/gdn.c): the conv rows, the recurrent step
rows and the fused layer middle (decode.gdn_rows) against pure-torch references in fp64 to fp32
rounding, and exactly batch-invariant: a sequence's outputs, tail and state are the same bits
alone, at any place of a batch of 1 to 9, on 1, 2 or 3 threads, read and written in place or
from one tensor to another (a verify row and a decode), with decay near 1 (a remembering
model, where a neighbour's state mixed in would show)."""

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import decode, native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

# (hk, hv, dk, dv, K): tiny's; the small test models' (heads repeated to v's); a head dim past
# a multiple of 16 and under one vector (masked lanes); a 0.8B-like layer (the parallel region
# at one row); a 64-wide head (the region from 4 rows on)
DIMS = [(4, 4, 32, 32, 4), (2, 4, 16, 16, 4), (3, 6, 24, 40, 3), (1, 2, 8, 5, 4),
        (16, 16, 128, 128, 4), (4, 4, 64, 64, 4)]
SIZES = (1, 2, 3, 4, 5, 8, 9)


@pytest.fixture(autouse=True)
def _native(native_on):
    yield


class Layer:
    """One GDN layer's decode inputs for ``rows`` sequences, random, decay near 1."""

    def __init__(self, dims, rows: int, seed: int):
        hk, hv, dk, dv, taps = dims
        self.dims, self.taps = (hk, hv, dk, dv), taps
        self.channels = c = 2 * hk * dk + hv * dv
        gen = torch.Generator().manual_seed(seed)
        # the in_proj's output as the model slices it: a, b, mixed, z side by side in a row
        self.proj = torch.randn(rows, 2 * hv + c + hv * dv, generator=gen)
        self.a, self.b, self.mixed, self.z = self.proj.split_with_sizes([hv, hv, c, hv * dv], 1)
        self.tails = torch.randn(rows, c, taps - 1, generator=gen)
        self.states = torch.randn(rows, hv, dk, dv, generator=gen) * 0.5
        self.conv_w = torch.randn(c, taps, generator=gen) * taps ** -0.5
        # -exp(A_log) small and dt_bias low: decay = exp(-softplus(.) * exp(A_log)) near 0.99
        self.neg_a = -torch.rand(hv, generator=gen) * 0.02
        self.dt_bias = torch.randn(hv, generator=gen) - 1.0
        self.norm_w = 1.0 + 0.1 * torch.randn(dv, generator=gen)
        self.scalars = (1e-6, dk ** -0.5, 1e-6)

    def consts(self):
        return (self.conv_w, self.neg_a, self.dt_bias, self.norm_w)

    def run(self, rows: list[int] | None, tails_in, tails_out, states_in, states_out,
            index: list[int] | None = None) -> torch.Tensor:
        """The kernel over ``rows`` gathered (one run of memory each), or with ``index`` over
        the projection's rows where they lie."""
        out = torch.full((self.proj.shape[0], self.dims[1] * self.dims[3]), float("nan"))
        layer = decode.GdnLayer.build(self.consts(), self.dims, self.scalars)
        ops = (self.mixed, self.a, self.b, self.z)
        if index is None:
            ops = tuple(t[rows] for t in ops)
        sections = list(tails_in) + list(tails_out) + list(states_in) + list(states_out)
        assert layer is not None and layer.fits(*ops, sections)
        layer(out, index, *ops, (tails_in, tails_out), (states_in, states_out))
        return out

    def reference(self, r: int):
        """Row r's middle in fp64: (o [hv dv], tail after, state after)."""
        hk, hv, dk, dv = self.dims
        kd = hk * dk
        tail = self.tails[r].double()
        full = torch.cat([tail, self.mixed[r].double()[:, None]], dim=1)
        y = F.silu((full * self.conv_w.double()).sum(-1))
        q, k = y[:kd].view(hk, dk), y[kd:2 * kd].view(hk, dk)
        v = y[2 * kd:].view(hv, dv)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q, k = q.repeat_interleave(hv // hk, 0), k.repeat_interleave(hv // hk, 0)
        decay = torch.exp(self.neg_a.double() * F.softplus(self.a[r].double()
                                                           + self.dt_bias.double()))
        beta = torch.sigmoid(self.b[r].double())
        s = self.states[r].double() * decay[:, None, None]
        delta = (v - torch.einsum("hi,hij->hj", k, s)) * beta[:, None]
        s = s + k[:, :, None] * delta[:, None, :]
        o = torch.einsum("hi,hij->hj", q, s)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-6)
        o = self.norm_w.double() * o * F.silu(self.z[r].double().view(hv, dv))
        return o.reshape(-1), full[:, 1:], s


def _close(got, want, tol=1e-5):
    scale = want.abs().max().item() or 1.0
    assert (got.double() - want).abs().max().item() <= tol * scale, \
        (got.double() - want).abs().max().item()


@pytest.mark.parametrize("dims", DIMS)
def test_the_fused_middle_is_the_layers_arithmetic_to_fp32_rounding(dims):
    layer = Layer(dims, 3, seed=1)
    tails, states = layer.tails.clone(), layer.states.clone()
    out = layer.run([0, 1, 2], list(tails), list(tails), list(states), list(states))
    for r in range(3):
        o, tail, state = layer.reference(r)
        _close(out[r], o)
        _close(tails[r], tail, 0)  # the tail is a copy of inputs: exact
        _close(states[r], state)


@pytest.mark.parametrize("dims", DIMS)
def test_a_sequences_middle_is_the_same_bits_alone_at_any_place_of_any_batch_on_any_threads(
        dims):
    layer = Layer(dims, 10, seed=2)
    tails, states = layer.tails.clone(), layer.states.clone()
    alone = layer.run([0], [tails[0]], [tails[0]], [states[0]], [states[0]])[0]
    want_tail, want_state = tails[0].clone(), states[0].clone()
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for size in SIZES:
                for place in sorted({0, size // 2, size - 1}):
                    rows = list(range(1, size + 1))
                    rows[place] = 0
                    t, s = layer.tails[rows].clone(), layer.states[rows].clone()
                    got = layer.run(rows, list(t), list(t), list(s), list(s))
                    assert torch.equal(got[place], alone), (n_threads, size, place)
                    assert torch.equal(t[place], want_tail) and torch.equal(s[place], want_state)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dims", DIMS[:3])
def test_a_row_read_from_one_state_and_written_to_another_is_the_decodes_bits(dims):
    """A verify row reads the state its row before left and writes its own copy; a decode
    advances its state in place: the same arithmetic, and the state read stays as it was."""
    layer = Layer(dims, 4, seed=3)
    tails, states = layer.tails.clone(), layer.states.clone()
    in_place = layer.run([0, 1, 2, 3], list(tails), list(tails), list(states), list(states))
    t_out, s_out = torch.empty_like(tails), torch.empty_like(states)
    # rows read where they lie (an index, as a ragged wave), out of order
    order = [2, 0, 3, 1]
    apart = layer.run(None, [layer.tails[r] for r in order], list(t_out),
                      [layer.states[r] for r in order], list(s_out), index=order)
    assert torch.equal(apart, in_place)
    for j, r in enumerate(order):
        assert torch.equal(t_out[j], tails[r]) and torch.equal(s_out[j], states[r])


def test_decay_near_one_keeps_the_state_and_the_native_step_stays_close_over_many_tokens():
    """A remembering model: over 64 tokens on one state, the fp32 kernel stays within fp32
    rounding of the fp64 recurrence run alongside it (errors carried in the state stay small)."""
    dims = (2, 4, 16, 16, 4)
    layer = Layer(dims, 1, seed=4)
    tails, states = layer.tails.clone(), layer.states.clone()
    ref_tail, ref_state = layer.tails[0].double(), layer.states[0].double()
    gen = torch.Generator().manual_seed(5)
    for _ in range(64):
        layer.proj.copy_(torch.randn(layer.proj.shape, generator=gen))
        out = layer.run([0], [tails[0]], [tails[0]], [states[0]], [states[0]])
        layer.tails[0], layer.states[0] = ref_tail.float(), ref_state.float()
        o, ref_tail, ref_state = layer.reference(0)
        _close(out[0], o, 1e-4)
    _close(states[0], ref_state, 1e-4)
    assert ref_state.abs().max() > 0.1  # the state remembers: decay near 1 kept it


@pytest.mark.parametrize("dims", DIMS[:4])
def test_the_conv_and_recurrent_rows_are_the_torch_paths_arithmetic_and_their_own_bits(dims):
    hk, hv, dk, dv, taps = dims
    gen = torch.Generator().manual_seed(6)
    c = 2 * hk * dk + hv * dv
    x = torch.randn(9, c + 7, generator=gen)[:, 3:3 + c]  # rows apart in memory
    tails = torch.randn(9, c, taps - 1, generator=gen)
    weight = torch.randn(c, taps, generator=gen)
    q = F.normalize(torch.randn(9, hv, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(9, hv, dk, generator=gen), dim=-1)
    v = torch.randn(9, hv, dv, generator=gen)
    decay = 1.0 - 0.01 * torch.rand(9, hv, generator=gen)
    beta = torch.rand(9, hv, generator=gen)
    states = torch.randn(9, hv, dk, dv, generator=gen)

    got_t, want_t = tails.clone(), tails.clone()
    got = decode.causal_conv1d_rows(x, list(got_t), weight)
    decode.set_native(False)
    want = decode.causal_conv1d_rows(x, list(want_t), weight)
    want_s = states.clone()
    want_o = decode.recurrent_gated_delta_rows(q, k, v, decay, beta, list(want_s))
    decode.set_native(True)
    _close(got, want.double())
    assert torch.equal(got_t, want_t)
    got_s = states.clone()
    got_o = decode.recurrent_gated_delta_rows(q, k, v, decay, beta, list(got_s))
    _close(got_o, want_o.double())
    _close(got_s, want_s.double())

    # each row its own bits: row 4 alone
    t4, s4 = tails[4:5].clone(), states[4:5].clone()
    assert torch.equal(decode.causal_conv1d_rows(x[4:5], list(t4), weight)[0], got[4])
    o4 = decode.recurrent_gated_delta_rows(q[4:5], k[4:5], v[4:5], decay[4:5], beta[4:5],
                                           list(s4))
    assert torch.equal(o4[0], got_o[4]) and torch.equal(s4[0], got_s[4])


def test_a_pad_row_is_a_copy_of_row_0_as_on_the_torch_path():
    gen = torch.Generator().manual_seed(7)
    x, tails, w = torch.randn(2, 48, generator=gen), torch.randn(1, 48, 3), torch.randn(48, 4)
    y = decode.causal_conv1d_rows(x, [tails[0]], w)
    assert y.shape == (2, 48) and torch.equal(y[1], y[0])


def test_the_kernels_silu_is_within_4_ulp_and_keeps_inf_and_nan():
    """silu through the kernel's own e^x, on the conv with one tap of weight 1 (y = x): within
    4 fp32 ulp of x / (1 + e^-x) in fp64 over [-88, 100] (e^-x finite in fp32), -0 past it as
    fp32's e^-x overflows, inf at inf, NaN at NaN."""
    xs = torch.cat([torch.linspace(-88, 100, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30]),
                    torch.tensor([-90.0, -200.0, float("inf"), float("nan")])])
    n = xs.numel()
    y = decode.causal_conv1d_rows(xs[None], [torch.zeros(n, 0)], torch.ones(n, 1))[0]
    x64 = xs[:-4].double()
    want = (x64 / (1 + torch.exp(-x64))).float()
    ulp = torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()
    err = (y[:-4].double() - want.double()).abs()
    assert (err <= 4 * ulp.double()).all(), float((err / ulp.double()).max())
    assert y[-4] == 0 and y[-3] == 0 and y[-2] == float("inf") and torch.isnan(y[-1])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from small_hybrid import make_small_hybrid
    from tandem.models.hybrid import HybridModel

    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(params=["small", "qwen3_next_dir"])
def hybrid(request):
    from tandem.models.hybrid import HybridModel

    if request.param == "small":
        return request.getfixturevalue("small")
    return HybridModel.load(request.getfixturevalue(request.param))


def test_the_models_decode_runs_the_native_middle_within_rounding_of_the_torch_middle(
        hybrid, monkeypatch):
    """On the small hybrid (decay near 0.98) and Qwen3-Next's grouped projections (heads
    repeated to v's): every GDN layer of every step runs the native middle, and 8 steps stay
    within 1e-4 of the largest logit of the same steps on the torch middle, greedy alike. On
    the layer-by-layer step: the whole-step call (test_native_step.py) is its bits."""
    from tandem.kernels import step as native_step

    monkeypatch.setattr(native_step, "_enabled", False)
    calls = []
    real = decode.GdnLayer.__call__
    monkeypatch.setattr(decode.GdnLayer, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    prompt = torch.randint(0, hybrid.vocab_size, (20,), generator=torch.Generator().manual_seed(9))
    runs = {}
    with torch.inference_mode():
        for middle in ("native", "torch"):
            if middle == "torch":
                monkeypatch.setattr(type(hybrid), "_gdn_native", lambda self, i: None)
            state = hybrid.new_state(64)
            tok, rows = int(torch.argmax(hybrid.forward(state, prompt, 0))), []
            for pos in range(20, 28):
                rows.append(hybrid.forward(state, torch.tensor([tok]), pos, decode=True)[0])
                tok = int(torch.argmax(rows[-1]))
            runs[middle] = torch.stack(rows)
            if middle == "native":
                assert len(calls) == 8 * len(hybrid.gdn_layers)
                calls.clear()
    assert not calls
    native_rows, torch_rows = runs["native"], runs["torch"]
    assert torch.equal(native_rows.argmax(-1), torch_rows.argmax(-1))
    assert float((native_rows - torch_rows).abs().max() / torch_rows.abs().max()) <= 1e-4
