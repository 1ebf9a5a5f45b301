"""Engine speed on the embedded `tiny` model, and tandem against transformers side by side.

Prints prefill tokens/s at each length, decode tokens/s, and, on the same checkpoint and prompt in
the same run, tandem's prefill time over transformers' forward (a ratio; at most 1.0 is the aim).
transformers is a test dependency: `bash scripts/install.sh --test` brings it.

    .venv/bin/python scripts/bench_engine.py [--lengths 1024,8192,32768] [--oracle-max 8192]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tandem.config import load_config
from tandem.engine import Engine
from tandem.models import load_model


def _prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--oracle-max", type=int, default=8192,
                    help="longest prompt also run through transformers (it is slow on a CPU)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    home = args.home or tempfile.mkdtemp(prefix="tandem-bench-")
    config = load_config(cli_args={"home": home})
    loaded = load_model("tiny", config.models_dir())
    vocab = 248_000
    try:
        from transformers import AutoModelForCausalLM

        oracle = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    except ImportError:
        oracle = None
    print(f"threads={torch.get_num_threads()} model=tiny ({loaded.path})")
    print(f"{'tokens':>8} {'tandem s':>9} {'tok/s':>8} {'transformers s':>15} {'ratio':>6}")
    for n in lengths:
        engine = Engine(loaded.model, window=max(lengths) + args.decode_tokens + 8,
                        prefix_chunk=config.engine.prefix_chunk)
        prompt = _prompt(n, vocab)
        t0 = time.perf_counter()
        engine.prefill(prompt)
        t_tandem = time.perf_counter() - t0
        t_oracle = None
        if oracle is not None and n <= args.oracle_max:
            with torch.inference_mode():
                t0 = time.perf_counter()
                oracle(torch.tensor([prompt]), logits_to_keep=1)
                t_oracle = time.perf_counter() - t0
        ratio = f"{t_tandem / t_oracle:6.2f}" if t_oracle else "     -"
        oracle_s = f"{t_oracle:15.2f}" if t_oracle else f"{'-':>15}"
        print(f"{n:8d} {t_tandem:9.2f} {n / t_tandem:8.0f} {oracle_s} {ratio}", flush=True)
    engine = Engine(loaded.model, window=4096, prefix_chunk=config.engine.prefix_chunk)
    engine.prefill(_prompt(1024, vocab))
    t0 = time.perf_counter()
    for i in range(args.decode_tokens):
        engine.decode(100 + i)
    dt = time.perf_counter() - t0
    print(f"decode: {args.decode_tokens / dt:.1f} tok/s at 1k context")


if __name__ == "__main__":
    main()
