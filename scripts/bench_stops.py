"""A stopped stream's next turn, side by side in one run, through the HTTP server on `tiny`.

    .venv/bin/python scripts/bench_stops.py [--words 3000] [--rounds 5] [--seen 8]
                                            [--figures off,on] [--llama] [--gguf PATH]

A user presses stop: the client reads ``--seen`` chunks of a streamed answer, stops reading,
closes the connection, and sends the conversation back with the part of the answer it saw and
a new message (Open WebUI and opencode both keep the part answer). The server decoded on
until it saw the close, so its rows hold more of the answer than the copy: no end anchor
serves the next turn.

- ``off``: thinking off; the copy holds the part answer. tandem resumes at the first prompt's
  end (its prompt-end anchor) and forwards the part answer and the new message; with
  ``--no-prompt-end-anchor`` (tandem before it took such a prompt) at the last grid line.
- ``on``: thinking on, stopped inside the reasoning; the copy is an empty answer
  (``<think>\\n\\n</think>\\n\\n``). tandem's end alignment leaves the rows' reasoning out and
  resumes at the end.

Printed for each server: the next turn's prompt tokens the server ran (tandem's
``usage.tandem.cache.reread``, llama-server's ``timings.prompt_n``) and its time to first
token, medians over ``--rounds`` conversations (each a new prompt of ``--words`` words), and
the ratios against tandem. Each server is a process of its own (scripts/bench_slots.py's
``Server``); with ``--llama``, llama-server on the GGUF of the same weights that ../shared/peer
builds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_slots import PEER, Server, _words, sse_docs  # noqa: E402
from tandem.models.tiny import ensure_tiny  # noqa: E402


async def _stream(server: Server, messages: list, thinking: bool, max_tokens: int,
                  seen: int | None) -> dict:
    """A streamed chat; with ``seen``, the client stops after that many chunks with text."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": thinking}}
    t0 = time.perf_counter()
    ttft, content, reasoning, chunks, usage, timings = None, [], [], 0, None, {}
    resp = await server.http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                  json=body)
    try:
        assert resp.status == 200, await resp.text()
        async for doc in sse_docs(resp):
            usage = doc.get("usage") or usage
            timings = doc.get("timings") or timings
            if not doc.get("choices"):
                continue
            delta = doc["choices"][0].get("delta") or {}
            piece = delta.get("content") or ""
            thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if piece or thought:
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000
                content.append(piece)
                reasoning.append(thought)
                chunks += 1
            if seen is not None and chunks >= seen:
                # the server decodes on while the client has not read on; then it stops
                await asyncio.sleep(0.2)
                break
    finally:
        resp.close()
    reread = None
    if usage and "tandem" in usage:
        reread = usage["tandem"]["cache"]["reread"]
    elif timings:
        reread = timings.get("prompt_n")
    return {"content": "".join(content), "reasoning": "".join(reasoning), "ttft_ms": ttft,
            "reread": reread, "usage": usage}


async def figure(server: Server, thinking: bool, words: int, rounds: int, seen: int) -> dict:
    rereads, ttfts, prompts = [], [], []
    for r in range(rounds):
        question = f"Conversation {r}. " + _words(300 + r, words) + "\nWhat do you make of it?"
        messages = [{"role": "user", "content": question}]
        stopped = await _stream(server, messages, thinking, 256, seen)
        await asyncio.sleep(0.5)  # the server sees the close and ends the generation
        # The client's copy: the part answer it saw (with thinking, an empty answer).
        messages += [{"role": "assistant", "content": stopped["content"]},
                     {"role": "user", "content": "Go on, but shorter."}]
        nxt = await _stream(server, messages, thinking, 8, None)
        rereads.append(nxt["reread"])
        ttfts.append(nxt["ttft_ms"])
        prompts.append(nxt["usage"]["prompt_tokens"] if nxt["usage"] else None)
    return {"reread": statistics.median(rereads), "ttft_ms": statistics.median(ttfts),
            "prompt_tokens": statistics.median(p for p in prompts if p is not None)}


async def main_async(args) -> None:
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    model_dir = ensure_tiny(Path(scratch.name) / "models")
    servers = [("tandem", []), ("tandem --no-prompt-end-anchor", ["--no-prompt-end-anchor"])]
    binary = os.environ.get("LLAMA_SERVER") or str(PEER / "llama.cpp/build/bin/llama-server")
    gguf = Path(args.gguf or PEER / "models" / f"{model_dir.name}-f32.gguf")
    if args.llama:
        if os.access(binary, os.X_OK) and gguf.is_file():
            servers.append(("llama-server", None))
        else:
            print(f"llama-server skipped: no {binary} or no {gguf} "
                  "(../shared/peer/README.md says how to build them)\n")
    results: dict[str, dict] = {}
    for name, extra in servers:
        with tempfile.TemporaryDirectory() as home:
            server = (Server(model_dir, 1, args.window, home) if extra is not None
                      else Server(model_dir, 1, args.window, home, llama=(binary, gguf)))
            if extra:
                server.argv += extra
            async with server:
                for fig in args.figures.split(","):
                    results[f"{name}|{fig}"] = await figure(server, fig == "on", args.words,
                                                            args.rounds, args.seen)
    print(f"model {model_dir.name}, {args.words} words a prompt, the client stops after "
          f"{args.seen} chunks; medians over {args.rounds} conversations\n")
    print("| thinking | server | prompt tokens | re-read | TTFT ms | re-read over tandem's | "
          "TTFT over tandem's |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for fig in args.figures.split(","):
        ours = results[f"tandem|{fig}"]
        for name, _ in servers:
            got = results[f"{name}|{fig}"]
            ratio = (got["reread"] / ours["reread"]) if ours["reread"] else float("nan")
            print(f"| {fig} | {name} | {got['prompt_tokens']:.0f} | {got['reread']:.0f} | "
                  f"{got['ttft_ms']:.1f} | {ratio:.2f}x | "
                  f"{got['ttft_ms'] / ours['ttft_ms']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seen", type=int, default=8)
    ap.add_argument("--window", type=int, default=32768)
    ap.add_argument("--figures", default="off,on")
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--gguf")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
