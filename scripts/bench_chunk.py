"""The chunk size is a real trade (spec): with the caches on every prefill runs in chunks of
prefix_chunk tokens, so that warm and cold runs do the same arithmetic, and a chunk costs a read
of the weights. A cold prefill of one prompt on `tiny`, in one piece against chunks of 1,024 and
256, side by side in one run (the median of --repeat runs each, ratios to one piece).

    .venv/bin/python scripts/bench_chunk.py [--tokens 2048] [--chunks 0,1024,256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tandem.engine import Engine
from tandem.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunks", default="0,1024,256", help="0: the whole prompt in one piece")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as home:
        model = load_model("tiny", home).model
    prompt = torch.randint(0, model.vocab_size, (args.tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        size = chunk or args.tokens
        engine = Engine(model, window=args.tokens + 1, prefix_chunk=size)
        engine.prefill(prompt[:size])  # warm-up
        times = []
        for _ in range(args.repeat):
            engine.reset()
            t0 = time.perf_counter()
            engine.prefill(prompt)
            times.append((time.perf_counter() - t0) * 1000)
        rows.append(("one piece" if chunk == 0 else f"chunks of {chunk}",
                     -(-args.tokens // size), statistics.median(times)))
    base = rows[0][2]
    print(f"tiny, a {args.tokens}-token cold prefill, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    print(f"{'prefill':<16} {'chunks':>6} {'ms':>9} {'ratio':>6}")
    for name, n, ms in rows:
        print(f"{name:<16} {n:>6} {ms:>9.1f} {ms / base:>6.2f}")


if __name__ == "__main__":
    main()
