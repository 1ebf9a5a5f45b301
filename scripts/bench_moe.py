"""Decode speed of a small random Qwen3.5-MoE checkpoint: the grouped experts against loops.

Four implementations of kernels.moe_experts on the same model, prompt and threads, as decode
tokens/s side by side: ``tandem`` (reference.moe_experts as it runs: grouped matmuls, or at
decode a loop over the few experts hit, CPU_LOOP_RATIO choosing), ``grouped`` (the same, always
grouped_mm), ``hit-loop`` (the Python loop over the experts that received tokens that
Qwen3-Next's block ran before) and ``all-loop`` (naive.moe_naive, a loop over every expert, as
transformers' eager experts run). Each shape is a checkpoint transformers writes (a test
dependency: `bash scripts/install.sh --test`). On a machine shared with other work, run it at
one thread: an OpenMP barrier waits on a descheduled thread, and two-thread timings swing 10x.

    .venv/bin/python scripts/bench_moe.py [--shapes 8x2,256x8] [--threads 1] [--decode-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.engine import Engine
from tandem.kernels import reference
from tandem.kernels.naive import moe_naive
from tandem.models.hybrid import HybridModel


def hit_loop(x, gate_up, down, top_w, top_i):
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():
        rows, slot = torch.where(top_i == e)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, down[e]) * top_w[rows, slot, None])
    return out


def always_grouped(*args):
    ratio, reference.CPU_LOOP_RATIO = reference.CPU_LOOP_RATIO, 10 ** 9
    try:
        return reference.moe_experts(*args)
    finally:
        reference.CPU_LOOP_RATIO = ratio


def make_checkpoint(path: Path, experts: int, top_k: int, hidden: int) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=48, shared_expert_intermediate_size=64,
        initializer_range=0.1)
    Qwen3_5MoeForCausalLM(config).eval().save_pretrained(path)
    return path


def decode_tok_s(model, prompt: list[int], steps: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        engine = Engine(model, window=len(prompt) + steps + 8, prefix_chunk=64)
        logits = engine.prefill(prompt)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = engine.decode(int(torch.argmax(logits)))
        best = min(best, time.perf_counter() - t0)
    return steps / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x2,256x8", help="experts x top-k, comma-separated")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    impls = {"tandem": reference.moe_experts, "grouped": always_grouped, "hit-loop": hit_loop,
             "all-loop": moe_naive}
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} layers=4 "
          f"decode_tokens={args.decode_tokens}")
    print(f"{'experts x k':>12} " + " ".join(f"{name + ' tok/s':>15}" for name in impls)
          + f" {'tandem/hit':>11} {'tandem/all':>11}")
    for shape in args.shapes.split(","):
        experts, top_k = (int(v) for v in shape.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            model = HybridModel.load(make_checkpoint(Path(tmp), experts, top_k, args.hidden))
        rates = {}
        for name, fn in impls.items():
            previous = kernels.register("moe_experts", fn)
            try:
                rates[name] = decode_tok_s(model, prompt, args.decode_tokens)
            finally:
                kernels.register("moe_experts", previous)
        print(f"{shape:>12} " + " ".join(f"{rates[name]:>15.1f}" for name in impls)
              + f" {rates['tandem'] / rates['hit-loop']:>11.2f}"
              + f" {rates['tandem'] / rates['all-loop']:>11.2f}")


if __name__ == "__main__":
    main()
