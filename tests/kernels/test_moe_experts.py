"""The grouped routed experts against a per-expert loop (transformers' order): bit for bit, at a
decode token and at prefill lengths, with experts that receive no token, in fp32 and bf16."""

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.naive import moe_naive


def _inputs(tokens, experts, top_k, hidden=64, inter=48, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    # A skewed router, so that some experts get many tokens and some none.
    logits = torch.randn(tokens, experts, generator=gen) + torch.linspace(0, 3, experts)
    top_w, top_i = torch.topk(logits.softmax(-1), top_k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype)
    return x, gate_up, down, top_w, top_i


@pytest.mark.parametrize("path", ["grouped", "hit-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (1, 64, 8), (7, 8, 2), (300, 64, 8)])
def test_the_routed_experts_equal_a_per_expert_loop_bit_for_bit(tokens, experts, top_k, dtype,
                                                                path, monkeypatch):
    # A ratio every count reaches: grouped_mm whatever the experts hit; 0: the loop over them.
    monkeypatch.setattr(reference, "CPU_LOOP_RATIO", 10 ** 9 if path == "grouped" else 0)
    args = _inputs(tokens, experts, top_k, dtype=dtype)
    got = reference.moe_experts(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert torch.equal(got, moe_naive(*args))


def test_a_decode_token_takes_the_loop_over_its_experts_and_a_prefill_the_grouped_matmuls(
        monkeypatch):
    grouped = []
    real = reference._GROUPED_MM

    def counted(*args, **kwargs):
        grouped.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "_GROUPED_MM", counted)
    reference.moe_experts(*_inputs(1, 256, 8))  # 8 experts of 256 hit
    assert grouped == []
    reference.moe_experts(*_inputs(64, 256, 8))
    assert grouped == [1, 1]


def test_some_experts_receive_no_token_in_the_cases_above():
    _, _, _, _, top_i = _inputs(300, 64, 8)
    assert len(torch.unique(top_i)) < 64


def test_without_a_grouped_gemm_the_loop_over_the_hit_experts_gives_the_same_bits(monkeypatch):
    args = _inputs(50, 16, 4)
    want = moe_naive(*args)
    monkeypatch.setattr(reference, "_GROUPED_MM", None)
    assert torch.equal(reference.moe_experts(*args), want)
