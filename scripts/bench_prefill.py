"""Cold prefill tokens/s on `tiny` and on a random 0.8B-like checkpoint, old path against new.

Both models run through Engine.prefill on the grid (chunks of --prefix-chunk). "old" is the
previous prefill path kept in this script: the chunked delta rule with a Python loop over the
chunks and exp's denormals, the depthwise conv through F.conv1d, and the head over every chunk
(the engine reads the last chunk's alone); "new" is the code as it stands. The attention mask
built once a forward and the token ids' tolist run in both columns. The two alternate in
rounds, the best of --rounds each. On a shared machine use --threads 1: two OpenMP threads
against other processes' load spin-wait (100 tok/s at 1k with a load of 5 on 2 cores).
The 0.8B-like model is drawn with the tests' recipe
(tests/small_hybrid.py: tiny's weights, the long-memory decays) at Qwen3.5-0.8B's shapes:
24 layers (3 GDN : 1 attention), hidden 1,024, fp32, 3.0 GB.

    .venv/bin/python scripts/bench_prefill.py [--tiny 1024,4096,16384] [--big 1024,4096]
        [--rounds 3] [--threads 2]

llama-server's figure on `tiny` (issue 14, a quiet machine, client wall over HTTP): 8,317 tok/s
at 1k, where tandem's server gave 4,686.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem import kernels  # noqa: E402
from tandem.config import load_config  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.kernels.reference import l2norm  # noqa: E402
from tandem.models import load_model  # noqa: E402
from tandem.models.hybrid import HybridConfig, HybridModel  # noqa: E402

BIG_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024,
    "intermediate_size": 3584, "num_hidden_layers": 24,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "dtype": "float32",
}
BIG_CONFIG["layer_types"] = BIG_CONFIG["layer_types"] * 6


# -- the old path, as it was before the prefill work (issue 14, part 4) -----------------------

def old_causal_conv1d(x, tail, weight):
    width = weight.shape[1] - 1
    full = torch.cat([tail.to(x.dtype), x.transpose(0, 1)], dim=1)
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=full.shape[0])[0]
    tail.copy_(full[:, full.shape[1] - width:])
    return F.silu(y).transpose(0, 1)


def old_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64):
    out_dtype = v.dtype
    seq_len = q.shape[0]
    if v.shape[1] != q.shape[1]:
        q = q.repeat_interleave(v.shape[1] // q.shape[1], dim=1)
        k = k.repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    q, k, v = (t.transpose(0, 1).to(torch.float32) for t in (q, k, v))
    g, beta = (t.transpose(0, 1).to(torch.float32) for t in (g, beta))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (-seq_len) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    heads, total, dk = k.shape
    dv = v.shape[-1]
    n = total // chunk_size
    q, k, v = (t.reshape(heads, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(heads, n, chunk_size), beta.reshape(heads, n, chunk_size)
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    g_cum = g.cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_cum.exp().unsqueeze(-1), upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g_cum.exp().unsqueeze(-1)
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)
    chunk_decay = g_cum[..., -1].exp()
    out = torch.empty(heads, n, chunk_size, dv, dtype=torch.float32)
    s = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    out = out.reshape(heads, total, dv)[:, :seq_len]
    return out.transpose(0, 1).to(out_dtype)


class EveryChunkHead:
    """The model as the old engine used it: the head over every chunk's last position."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, state, token_ids, start, **kw):
        kw.pop("logits", None)
        return self.model.forward(state, token_ids, start, **kw)


# -- the run -----------------------------------------------------------------------------------

def _big_model() -> HybridModel:
    from tests.small_hybrid import _long_memory
    from tandem.models.tiny import _weights

    weights = _long_memory(_weights(BIG_CONFIG))
    return HybridModel(HybridConfig.from_dict(BIG_CONFIG),
                       {k.removeprefix("model."): v for k, v in weights.items()})


def _prefill_s(model, prompt: list[int], prefix_chunk: int, old: bool) -> float:
    new_ops = {name: kernels.implementation(name)
               for name in ("causal_conv1d", "chunk_gated_delta_rule")}
    if old:
        kernels.register("causal_conv1d", old_causal_conv1d)
        kernels.register("chunk_gated_delta_rule", old_chunk_gated_delta_rule)
        model = EveryChunkHead(model)
    try:
        engine = Engine(model, window=len(prompt) + 8, prefix_chunk=prefix_chunk)
        t0 = time.perf_counter()
        engine.prefill(prompt)
        return time.perf_counter() - t0
    finally:
        for name, fn in new_ops.items():
            kernels.register(name, fn)


def _bench(label: str, model, lengths: list[int], rounds: int, prefix_chunk: int) -> None:
    for n in lengths:
        prompt = torch.randint(0, 248_000, (n,), generator=torch.Generator().manual_seed(n))
        prompt = prompt.tolist()
        _prefill_s(model, prompt[:min(n, prefix_chunk)], prefix_chunk, False)  # warm-up
        best = {"old": float("inf"), "new": float("inf")}
        for _ in range(rounds):
            for path in ("old", "new"):
                best[path] = min(best[path], _prefill_s(model, prompt, prefix_chunk, path == "old"))
        old_tps, new_tps = n / best["old"], n / best["new"]
        print(f"{label:<10} {n:>7} {old_tps:>11,.0f} {new_tps:>11,.0f} {new_tps / old_tps:>6.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", default="1024,4096,16384", help="prompt lengths on tiny")
    ap.add_argument("--big", default="1024,4096", help="lengths on the 0.8B-like ('' skips it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-rounds", type=int, default=1)
    ap.add_argument("--prefix-chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    tiny = load_model("tiny", load_config(cli_args={"home": scratch.name}).models_dir()).model
    print(f"tandem={Path(kernels.__file__).parents[2]} threads={torch.get_num_threads()} "
          f"prefix_chunk={args.prefix_chunk}, best of {args.rounds} rounds on tiny, "
          f"{args.big_rounds} on 0.8B-like; tokens/s")
    print(f"{'model':<10} {'tokens':>7} {'old tok/s':>11} {'new tok/s':>11} {'ratio':>6}")
    with torch.inference_mode():
        _bench("tiny", tiny, lengths(args.tiny), args.rounds, args.prefix_chunk)
        if lengths(args.big):
            del tiny
            _bench("0.8B-like", _big_model(), lengths(args.big), args.big_rounds,
                   args.prefix_chunk)
    print("llama-server on tiny (issue 14, another machine): 8,317 tok/s at 1k")


if __name__ == "__main__":
    main()
