"""The hybrid adapter against transformers, the oracle: fp32 logits within 1e-5 over prompts of
at least 300 tokens (cut at multiples of 64, since transformers restarts its chunk grid at every
call), and identical greedy tokens for 32 decode steps."""

import pytest
import torch
from transformers import DynamicCache

from oracle import VOCAB, cache_kwargs, load_oracle
from tandem.engine import Engine, SamplingParams
from tandem.models.hybrid import HybridModel

PROMPT = 320


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _oracle_greedy(oracle, prompt: list[int], steps: int,
                   device: str = "cpu") -> tuple[torch.Tensor, list[int]]:
    kw = cache_kwargs(oracle, DynamicCache(config=oracle.config))
    with torch.no_grad():
        out = oracle(torch.tensor([prompt], device=device), use_cache=True, **kw)
        first_logits = out.logits[0, -1]
        tokens = []
        logits = first_logits
        for _ in range(steps):
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            out = oracle(torch.tensor([[tok]], device=device), use_cache=True, **kw)
            logits = out.logits[0, -1]
    return first_logits, tokens


@pytest.mark.parametrize("which", ["qwen3_5_dir", "qwen3_next_dir", "qwen3_5_moe_dir"])
def test_prefill_logits_match_transformers_within_1e_5_at_every_cut(which, request):
    path = request.getfixturevalue(which)
    model, oracle = HybridModel.load(path), load_oracle(path)
    prompt = _prompt(1)
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt])).logits[0]
    # A 64-token grid makes every chunk end a cut where transformers' logits are comparable.
    engine = Engine(model, window=1024, prefix_chunk=64)
    seen = []
    engine.prefill(prompt, on_chunk=seen.append)
    assert seen == [64, 128, 192, 256, 320]
    for cut in (64, 128, 320):
        engine.reset()
        logits = engine.prefill(prompt[:cut])
        assert (logits - ref[cut - 1]).abs().max().item() < 1e-5


@pytest.mark.parametrize("which", ["qwen3_5_dir", "qwen3_next_dir", "qwen3_5_moe_dir"])
def test_greedy_decode_writes_the_oracles_tokens_for_32_steps(which, request):
    path = request.getfixturevalue(which)
    model, oracle = HybridModel.load(path), load_oracle(path)
    prompt = _prompt(2)
    _, want = _oracle_greedy(oracle, prompt, 32)
    engine = Engine(model, window=1024, prefix_chunk=128)
    got = engine.generate(prompt, SamplingParams(max_tokens=32)).token_ids
    assert len(set(want)) > 4, "a degenerate oracle run proves little"
    assert got == want


def test_bf16_dense_model_writes_the_oracles_greedy_tokens(qwen3_5_dir):
    model = HybridModel.load(qwen3_5_dir, dtype=torch.bfloat16)
    oracle = load_oracle(qwen3_5_dir, dtype=torch.bfloat16)
    prompt = _prompt(3, 128)
    _, want = _oracle_greedy(oracle, prompt, 16)
    engine = Engine(model, window=512, prefix_chunk=64)
    got = engine.generate(prompt, SamplingParams(max_tokens=16)).token_ids
    assert got == want
