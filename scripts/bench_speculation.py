"""Speculative decoding on `tiny`, and its lookups, timed side by side in one run.

Decode: tokens/s with the lookup drafter against without, on the same engine and prompt, greedy
(the outputs are checked equal), with the acceptance rate, for three texts:
- fresh: a random prompt, a clean suffix store (drafts can come only from the output itself);
- repetitive (code editing): the model rewrites text it has in context: the prompt holds the
  model's own earlier answer, then the question again;
- seen: the same request again after the suffix store took in the first (a regenerate, or an
  agent writing out a file it wrote before); the store is a clean one this run filled.
tiny is a random model, so what it writes on its own is not text; the acceptance on fresh text
is the floor, the seen case the ceiling.

Lookups: the persistent suffix store (build_index, and lookup of contexts drawn from the log,
median and p99) at a few log sizes, and the lookup drafter's propose on a growing 32k-token
context. Synthetic token ids (vocabulary 248,320): documents of random spans and of phrases
repeated from a shared pool, so lookups find matches of every length.

    .venv/bin/python scripts/bench_speculation.py [--store-sizes 1e6,1e7,4.8e7] [--store-only]

The spec's target is 0.2 ms a store lookup at 48M tokens (about 22 s to build, NOTES).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import structlog

from tandem.cache.drafter import LookupDrafter
from tandem.cache.suffix import SEPARATOR, PersistentSuffixStore
from tandem.config import load_config
from tandem.engine import Engine, SamplingParams
from tandem.models import load_model

VOCAB = 248_320
DOC_NUM_TOKENS = 2048
CONTEXT_NUM_TOKENS = 16
DRAFT_K = 8
SHA = "0" * 64


def phrase_pool(seed: int = 0) -> list[np.ndarray]:
    """2,000 phrases of 8 to 64 ids, shared by every text below, so they match each other."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(8, 65), dtype=np.uint32) for _ in range(2000)]


def synthetic(num_tokens: int, rng: np.random.Generator, pool: list[np.ndarray]) -> np.ndarray:
    """Half the spans random ids, half phrases from the pool."""
    spans, total = [], 0
    while total < num_tokens:
        if rng.random() < 0.5:
            span = rng.integers(0, VOCAB, rng.integers(8, 65), dtype=np.uint32)
        else:
            span = pool[rng.integers(len(pool))]
        spans.append(span)
        total += len(span)
    return np.concatenate(spans)[:num_tokens]


def percentiles_us(seconds: list[float]) -> tuple[float, float]:
    us = np.array(seconds) * 1e6
    return float(np.median(us)), float(np.percentile(us, 99))


def bench_store(sizes: list[int], lookups: int = 1000, seed: int = 0) -> list[dict]:
    rows = []
    for size in sizes:
        rng = np.random.default_rng(seed)
        ids = synthetic(size, rng, phrase_pool())
        with tempfile.TemporaryDirectory() as tmp:
            cap_mb = max(192.0, 4 * size / (1 << 20) * 1.25)
            store = PersistentSuffixStore(Path(tmp) / "store", tokenizer_sha256=SHA, cap_mb=cap_mb)
            t0 = time.perf_counter()
            for start in range(0, size, DOC_NUM_TOKENS):
                store.add_request(ids[start:start + DOC_NUM_TOKENS], [])
            fill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            index = store.build_index()
            build_s = time.perf_counter() - t0
            store.swap(index, build_s * 1e3)
            log = index.backwards[::-1]  # the log as it was indexed
            times, hits = [], 0
            while len(times) < lookups:
                end = int(rng.integers(CONTEXT_NUM_TOKENS, index.num_tokens))
                context = log[end - CONTEXT_NUM_TOKENS:end].tolist()
                if SEPARATOR in context:
                    continue
                t0 = time.perf_counter()
                draft = store.lookup(context, DRAFT_K)
                times.append(time.perf_counter() - t0)
                hits += bool(draft)
            median_us, p99_us = percentiles_us(times)
            rows.append({"tokens": index.num_tokens, "fill_s": fill_s,
                         "build_s": build_s, "median_us": median_us,
                         "p99_us": p99_us, "hit_pct": 100 * hits / lookups})
    return rows


def bench_drafter(store: PersistentSuffixStore | None, context_num_tokens: int = 32_768,
                  proposals: int = 1000, seed: int = 1) -> dict:
    """One generation: start() on the prompt, then a proposal after every accepted token."""
    ids = synthetic(context_num_tokens, np.random.default_rng(seed), phrase_pool()).tolist()
    prompt_num_tokens = context_num_tokens - proposals
    drafter = LookupDrafter(store)
    t0 = time.perf_counter()
    drafter.start(ids[:prompt_num_tokens])
    start_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for end in range(prompt_num_tokens, context_num_tokens):
        context = ids[:end]  # a list the caller keeps; copying it here is outside the timing
        t0 = time.perf_counter()
        drafter.propose(context, DRAFT_K)
        times.append(time.perf_counter() - t0)
    median_us, p99_us = percentiles_us(times)
    return {"start_ms": start_ms, "median_us": median_us, "p99_us": p99_us,
            **drafter.statistics()}


