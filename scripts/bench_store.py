"""The state store's headline on `tiny`, side by side in one run: a shared system prompt of 8k
tokens, then 20 short requests that share it (each its own question after the system prompt).

Time to first token with the store on against off (a ratio, the
modes taking turns request by request). "off" is the engine alone, every
request prefilled cold; "store" is the planner with the store and a resident prefix that keeps no
grid anchors, so that every resume of the shared prompt is the store's (with anchors the rows in
place would serve it first, and the store would never be asked; that column is shown too). Then
the bytes a snapshot costs (its tensors, as reserved) against the adapter's cost() prediction.

    .venv/bin/python scripts/bench_store.py [--system 8192] [--requests 20] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tandem.cache.memory import MemoryAccountant
from tandem.cache.planner import Planner
from tandem.cache.resident import ResidentPrefix
from tandem.cache.store import StateStore, StoreCore
from tandem.engine import Engine, SamplingParams
from tandem.models import load_model

GiB = 1 << 30


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Server:
    def __init__(self, model, window: int, chunk: int, mode: str):
        self.engine = Engine(model, window=window, prefix_chunk=chunk)
        self.planner = None
        if mode == "off":
            return
        budgets = {"anchors": int(2.5 * GiB) if mode == "resident" else 0, "end": GiB,
                   "stash": 0, "park": 0, "pin": 0, "store": 2 * GiB}
        memory = MemoryAccountant(budgets)
        resident = ResidentPrefix(self.engine, memory)
        store = None
        if mode == "store":
            core = StoreCore(memory, entry_nbytes=GiB)
            store = StateStore(self.engine, core, entry_nbytes=GiB)
        self.planner = Planner(resident, store)

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, str, list[int]]:
        first = {}

        def on_token(_):
            first.setdefault("t", time.perf_counter())
            return False

        t0 = time.perf_counter()
        source = "cold"
        if self.planner is not None:
            source = self.planner.begin(prompt, max_tokens, None).source
        else:
            self.engine.reset()
        result = self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens),
                                      on_token=on_token,
                                      on_chunk=self.planner.on_chunk if self.planner else None)
        if self.planner is not None:
            self.planner.finish(list(prompt) + result.token_ids, None)
        return first["t"] - t0, source, result.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--question", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as home:
        model = load_model("tiny", home).model
    v = model.vocab_size
    system = _ids(v, args.system, 0)
    prompts = [system + _ids(v, args.question, 1 + i) for i in range(args.requests)]
    window = args.system + args.question + args.max_tokens + 1
    # The modes take turns request by request, so that a shared machine's drift lands on all.
    results = {mode: ([], [], [], Server(model, window, args.chunk, mode))
               for mode in ("off", "store", "resident")}
    for prompt in prompts:
        for mode, (ttfts, sources, outs, server) in results.items():
            ttft, source, out = server.request(prompt, args.max_tokens)
            ttfts.append(ttft * 1000)
            sources.append(source)
            outs.append(out)
    off = results["off"][2]
    for mode in ("store", "resident"):
        # Prefix resumes are bit-exact: the same greedy tokens as cold, request by request.
        assert results[mode][2] == off, f"{mode}: a request answered differently from cold"
    print(f"tiny, a {args.system}-token system prompt then {args.requests} requests sharing it "
          f"({args.question}-token questions, chunk {args.chunk}, {torch.get_num_threads()} "
          "threads); TTFT in ms")
    print(f"{'caches':<10} {'first':>9} {'rest median':>12} {'rest mean':>10} {'ratio':>7}  sources")
    base = statistics.median(results["off"][0][1:])
    for mode in ("off", "store", "resident"):
        ttfts, sources, _, _ = results[mode]
        rest = statistics.median(ttfts[1:])
        counts = {s: sources.count(s) for s in dict.fromkeys(sources)}
        print(f"{mode:<10} {ttfts[0]:>9.1f} {rest:>12.1f} {statistics.mean(ttfts[1:]):>10.1f} "
              f"{base / rest:>7.1f}x  {counts}")
    store = results["store"][3].planner.store.port  # the core itself here (no actor)
    cost = results["store"][3].engine.cost()
    print("\nsnapshot bytes against cost() prediction")
    print(f"{'kind':<8} {'tokens':>7} {'reserved':>12} {'tensors':>12} {'cost()':>12} {'ratio':>6}")
    for entry in sorted(store._entries.values(), key=lambda e: e.kind)[:3]:
        tensors = entry.sections.nbytes + entry.rows.nbytes
        predicted = cost.snapshot_nbytes(entry.n)
        print(f"{entry.kind:<8} {entry.n:>7} {entry.nbytes:>12,} {tensors:>12,} "
              f"{predicted:>12,} {tensors / predicted:>6.3f}")
    print(f"store: {store.statistics()}")


if __name__ == "__main__":
    main()
