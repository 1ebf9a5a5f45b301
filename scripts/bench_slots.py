"""Slots against one sequence, side by side in one run, through the HTTP server on `tiny`.

    .venv/bin/python scripts/bench_slots.py [--long 16384] [--turns 8] [--system 3072]
                                            [--parallel 4] [--figures a,b,c] [--rounds 5]
                                            [--llama] [--gguf PATH]

(a) one long prompt, then a new conversation of ``--turns`` turns (each prompt the last plus
    its answer and a ~700-token message): the turns' tokens forwarded over the final
    conversation's tokens (as ../shared/peer/compare.py counts), its floor (every token but the
    answers' forwarded once: 0.98 here, where the 16-token answers are a fiftieth of the text),
    and the sum of the turns' first-token times (llama-server's figures in issue 14, on
    compare.py's agent chat, whose answers are longer: 0.93 and 926 ms; tandem with one
    sequence: 4.34 and 2,842 ms);
(b) A, B, A, B, A, B with a shared ``--system``-token system prompt: tokens re-read on each
    return;
(c) 4 conversations sent at once, each turn carrying the last answer: aggregate decode tokens/s
    over one stream's, the tokens each turn re-read and the last of the four first tokens
    (medians over ``--rounds`` rounds, each the one stream alone and then the four).

With ``--llama``, (c) runs a third time against llama-server (``-np parallel``, its unified KV
buffer) on the GGUF of the same weights that ../shared/peer builds, and prints the two side by
side.

Each figure is measured with ``parallel`` slots and with one, in the same run, each against a
``tandem serve`` of its own (a process apart from this client); prompts are text (random
words), answers greedy, the next turn carries the answer's text as a client does.
Single-stream decode against the bandwidth bound is scripts/bench_decode.py's figure (d), and
memory during a 4k prefill scripts/bench_memory.py's (e).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(os.environ.get("TANDEM_PEER_CACHE") or Path.home() / ".cache" / "tandem-peer")
sys.path.insert(0, str(ROOT))

from tandem.models.tiny import ensure_tiny  # noqa: E402


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 50021}" for i in range(n))


async def sse_docs(resp):
    """The JSON documents of a streamed response's ``data:`` lines."""
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


