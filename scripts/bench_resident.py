"""The resident prefix's headline on `tiny`, side by side in one run.

1. A long prompt sent again and again at each length: time to first token cold, then the
   second time (from the prompt-end anchor: nothing forwarded), their ratio, then once more
   with the prompt-end anchor shed (from the last grid anchor: the last line re-read), and a
   cold run with the prompt-end anchor off (the copy it adds to a cold prefill).
2. A 20-turn agent conversation (each prompt is the previous one, plus its answer, plus a tool
   result): tokens forwarded per turn against tokens new in that turn, caches on against off.

    .venv/bin/python scripts/bench_resident.py [--lengths 8192,16384,32768] [--turns 20]
    (--turns 0: the long prompts alone)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tandem.cache.memory import MemoryAccountant
from tandem.cache.resident import ResidentPrefix
from tandem.config import load_config
from tandem.engine import Engine, SamplingParams
from tandem.models import load_model

GiB = 1 << 30


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Server:
    """The engine with or without its resident prefix, timed to the first token."""

    def __init__(self, model, window: int, chunk: int, caches: bool, prompt_end: bool = True):
        self.engine = Engine(model, window=window, prefix_chunk=chunk)
        budgets = {"anchors": int(2.5 * GiB), "end": GiB, "stash": GiB, "park": 4 * GiB,
                   "pin": 4 * GiB, "prompt_end": GiB}
        self.resident = (ResidentPrefix(self.engine, MemoryAccountant(budgets),
                                        prompt_end_anchor=prompt_end) if caches else None)

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
        """(ttft_s, tokens forwarded, output)"""
        first = {}
        t0 = time.perf_counter()

        def on_token(_):
            first.setdefault("t", time.perf_counter())
            return False

        logits = None
        if self.resident is not None:
            resume = self.resident.begin(prompt, max_tokens)
            start, logits = resume.start, resume.logits
        else:
            self.engine.resume_at(0)
            start = 0
        result = self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens),
                                      on_token=on_token,
                                      on_chunk=self.resident.on_chunk if self.resident else None,
                                      on_prefill=self.resident.on_prefill if self.resident
                                      else None, logits=logits)
        if self.resident is not None:
            self.resident.finish()
        return first["t"] - t0, len(prompt) - start, result.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    config = load_config(cli_args={"home": args.home or scratch.name})
    loaded = load_model("tiny", config.models_dir())
    chunk = config.engine.prefix_chunk
    lengths = [int(x) for x in args.lengths.split(",")]
    window = max(lengths) + 64

    print(f"threads={torch.get_num_threads()} prefix_chunk={chunk}")
    print("1. the same long prompt again")
    print(f"{'tokens':>8} {'cold ttft s':>12} {'again ttft s':>13} {'re-read':>8} {'ratio':>8}"
          f" {'line ttft s':>12} {'re-read':>8} {'ratio':>7} {'cold, off s':>12}")
    # The first prefill of a process at a length pays for its allocations (seen: several
    # times the second's at 16k); no row below measures it.
    Server(loaded.model, window, chunk, caches=True).request(_ids(max(lengths), 0), 4)
    for n in lengths:
        server = Server(loaded.model, window, chunk, caches=True)
        prompt = _ids(n, n)
        cold, _, out = server.request(prompt, 4)
        again, reread, out_again = server.request(prompt, 4)
        assert out_again == out, "the prompt-end resume answered otherwise"
        server.resident.shed("prompt_end", 1)  # as the governor would: the last line is re-read
        line, line_reread, _ = server.request(prompt, 4)
        del server
        off = Server(loaded.model, window, chunk, caches=True, prompt_end=False)
        cold_off, _, _ = off.request(prompt, 4)
        del off
        print(f"{n:8d} {cold:12.2f} {again:13.4f} {reread:8d} {cold / again:8.1f}"
              f" {line:12.3f} {line_reread:8d} {cold / line:7.1f} {cold_off:12.2f}", flush=True)

    if args.turns <= 0:
        return
    print(f"2. a {args.turns}-turn agent conversation (system and tools 6k, tool results 300)")
    rows = []
    for caches in (True, False):
        server = Server(loaded.model, 6144 + args.turns * 400 + 64, chunk, caches=caches)
        prompt = _ids(6000, 1)
        forwarded, new, ttfts = [], [], []
        prev_len = 0
        for turn in range(args.turns):
            ttft, fwd, out = server.request(prompt, 24)
            forwarded.append(fwd)
            new.append(len(prompt) - prev_len)
            ttfts.append(ttft)
            prev_len = len(prompt)
            prompt = prompt + out + _ids(300, 100 + turn)
        rows.append((caches, sum(forwarded), sum(new), statistics.median(ttfts)))
    for caches, fwd, new, ttft in rows:
        print(f"   caches {'on ' if caches else 'off'}: forwarded {fwd:7d} of {new:7d} new tokens "
              f"({fwd / new:5.2f}x), ttft median {ttft:.3f} s")
    print(f"   forwarded off/on: {rows[1][1] / rows[0][1]:.1f}x, "
          f"ttft median off/on: {rows[1][3] / rows[0][3]:.1f}x")


if __name__ == "__main__":
    main()
