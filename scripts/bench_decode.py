"""Single-stream decode against the memory-bandwidth bound, on the embedded `tiny` model.

Prints, in one run: the head's matvec (vocab x hidden, fp32) in GB/s through numpy over both
layouts (the bound) and through torch over both (decode reads F.linear over [vocab, hidden]; a
transposed copy reads faster at hidden 256 but costs a second head, which tandem does not
hold); then tiny's decode tokens/s with the GDN conv through F.conv1d (old) and through
causal_conv1d_step (new), alternated in rounds, and each over the model's bytes read at numpy's
rate (the fraction of the bound a token reaches).

    .venv/bin/python scripts/bench_decode.py [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.config import load_config
from tandem.engine import Engine
from tandem.models import load_model


def _median_s(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="matvecs timed a path")
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="tandem-bench-")
    model = load_model("tiny", load_config(cli_args={"home": home}).models_dir()).model
    head = model.w["lm_head.weight"]
    head_t = head.t().contiguous()  # measured only: the model holds no such copy
    held = {t.data_ptr(): t for t in model.w.values()}.values()
    model_bytes = sum(t.numel() * t.element_size() for t in held)
    head_bytes = head.numel() * head.element_size()
    print(f"threads={torch.get_num_threads()} head={tuple(head.shape)} "
          f"model bytes={model_bytes / 1e6:.0f} MB (head {head_bytes / 1e6:.0f} MB)")

    x = torch.randn(1, head.shape[1])
    w_np, wt_np, x_np = head.numpy(), head_t.numpy(), x.numpy()
    with torch.inference_mode():
        paths = {
            "numpy W @ x, W [vocab, hidden] (bound)": lambda: w_np @ x_np[0],
            "numpy x @ Wt, Wt [hidden, vocab] (bound)": lambda: x_np @ wt_np,
            "torch, decode's: F.linear(x, W)": lambda: F.linear(x, head),
            "torch over a copy: torch.mm(x, Wt)": lambda: torch.mm(x, head_t),
        }
        rates = {name: head_bytes / _median_s(fn, args.reps) / 1e9 for name, fn in paths.items()}
    for name, gbs in rates.items():
        print(f"  head {name:44s} {gbs:6.1f} GB/s")
    bound = max(rates["numpy W @ x, W [vocab, hidden] (bound)"],
                rates["numpy x @ Wt, Wt [hidden, vocab] (bound)"])

    engine = Engine(model, window=4096, prefix_chunk=1024)
    prompt = torch.randint(0, 248_000, (1024,), generator=torch.Generator().manual_seed(1))
    new_conv = kernels.implementation("causal_conv1d_step")
    results: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for label in ("old", "new"):
            kernels.register("causal_conv1d_step",
                             kernels.implementation("causal_conv1d") if label == "old"
                             else new_conv)
            engine.reset()
            engine.prefill(prompt.tolist())
            engine.decode(100)  # warm
            t0 = time.perf_counter()
            for i in range(args.tokens):
                engine.decode(101 + i)
            results[label].append(args.tokens / (time.perf_counter() - t0))
    kernels.register("causal_conv1d_step", new_conv)
    bound_tok_s = bound * 1e9 / model_bytes
    print(f"decode at 1k context, {args.rounds} rounds of {args.tokens} tokens, alternated; "
          f"the bound: {model_bytes / 1e6:.0f} MB at {bound:.1f} GB/s = {bound_tok_s:.1f} tok/s")
    for label, runs in results.items():
        best = max(runs)
        print(f"  {label}: {' '.join(f'{r:.1f}' for r in runs)} tok/s; best {best:.1f} "
              f"= {best * model_bytes / 1e9:.1f} GB/s, {best / bound_tok_s:.2f} of the bound")
    print(f"  new over old (best of each): {max(results['new']) / max(results['old']):.2f}x")


if __name__ == "__main__":
    main()