class Server:
    """``tandem serve`` in a process of its own (the client here shares no interpreter with
    it: in one process the client's parsing took the engine's GIL time, a few ms a token), or
    with ``llama`` (llama-server's binary and the GGUF of the same weights) llama-server with
    ``parallel`` slots (its unified KV buffer), as ../shared/peer/compare.py starts it."""

    def __init__(self, model_dir: Path, parallel: int, window: int, home: str,
                 llama: tuple[str, Path] | None = None):
        self.kind = "tandem" if llama is None else "llama"
        if llama is None:
            self.argv = [sys.executable, "-m", "tandem", "serve", "--model", str(model_dir),
                         "--host", "127.0.0.1", "--parallel", str(parallel), "--window",
                         str(window), "--no-store", "--no-suffix-store", "--log-level",
                         "warning"]
        else:
            binary, gguf = llama
            threads = str(min(os.cpu_count() or 1, 2))
            self.argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "-t", threads, "-tb",
                         threads, "-c", str(window * parallel), "-np", str(parallel), "--jinja",
                         "--no-warmup"]
        self.home = home

    async def __aenter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(self.argv + ["--port", str(self.port)], cwd=ROOT,
                                     env=dict(os.environ, TANDEM_HOME=self.home),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # llama-server (cpp-httplib) closes a kept-alive connection after a few requests, and a
        # request sent on one it just closed fails: a connection a request there
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=3600),
            connector=aiohttp.TCPConnector(force_close=self.kind == "llama"))
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode})")
            try:
                if self.kind == "llama":  # its /v1/models answers while the model loads
                    async with self.http.get(f"http://127.0.0.1:{self.port}/health") as r:
                        if r.status != 200:
                            await asyncio.sleep(0.25)
                            continue
                async with self.http.get(f"http://127.0.0.1:{self.port}/v1/models") as r:
                    if r.status == 200:
                        self.model = (await r.json())["data"][0]["id"]
                        return self
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{self.kind} did not answer")

    async def __aexit__(self, *exc):
        await self.http.close()
        self.proc.terminate()
        self.proc.wait(30)

    async def complete(self, prompt: str, max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft = None
        text, usage, timings = [], None, {}
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/completions",
                                  json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for doc in sse_docs(resp):
                choice = (doc.get("choices") or [None])[0]
                piece = (choice or {}).get("text", "")
                # the first token's event (llama-server's last one carries no text, only its
                # finish_reason)
                if choice is not None and (piece or choice.get("finish_reason") is None):
                    if ttft is None:
                        ttft = (time.perf_counter() - t0) * 1000
                    text.append(piece)
                if doc.get("usage"):
                    usage = doc["usage"]
                timings = doc.get("timings") or timings
        end = (time.perf_counter() - t0) * 1000
        # Prompt tokens the server ran: tandem's usage says so, llama-server's timings
        reread = (usage["tandem"]["cache"]["reread"] if "tandem" in usage
                  else timings.get("prompt_n"))
        return {"text": "".join(text), "usage": usage, "ttft_ms": ttft, "total_ms": end,
                "reread": reread}


async def figure_a(server: Server, long: int, turns: int) -> dict:
    first = await server.complete(_words(1, long * 10 // 59), 8)  # about ``long`` tokens
    prompt = "Hello, let us plan the trip. " + _words(2, 120)
    forwarded, ttft, distinct, decoded = 0, 0.0, 0, 0
    for turn in range(turns):
        r = await server.complete(prompt, 16)
        forwarded += r["reread"]
        ttft += r["ttft_ms"]
        distinct = r["usage"]["prompt_tokens"]
        if turn < turns - 1:  # this answer is in the final conversation
            decoded += r["usage"]["completion_tokens"]
        prompt += r["text"] + f" Turn {turn}: " + _words(3 + turn, 120)
    # As ../shared/peer/compare.py counts it: the turns' forwarded tokens over the final
    # conversation's (the long prompt before them is neither). Its floor: every token but the
    # answers', which the engine decoded, is forwarded once.
    return {"long_tokens": first["usage"]["prompt_tokens"],
            "forwarded_over_distinct": forwarded / distinct,
            "floor": (distinct - decoded) / distinct, "ttft_sum_ms": ttft}


async def figure_b(server: Server, system: int) -> dict:
    head = "System rules. " + _words(7, system // 4)
    texts = {name: head + f" I am {name}. " + _words(ord(name), 120) for name in "AB"}
    reread = []
    for i, name in enumerate("ABABAB"):
        r = await server.complete(texts[name], 8)
        if i >= 2:
            reread.append(r["reread"])
        texts[name] += r["text"] + " Next: " + _words(i, 40)
    return {"reread_per_return": sum(reread) / len(reread)}


async def figure_c(server: Server, rounds: int) -> dict:
    """Each conversation's next turn carries its answer, as a client's does, so that it resumes
    at its end anchor and the four turns decode side by side rather than wait on each other's
    prefill (sending the prompt again without the answer parts from the rows and re-reads the
    whole conversation: three prefills inside the wall). ``rounds`` times: one conversation's
    turn alone (its decode rate: tokens after the first over the time after the first), then
    the four at once (their tokens after the first over the wall after the earliest first
    token); the medians of the rounds, and of each round's ratio (this host's rate drifts by a
    third within minutes, so a single round's ratio swung from 1.7 to 2.5)."""
    prompts = [f"Story {i}. " + _words(20 + i, 200) for i in range(4)]
    for i, p in enumerate(prompts):
        prompts[i] = p + (await server.complete(p, 2))["text"]  # every conversation in place
    singles, aggregates, ratios, reread, last_ttft = [], [], [], [], []
    for r in range(rounds):
        prompts[0] += f" more {r}"
        one = await server.complete(prompts[0], 64)
        prompts[0] += one["text"]
        single = (one["usage"]["completion_tokens"] - 1) / ((one["total_ms"] - one["ttft_ms"])
                                                          / 1000)
        prompts = [p + f" again {r}" for p in prompts]
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(server.complete(p, 64) for p in prompts))
        wall = time.perf_counter() - t0
        prompts = [p + run["text"] for p, run in zip(prompts, runs)]
        first = min(run["ttft_ms"] for run in runs) / 1000
        tokens = sum(run["usage"]["completion_tokens"] - 1 for run in runs)
        aggregate = tokens / max(wall - first, 1e-9)
        singles.append(single)
        aggregates.append(aggregate)
        ratios.append(aggregate / single)
        reread.append(sum(run["reread"] for run in runs) / 4)
        last_ttft.append(max(run["ttft_ms"] for run in runs))
    return {"single_tok_s": statistics.median(singles),
            "aggregate_tok_s": statistics.median(aggregates),
            "aggregate_over_single": statistics.median(ratios),
            "reread_per_turn": statistics.median(reread),
            "last_first_token_ms": statistics.median(last_ttft)}


async def main_async(args) -> None:
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    model_dir = ensure_tiny(Path(scratch.name) / "models")
    figures = set(args.figures.split(","))
    rows = []
    for parallel in (args.parallel, 1):
        with tempfile.TemporaryDirectory() as home:
            async with Server(model_dir, parallel, args.window, home) as server:
                got = {}
                if "a" in figures:
                    got.update(await figure_a(server, args.long, args.turns))
                if "b" in figures:
                    got.update(await figure_b(server, args.system))
                if "c" in figures:
                    got.update(await figure_c(server, args.rounds))
                rows.append((parallel, got))
    print(f"model tiny, window {args.window}; llama-server on the same weights, on compare.py's "
          f"agent chat (issue 14): 0.93 and 926 ms; (a)'s floor is its own workload's\n")
    keys = list(rows[0][1])
    print("| parallel | " + " | ".join(keys) + " |")
    print("|---:|" + "---:|" * len(keys))
    for parallel, got in rows:
        print(f"| {parallel} | " + " | ".join(f"{got[k]:.3f}" if isinstance(got[k], float)
                                               else str(got[k]) for k in keys) + " |")
    (p, slots), (_, one) = rows
    for k in keys:
        if one[k]:
            print(f"{k}: {p} slots / 1 = {slots[k] / one[k]:.3f}")
    if "c" in figures and args.llama:
        binary = os.environ.get("LLAMA_SERVER") or str(PEER / "llama.cpp/build/bin/llama-server")
        gguf = Path(args.gguf or PEER / "models" / f"{model_dir.name}-f32.gguf")
        if not (os.access(binary, os.X_OK) and gguf.is_file()):
            print(f"\n(c) against llama-server: skipped, no {binary} or no {gguf} "
                  "(../shared/peer/README.md says how to build them)")
            return
        with tempfile.TemporaryDirectory() as home:
            async with Server(model_dir, args.parallel, args.window, home,
                              llama=(binary, gguf)) as server:
                theirs = await figure_c(server, args.rounds)
        print(f"\n(c) side by side, {args.parallel} slots each: tandem against llama-server "
              f"(-np {args.parallel}, unified KV) on {gguf.name}\n")
        print("| figure | tandem | llama-server | ratio |\n|---|---:|---:|---:|")
        for k, v in theirs.items():
            ours = slots[k]
            # higher is better for rates and their ratio, lower for re-reads and waits
            ratio = (ours / v if k.endswith(("tok_s", "single")) else v / ours) if v and ours \
                else float("nan")
            print(f"| {k} | {ours:.3f} | {v:.3f} | {ratio:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=3072)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--window", type=int, default=32768)
    ap.add_argument("--figures", default="a,b,c")
    ap.add_argument("--rounds", type=int, default=5, help="(c)'s rounds, their medians printed")
    ap.add_argument("--llama", action="store_true",
                    help="(c) against llama-server too (../shared/peer's build and GGUF)")
    ap.add_argument("--gguf", help="the GGUF of tiny (default: the peer kit's)")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
