"""The Triton causal conv1d (tandem.kernels.triton_conv) against the torch references, under the
interpreter on a CPU (issue 20, part 2): outputs allclose (1e-5 in fp32; 2e-2, one or two bf16
ulps, in bf16: the taps' fp32 sum rounds to bf16 before the SiLU), tails torch.equal (they are
moved, not computed), and the grid gate torch.equal: a prefill in two calls gives the outputs
and the tail of one. 200 channels (two channel blocks, the second part masked), lengths shorter
than the tail and not multiples of the row block."""

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import decode, reference  # noqa: E402
from tandem.kernels import triton_conv  # noqa: E402

C, K = 200, 4


def _inputs(seq_len, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq_len, C, generator=gen).to(dtype)
    tail = torch.randn(C, K - 1, generator=gen).to(dtype)
    # the model's weight is a view of the checkpoint's [C, 1, K]
    weight = torch.randn(C, 1, K, generator=gen)[:, 0, :]
    return x.to(device), tail.to(device), weight.to(device)


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [1, 2, 37])
def test_the_conv_matches_the_reference_and_moves_the_tail(device, seq_len, dtype):
    x, tail, weight = _inputs(seq_len, device, dtype, seed=seq_len)
    want_tail, got_tail = tail.clone(), tail.clone()
    want = reference.causal_conv1d(x, want_tail, weight)
    got = triton_conv.causal_conv1d(x, got_tail, weight)
    assert got.dtype == dtype and got.shape == x.shape
    _close(got, want, dtype)
    assert torch.equal(got_tail, want_tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cut, seq_len", [(16, 32), (37, 50)])
def test_a_conv_cut_anywhere_gives_the_bits_of_one_call(device, cut, seq_len, dtype):
    x, tail, weight = _inputs(seq_len, device, dtype, seed=cut)
    cold_tail, resumed_tail = tail.clone(), tail.clone()
    cold = triton_conv.causal_conv1d(x, cold_tail, weight)
    first = triton_conv.causal_conv1d(x[:cut], resumed_tail, weight)
    rest = triton_conv.causal_conv1d(x[cut:], resumed_tail, weight)
    assert torch.equal(torch.cat([first, rest]), cold)
    assert torch.equal(resumed_tail, cold_tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_step_matches_the_reference_step(device, dtype):
    x, tail, weight = _inputs(3, device, dtype, seed=5)
    want_tail, got_tail = tail.clone(), tail.clone()
    for t in range(3):
        want = reference.causal_conv1d_step(x[t:t + 1], want_tail, weight)
        got = triton_conv.causal_conv1d_step(x[t:t + 1], got_tail, weight)
        _close(got, want, dtype)
        assert torch.equal(got_tail, want_tail)


@pytest.mark.parametrize("rows, seqs", [(2, 1), (3, 3)])
def test_conv_rows_match_the_reference_and_pad_with_row_zero(device, rows, seqs):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, C, generator=gen).to(device)
    tails = [torch.randn(C, K - 1, generator=gen).to(device) for _ in range(seqs)]
    weight = torch.randn(C, K, generator=gen).to(device)
    want_tails, got_tails = [t.clone() for t in tails], [t.clone() for t in tails]
    want = decode.causal_conv1d_rows(x, want_tails, weight)
    got = triton_conv.causal_conv1d_rows(x, got_tails, weight)
    _close(got, want, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got_tails, want_tails))
    assert torch.equal(got[seqs:], got[:1].expand(rows - seqs, -1))
    alone_tail = [tails[-1].clone()]
    alone = triton_conv.causal_conv1d_rows(x[seqs - 1:seqs], alone_tail, weight)
    assert torch.equal(alone[0], got[seqs - 1])
