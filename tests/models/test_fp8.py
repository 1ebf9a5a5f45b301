"""Native FP8 products (issue 20, part 4; tandem/models/fp8.py). torch 2.13's CPU build runs
torch._scaled_mm on float8_e4m3fn with tensor-wise and row-wise scales (not block-wise), so the
row-wise path runs here for real: each product equals, up to fp32 rounding, the dequantised
weight's product with the activations as they were quantized (the FP8 error is the
activations' alone), and a checkpoint loaded as a device with FP8 matmuls loads it (the CPU
standing in, ``_fp8_on`` patched) keeps its matrices FP8 and answers near the dequantised
model. A CPU load stays what it was (tests/models/test_quant.py holds it bit for bit). On a
GPU with FP8 (capability 8.9 and up; skipped here) the same, on the device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem import devices
from tandem.engine import DecodeStep, Engine, decode_batch
from tandem.kernels import rows_linear
from tandem.models import fp8 as fp8_mod, hybrid
from tandem.models.fp8 import Fp8Weight, dequantized, fp8_linear, quantize_rows
from tandem.models.hybrid import HybridModel
from test_quant import _logits, fp8_dirs  # noqa: F401 (the fixture)

def _cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales: 2.13's does; 2.11's (the
    lent GPU machines' image) takes tensor-wise scales alone, and the CPU tests below skip
    there while the GPU ones run."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


fp8_cpu = pytest.mark.skipif(not _cpu_takes_row_scales(),
                             reason="this torch's CPU _scaled_mm takes no row-wise scales")
fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and devices.has_fp8_matmul(torch.device("cuda", 0))),
    reason="needs a CUDA device with FP8 matmuls")


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0, device="cpu") -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    scale = torch.rand(grid, generator=gen) * 0.01 + 0.001
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    w = (torch.randn(n, k, generator=gen) / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(w.to(device), scale.to(device), block)


def _emulated(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The product the FP8 kernels compute, in fp32: x quantized and dequantised again, times
    the dequantised weight."""
    k, bc = x.shape[-1], w.block[1]
    xq, sx = quantize_rows(x.reshape(-1, k), bc)
    xd = xq.float() * sx.repeat_interleave(bc, 1)[:, :k]
    return F.linear(xd, dequantized(w)).reshape(*x.shape[:-1], -1)


@fp8_cpu
@pytest.mark.parametrize("block", [(24, 40), (128, 128)])
def test_an_fp8_product_is_the_dequantised_weights_with_the_quantized_activations(block):
    w = _weight(200, 300, block)  # partial tiles at both ends
    x = torch.randn(3, 5, 300)
    x[0, 0, :50] = 0  # a group all zeros: scale 1, not a division by 0
    got = fp8_linear(x, w)
    want = _emulated(x, w)
    assert got.shape == (3, 5, 200)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact = F.linear(x, dequantized(w))
    rel = (got - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.05  # the activations' FP8 rounding, and only that
    bias = torch.randn(200)
    assert torch.allclose(fp8_linear(x, w, bias), got + bias, atol=1e-5)


@fp8_cpu
def test_the_models_products_reach_the_fp8_kernels_as_it_writes_them():
    w = _weight(64, 80, (24, 40))
    x = torch.randn(3, 80)
    want = fp8_linear(x, w)
    assert torch.equal(F.linear(x, w), want)
    assert w.t().transposed and tuple(w.t().shape) == (80, 64)
    for rows in (1, 2, 3):  # decode's rows_linear: padded, exact, blocks written into out
        assert torch.allclose(rows_linear(x[:rows], w, w.t()), fp8_linear(x[:rows], w),
                              atol=1e-5, rtol=1e-5)
    assert w.to(torch.bfloat16) is w and w.contiguous() is w  # it stays FP8
    assert w.element_size() == 1 and w.dtype == torch.float8_e4m3fn


@fp8_cpu
def test_a_load_where_the_device_multiplies_fp8_keeps_its_matrices_fp8(fp8_dirs, monkeypatch):
    _, fp8, reference = fp8_dirs
    monkeypatch.setattr(hybrid, "_fp8_on", lambda device: True)
    calls = []
    real = fp8_mod.fp8_linear
    monkeypatch.setattr(fp8_mod, "fp8_linear", lambda *a: calls.append(1) or real(*a))
    model = HybridModel.load(fp8, dtype=torch.float32)
    kept = [n for n, t in model.w.items() if isinstance(t, Fp8Weight)]
    assert len(kept) >= 20
    assert all(t.dtype == torch.float8_e4m3fn for n, t in model.w.items() if n in kept)
    assert not any(isinstance(model.w[n], Fp8Weight)
                   for n in ("embed_tokens.weight", "lm_head.weight"))
    ref = HybridModel.load(reference, dtype=torch.float32)
    assert not any(isinstance(t, Fp8Weight) for t in ref.w.values())
    for got, want in zip(_logits(model), _logits(ref)):
        assert F.cosine_similarity(got, want, dim=0) > 0.97
    assert len(calls) >= len(kept)  # every matrix's product went through the FP8 kernels
    calls.clear()
    engines = [Engine(model, window=256, prefix_chunk=64) for _ in range(3)]
    for i, e in enumerate(engines):
        e.prefill(list(range(10 + i, 40)))
    rows = decode_batch([DecodeStep(e, 5) for e in engines])  # decode's batched products
    alone = Engine(model, window=256, prefix_chunk=64)
    alone.prefill(list(range(10, 40)))
    assert torch.allclose(rows[0], alone.decode(5), atol=1e-4)
    assert calls


def test_a_cpu_load_dequantises_as_it_did(fp8_dirs):
    _, fp8, _ = fp8_dirs
    assert not devices.has_fp8_matmul(torch.device("cpu"))
    model = HybridModel.load(fp8, dtype=torch.float32)
    assert not any(isinstance(t, Fp8Weight) for t in model.w.values())


# -- on a GPU with FP8 -------------------------------------------------------------------------

@fp8_gpu
def test_an_fp8_product_on_the_gpu_is_the_emulated_one():
    for block in ((128, 128), (24, 40)):
        w = _weight(512, 768, block, device="cuda")
        x = torch.randn(7, 768, device="cuda", dtype=torch.bfloat16)
        got = fp8_linear(x, w).float()
        want = _emulated(x.float(), w)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), block  # bf16 out


@fp8_gpu
def test_an_fp8_checkpoint_on_the_gpu_keeps_fp8_and_answers_near_the_dequantised(fp8_dirs):
    _, fp8, reference = fp8_dirs
    model = HybridModel.load(fp8, device="cuda")
    assert sum(isinstance(t, Fp8Weight) for t in model.w.values()) >= 20
    ref = HybridModel.load(reference, device="cuda")
    for got, want in zip(_logits(model), _logits(ref)):
        assert F.cosine_similarity(got.float(), want.float(), dim=0) > 0.97
