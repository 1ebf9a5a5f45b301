"""Which op a tensor takes (tandem.kernels, issue 20 part 2): an op registered for CUDA serves CUDA
tensors only, so a CPU tensor keeps the reference bit for bit, and a CPU machine serves without
triton (it is never imported there)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import tandem.kernels as kernels
from tandem.kernels import reference


def _boom(*args):
    raise AssertionError("a CUDA op ran on a CPU tensor")


def test_a_cpu_tensor_keeps_the_reference_when_a_cuda_op_is_registered():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(70, 2, 16, generator=gen), torch.randn(70, 2, 16, generator=gen)
    v, g = torch.randn(70, 4, 8, generator=gen), -torch.rand(70, 4, generator=gen)
    beta, state = torch.rand(70, 4, generator=gen), torch.randn(4, 16, 8, generator=gen)
    previous = kernels.register_cuda("chunk_gated_delta_rule", _boom)
    try:
        got_s, want_s = state.clone(), state.clone()
        got = kernels.chunk_gated_delta_rule(q, k, v, g, beta, got_s)
    finally:
        kernels.register_cuda("chunk_gated_delta_rule", previous)
    want = reference.chunk_gated_delta_rule(q, k, v, g, beta, want_s)
    assert torch.equal(got, want) and torch.equal(got_s, want_s)


def test_a_cuda_tensor_takes_the_op_registered_for_cuda_and_else_the_reference():
    cuda_tensor = SimpleNamespace(is_cuda=True)
    previous = kernels.register_cuda("causal_conv1d", _boom)
    try:
        assert kernels._op("causal_conv1d", cuda_tensor) is _boom
    finally:
        kernels.register_cuda("causal_conv1d", previous)
    if previous is None:
        assert kernels._op("causal_conv1d", cuda_tensor) is reference.causal_conv1d


def test_an_unknown_op_cannot_be_registered_for_cuda():
    with pytest.raises(KeyError):
        kernels.register_cuda("no_such_op", _boom)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels import triton")
def test_a_cpu_machine_loads_the_model_code_without_importing_triton():
    code = ("import sys, tandem.kernels, tandem.kernels.planes, tandem.kernels.blocksums, "
            "tandem.models.hybrid; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_every_triton_kernel_is_registered_for_cuda():
    pytest.importorskip("triton")
    from tandem.kernels import triton_conv, triton_gdn, triton_spill
    for module in (triton_conv, triton_gdn, triton_spill):
        for name, fn in module.CUDA_OPS.items():
            assert kernels.cuda_op(name) is fn