def _decode_run(engine: Engine, prompt: list[int], max_tokens: int, draft_max: int,
                store: PersistentSuffixStore | None) -> tuple:
    """One greedy generation from a cold engine; (tokens, decode tok/s, drafted, accepted)."""
    engine.resume_at(0)
    speculate = {}
    if draft_max:
        speculate = {"draft": LookupDrafter(store).propose, "draft_max": draft_max}
    result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), **speculate)
    return result.token_ids, result.decode_tok_s, result.drafted, result.accepted


def bench_decode(prompt_num_tokens: int, max_tokens: int, draft_maxes: list[int],
                 home: str) -> list[dict]:
    config = load_config(cli_args={"home": home})
    loaded = load_model("tiny", config.models_dir())
    engine = Engine(loaded.model, window=4 * prompt_num_tokens + 4 * max_tokens,
                    prefix_chunk=config.engine.prefix_chunk)
    vocab = loaded.model.vocab_size
    fresh = np.random.default_rng(7).integers(0, vocab, prompt_num_tokens).tolist()
    answer, _, _, _ = _decode_run(engine, fresh, max_tokens, 0, None)
    texts = {"fresh": fresh, "repetitive": fresh + answer + fresh, "seen": fresh}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = PersistentSuffixStore(Path(tmp) / "store", tokenizer_sha256=SHA)
        for name, prompt in texts.items():
            if name == "seen":  # the first request went into the store
                store.add_request(fresh, answer)
                store.swap(store.build_index())
            plain, plain_tok_s, _, _ = _decode_run(engine, prompt, max_tokens, 0, None)
            for k in draft_maxes:
                out, tok_s, drafted, accepted = _decode_run(engine, prompt, max_tokens, k, store)
                assert out == plain, f"{name}: speculative greedy output differs"
                rows.append({"text": name, "k": k, "plain_tok_s": plain_tok_s, "tok_s": tok_s,
                             "drafted": drafted, "accepted": accepted, "tokens": len(out)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-sizes", default="1e6,1e7", help="log sizes in tokens, e.g. 4.8e7")
    ap.add_argument("--store-only", action="store_true",
                    help="the store's and the drafter's lookups only, no model")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", default="4,8", help="k values of the decode benchmark")
    ap.add_argument("--home", default=None, help="where tiny is written (a temp dir by default)")
    ap.add_argument("--lookups", type=int, default=1000)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings up
    sizes = [int(float(s)) for s in args.store_sizes.split(",")]

    if not args.store_only:
        scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed at the end
        home = args.home or scratch.name
        rows = bench_decode(args.prompt_tokens, args.max_tokens,
                            [int(k) for k in args.draft_max.split(",")], home)
        print(f"decode on tiny, greedy, {args.prompt_tokens}-token prompt, {args.max_tokens} "
              "tokens (outputs checked equal)")
        print(f"{'text':>11} {'k':>3} {'plain tok/s':>12} {'lookup tok/s':>13} {'ratio':>6} "
              f"{'drafted':>8} {'accepted':>9} {'rate':>6}")
        for r in rows:
            rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
            print(f"{r['text']:>11} {r['k']:>3} {r['plain_tok_s']:>12.1f} {r['tok_s']:>13.1f} "
                  f"{r['tok_s'] / r['plain_tok_s']:>6.2f} {r['drafted']:>8} {r['accepted']:>9} "
                  f"{rate:>6.2f}")
        print()

    print(f"{'tokens':>12} {'fill s':>8} {'build s':>8} {'lookup med us':>14} "
          f"{'p99 us':>8} {'hit %':>6}")
    for row in bench_store(sizes, args.lookups):
        print(f"{row['tokens']:>12,} {row['fill_s']:>8.2f} {row['build_s']:>8.2f} "
              f"{row['median_us']:>14.1f} {row['p99_us']:>8.1f} {row['hit_pct']:>6.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        store = PersistentSuffixStore(Path(tmp) / "store", tokenizer_sha256=SHA)
        ids = synthetic(1_000_000, np.random.default_rng(2), phrase_pool())
        for start in range(0, len(ids), DOC_NUM_TOKENS):
            store.add_request(ids[start:start + DOC_NUM_TOKENS], [])
        store.swap(store.build_index())
        print(f"\ndrafter.propose at a 32k context (k={DRAFT_K}, 1,000 proposals, one token "
              "accepted between them)")
        print(f"{'store':>10} {'start ms':>9} {'med us':>8} {'p99 us':>8} {'context':>8} "
              f"{'store':>6} {'miss':>6}")
        for name, attached in (("none", None), ("1M", store)):
            r = bench_drafter(attached)
            print(f"{name:>10} {r['start_ms']:>9.1f} {r['median_us']:>8.1f} {r['p99_us']:>8.1f} "
                  f"{r['hits_context']:>8} {r['hits_store']:>6} {r['misses']:>6}")


if __name__ == "__main__":
    main()
