"""Speculation's verify blocks in the batched step, against blocks run alone, side by side in one
run through the HTTP server on `tiny` (issue 14, part 3).

    .venv/bin/python scripts/bench_verify_batch.py [--tokens 64] [--rounds 2]

Four conversations, each first sent once (the suffix store learns its answer, the slots hold its
rows), then sent again: alone (one stream's decode tokens/s) and all four at once (aggregate
decode tokens/s), drafted from the store. Three modes, one server each:

- ``batched``: every slot's decode step and verify block as one forward (forward_ragged);
- ``alone``: the decodes batched, each verify block its own forward_verify beside them (how
  blocks ran before: outside the batch, alone);
- ``off``: speculation off, the decodes batched.

The greedy answers are the same text in every mode (checked). Timings on a shared machine are
noisy: each mode runs ``--rounds`` times, interleaved, and the best round is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_slots import Server, _words  # noqa: E402
from tandem.config import SpeculationConfig  # noqa: E402
from tandem.logs import configure_logging  # noqa: E402
from tandem.models import load_model  # noqa: E402
from tandem.models.hybrid import HybridModel  # noqa: E402

RAGGED = HybridModel.forward_ragged


async def _indexed(server: Server) -> None:
    for _ in range(400):
        async with server.http.get(f"http://127.0.0.1:{server.port}/health") as resp:
            store = (await resp.json()).get("suffix_store") or {}
        if not store or (store.get("tokens") and store["indexed_tokens"] == store["tokens"]):
            return
        await asyncio.sleep(0.05)


async def one_mode(loaded, mode: str, tokens: int, home: str) -> dict:
    if mode == "alone":
        del HybridModel.forward_ragged  # decode_batch falls back: blocks alone
    try:
        server = Server(loaded, 4, 4096, home)
        server.config = msgspec.structs.replace(server.config, speculation=SpeculationConfig(
            speculation="off" if mode == "off" else "lookup", suffix_store=mode != "off"))
        async with server:
            prompts = [f"Story {i}. " + _words(20 + i, 200) for i in range(4)]
            texts = [(await server.complete(p, tokens))["text"] for p in prompts]
            await _indexed(server)
            one = await server.complete(prompts[0], tokens)
            single = (tokens - 1) / ((one["total_ms"] - one["ttft_ms"]) / 1000)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(server.complete(p, tokens) for p in prompts))
            wall = time.perf_counter() - t0
            first = min(r["ttft_ms"] for r in runs) / 1000
            aggregate = 4 * (tokens - 1) / max(wall - first, 1e-9)
            spec = [r["usage"]["tandem"].get("speculation") or {} for r in runs]
            assert [r["text"] for r in runs] == texts, f"{mode}: the answers changed"
            return {"single_tok_s": single, "aggregate_tok_s": aggregate,
                    "drafted": sum(s.get("drafted", 0) for s in spec),
                    "accepted": sum(s.get("accepted", 0) for s in spec), "texts": texts}
    finally:
        HybridModel.forward_ragged = RAGGED


async def main_async(args) -> None:
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    loaded = load_model("tiny", Path(scratch.name) / "models")
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for mode in ("batched", "alone", "off"):
            with tempfile.TemporaryDirectory() as home:
                got = await one_mode(loaded, mode, args.tokens, home)
            if mode not in best or got["aggregate_tok_s"] > best[mode]["aggregate_tok_s"]:
                best[mode] = got
    texts = {m: r.pop("texts") for m, r in best.items()}
    assert len({tuple(t) for t in texts.values()}) == 1, "the modes answered otherwise"
    print("| mode | single tok/s | aggregate tok/s (4 at once) | drafted | accepted |")
    print("|---|---|---|---|---|")
    for mode, r in best.items():
        print(f"| {mode} | {r['single_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} | "
              f"{r['drafted']} | {r['accepted']} |")
    print(f"batched over alone, aggregate: "
          f"{best['batched']['aggregate_tok_s'] / best['alone']['aggregate_tok_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    configure_logging("warning")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
