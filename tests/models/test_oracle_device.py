"""The hybrid adapter against transformers on a GPU (issue 20, part 5; skipped without one): both
on the same device, fp32 with TF32 off, prefill logits within 1e-4 at the grid's cuts and the
oracle's greedy tokens for 32 steps, decoded eagerly and through CUDA graphs; the dense model in
bf16, its first greedy tokens. transformers runs its torch path (tests/conftest.py hides
flash-linear-attention, whose kernels multiply fp32 in TF32), with TF32 off."""

import pytest
import torch

from oracle import load_oracle
from tandem.engine import Engine, SamplingParams
from tandem.models.graphs import CudaGraphs, StepGraphs
from tandem.models.hybrid import HybridModel
from test_oracle import _oracle_greedy, _prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODELS = ["qwen3_5_dir", "qwen3_next_dir", "qwen3_5_moe_dir"]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _on_cuda(path, dtype=torch.float32):
    return (HybridModel.load(path, dtype=dtype, device="cuda"),
            load_oracle(path, dtype=dtype).to("cuda"))


def _greedy_on(oracle, prompt, steps):
    """_oracle_greedy with the ids on the oracle's device."""
    return _oracle_greedy(oracle, prompt, steps, "cuda")


@pytest.mark.parametrize("which", MODELS)
def test_prefill_logits_on_cuda_match_transformers_on_cuda(which, request):
    model, oracle = _on_cuda(request.getfixturevalue(which))
    prompt = _prompt(1)
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt], device="cuda")).logits[0].float()
    for cut in (64, 128, 320):
        engine = Engine(model, window=1024, prefix_chunk=64)
        logits = engine.prefill(prompt[:cut])
        assert (logits - ref[cut - 1]).abs().max().item() < 1e-4, cut


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("which", MODELS)
def test_greedy_decode_on_cuda_writes_the_oracles_tokens(which, graphs, request):
    model, oracle = _on_cuda(request.getfixturevalue(which))
    if graphs:
        model.graphs = StepGraphs(CudaGraphs(torch.device("cuda", 0)))
    prompt = _prompt(2)
    _, want = _greedy_on(oracle, prompt, 32)
    engine = Engine(model, window=1024, prefix_chunk=128)
    got = engine.generate(prompt, SamplingParams(max_tokens=32)).token_ids
    assert got == want
    if graphs and model.graphs.takes(model):
        assert model.graphs.counts["replays"] > 0


def test_bf16_dense_model_on_cuda_writes_the_oracles_first_greedy_tokens(qwen3_5_dir):
    model, oracle = _on_cuda(qwen3_5_dir, torch.bfloat16)
    prompt = _prompt(3, 128)
    _, want = _greedy_on(oracle, prompt, 8)
    engine = Engine(model, window=512, prefix_chunk=64)
    got = engine.generate(prompt, SamplingParams(max_tokens=8)).token_ids
    # bf16 on two implementations: the first tokens agree, later ones may part at a near tie
    assert got[:4] == want[:4]
