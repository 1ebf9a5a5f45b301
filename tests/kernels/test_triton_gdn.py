"""The Triton delta-rule kernels (tandem.kernels.triton_gdn) against the torch references, under
the interpreter on a CPU (issue 20, part 2): allclose where the float sums round in another order
(1e-4 on fp32 outputs and states; 2e-2, about two bf16 ulps, on bf16 outputs), torch.equal for the
grid gate (a prefill cut on the grid gives the bits of one uncut call) and for a decode row alone
against the same row in a batch. Several heads (4 value heads on 2 key heads), dv 40 (two
column blocks, the second part masked), lengths that are not multiples of the chunk."""

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import decode, reference  # noqa: E402
from tandem.kernels import triton_gdn  # noqa: E402

HK, HV, DK, DV = 2, 4, 16, 40


def _inputs(seq_len, device, dtype=torch.float32, seed=0, decay_scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, HK, DK, generator=gen)
    k = torch.randn(seq_len, HK, DK, generator=gen)
    v = torch.randn(seq_len, HV, DV, generator=gen)
    g = -torch.rand(seq_len, HV, generator=gen) * decay_scale
    beta = torch.rand(seq_len, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen) * 0.1
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    return [t.to(device) for t in (q, k, v, g, beta, state)]


def _close(got, want, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [1, 37, 130])
def test_the_chunked_kernel_matches_the_reference_output_and_state(device, seq_len, dtype):
    q, k, v, g, beta, state = _inputs(seq_len, device, dtype, seed=seq_len)
    want_s, got_s = state.clone(), state.clone()
    want = reference.chunk_gated_delta_rule(q, k, v, g, beta, want_s)
    got = triton_gdn.chunk_gated_delta_rule(q, k, v, g, beta, got_s)
    assert got.dtype == dtype and got_s.dtype == torch.float32
    _close(got, want, dtype)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)


def test_the_chunked_kernel_floors_fast_decays_as_the_reference_does(device):
    # g near -8 a token: a chunk spans decays down to exp(-500), far under the floor
    q, k, v, g, beta, state = _inputs(100, device, seed=4, decay_scale=16.0)
    want_s, got_s = state.clone(), state.clone()
    want = reference.chunk_gated_delta_rule(q, k, v, g, beta, want_s)
    got = triton_gdn.chunk_gated_delta_rule(q, k, v, g, beta, got_s)
    _close(got, want, torch.float32)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cut, seq_len", [(64, 128), (128, 165)])
def test_a_prefill_cut_on_the_grid_gives_the_bits_of_one_call(device, cut, seq_len, dtype):
    q, k, v, g, beta, state = _inputs(seq_len, device, dtype, seed=cut)
    cold_s, resumed_s = state.clone(), state.clone()
    cold = triton_gdn.chunk_gated_delta_rule(q, k, v, g, beta, cold_s)
    first = triton_gdn.chunk_gated_delta_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut],
                                              resumed_s)
    rest = triton_gdn.chunk_gated_delta_rule(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:],
                                             resumed_s)
    assert torch.equal(torch.cat([first, rest]), cold)
    assert torch.equal(resumed_s, cold_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_matches_the_reference_token_after_token(device, dtype):
    q, k, v, g, beta, state = _inputs(5, device, dtype, seed=7)
    want_s, got_s = state.clone(), state.clone()
    for t in range(5):
        one = [x[t:t + 1] for x in (q, k, v, g, beta)]
        want = reference.recurrent_gated_delta_step(*one, want_s)
        got = triton_gdn.recurrent_gated_delta_step(*one, got_s)
        assert got.shape == (1, HV, DV) and got.dtype == dtype
        _close(got, want, dtype)
        torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_verify_block_keeps_every_positions_state_and_leaves_the_state(device, dtype):
    q, k, v, g, beta, state = _inputs(6, device, dtype, seed=8)
    before = state.clone()
    want, want_states = reference.recurrent_gated_delta_block(q, k, v, g, beta, state.clone())
    got, got_states = triton_gdn.recurrent_gated_delta_block(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    assert got_states.shape == (6, HV, DK, DV) and got_states.dtype == torch.float32
    _close(got, want, dtype)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    # the block's last state is the step's after the same tokens
    s = before.clone()
    for t in range(6):
        triton_gdn.recurrent_gated_delta_step(*[x[t:t + 1] for x in (q, k, v, g, beta)], s)
    torch.testing.assert_close(s, got_states[-1], atol=1e-6, rtol=1e-6)


def _prepared_rows(rows, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = reference.l2norm(torch.randn(rows, HV, DK, generator=gen)) * DK ** -0.5
    k = reference.l2norm(torch.randn(rows, HV, DK, generator=gen))
    v = torch.randn(rows, HV, DV, generator=gen)
    decay = torch.rand(rows, HV, generator=gen)
    beta = torch.rand(rows, HV, generator=gen)
    states = [torch.randn(HV, DK, DV, generator=gen) * 0.1 for _ in range(rows)]
    return [t.to(device) for t in (q, k, v, decay, beta)], [s.to(device) for s in states]


@pytest.mark.parametrize("rows, seqs", [(2, 1), (3, 3)])
def test_decode_rows_match_the_reference_and_pad_with_row_zero(device, rows, seqs):
    (q, k, v, decay, beta), states = _prepared_rows(rows, device, seed=rows)
    want_states = [s.clone() for s in states[:seqs]]
    got_states = [s.clone() for s in states[:seqs]]
    want = decode.recurrent_gated_delta_rows(q, k, v, decay, beta, want_states)
    got = triton_gdn.recurrent_gated_delta_rows(q, k, v, decay, beta, got_states)
    assert got.dtype == torch.float32 and got.shape == (rows, HV, DV)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_states, want_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[seqs:], got[:1].expand(rows - seqs, -1, -1))


def test_a_decode_row_gives_the_same_bits_alone_and_in_a_batch(device):
    (q, k, v, decay, beta), states = _prepared_rows(3, device, seed=11)
    batch_states = [s.clone() for s in states]
    batch = triton_gdn.recurrent_gated_delta_rows(q, k, v, decay, beta, batch_states)
    alone_state = [states[2].clone()]
    alone = triton_gdn.recurrent_gated_delta_rows(q[2:], k[2:], v[2:], decay[2:], beta[2:],
                                                  alone_state)
    assert torch.equal(alone[0], batch[2])
    assert torch.equal(alone_state[0], batch_states[2])
