"""A compaction request served cold against as the continuation of its conversation, side by side
in one process (issue 17; spec: "Compaction as a continuation").

An opencode-shaped session (scripts/make_sessions.py's: its system text, 10 tools,
``x-session-id``, tool loops with results of ``--lines`` lines, a title request) of ``--turns``
tasks of ``--steps`` tool calls each, then its compaction request (the agent's system text, one
user message holding the history as role-marked lines) and the turn after it, replayed in
forced mode (every answer the recorded one) through an in-process server twice:

- ``cold``: ``compaction = client``, the request as sent: its history as text shares nothing
  with the rows (its few tokens aside), so the prefill reads it whole;
- ``continuation``: ``compaction = continue``: the session's rows up to its end anchor, then one
  user turn; the prefill resumes at the end anchor and reads that turn;
- ``prepared``: the compaction preparer writes the summary ahead while the server is idle
  (``--summary-tokens`` of it, with the client's instructions), and the request is answered
  from it without the engine; then a preparation is started again and a request sent while it
  runs: the preparer's yield, against one prefill chunk's time at the cold rate.

Printed: the conversation's size, then for each: the compaction's prompt tokens, tokens
forwarded and TTFT, the turn after it (source, cached), and the ratios cold over continuation.
The default is about the goal size, 32k tokens (on ``tiny`` on two cores: about two minutes a
server); ``--turns 9`` makes it 60k. Ratios, measured side by side: an absolute time on a
shared machine means little.

    .venv/bin/python scripts/bench_compaction.py [--turns 5] [--steps 3] [--lines 120]
        [tandem config flags: --model ... --prefix-chunk ...]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_setup import bench_config  # noqa: E402
from make_sessions import opencode_session  # noqa: E402

from tandem.config import CompactionConfig  # noqa: E402
from tandem.models.chat import encode_chat  # noqa: E402
from tandem.replay.main import replay  # noqa: E402
from tandem.server.compaction import compaction_request  # noqa: E402


def session_rows(turns: int, steps: int, lines: int) -> list[dict]:
    plan = [(steps, lines)] * turns + [(1, lines)]  # the last task is the turn after it
    return opencode_session("bench", 7, plan, compact_after=turns - 1)


def compaction_index(rows: list[dict]) -> int:
    """The compaction request's position among the rows that are requests."""
    requests = [r for r in rows if "body" in r]
    for i, row in enumerate(requests):
        body = row["body"]
        if compaction_request(body["messages"], body.get("tools")) is not None:
            return i
    raise SystemExit("the session has no compaction request")


async def run(rows: list[dict], config: Any, loaded: Any, mode: str) -> dict:
    config = msgspec.structs.replace(config, compaction=CompactionConfig(compaction=mode))
    t = time.perf_counter()
    doc = await replay(rows, config, mode="forced", loaded=loaded)
    doc["wall_s"] = time.perf_counter() - t
    return doc


async def prepared_run(rows: list[dict], config: Any, loaded: Any, at: int,
                       summary_tokens: int) -> dict:
    """The preparer's run, in one server: the session up to its compaction; the client's
    compaction instructions remembered (as after an earlier compaction of this client: the
    preparer writes with the last ones a client sent); an idle wait while the preparer writes
    the summary (``summary_tokens`` of it) at the session's end anchor; then the compaction and
    the turn after it. Also its yield: a preparation started again and a request sent while it
    runs; how long the request waited for it to stop (``yield_ms``)."""
    from tandem.replay.runner import InProcessServer
    from tandem.server.keys import CACHE_STATS, PREPARED, SUPERVISOR
    from tandem.server.sessions import hash_session, load_secret

    config = msgspec.structs.replace(
        config, compaction=CompactionConfig(compaction_idle_s=1.0, compaction_min_tokens=1024),
        server=msgspec.structs.replace(config.server, allow_forced_output=True))
    requests = [r for r in rows if "body" in r]
    body = requests[at]["body"]
    ask = compaction_request(body["messages"], body.get("tools"))
    session = requests[at]["headers"]["x-session-id"]
    async with InProcessServer(config, loaded) as server:
        app = server.app
        preparer = app[SUPERVISOR].actors["compaction_preparer"]
        preparer.max_tokens = summary_tokens
        url = server.base_url + "/v1"
        head = await replay(requests[:at], config, mode="forced", url=url, loaded=loaded)
        prepared = app[PREPARED]
        client = prepared.agent_client(hash_session(session, load_secret(config.home_path())))
        prepared.remember_instructions(client, ask.system, ask.instructions)

        async def counter(name: str) -> int:
            return (await app[CACHE_STATS]())["compaction_preparer"][name]

        t = time.perf_counter()
        while await counter("finished") < 1:
            await asyncio.sleep(0.1)
        written_s = time.perf_counter() - t
        tail = await replay(requests[at:at + 2], config, mode="forced", url=url, loaded=loaded)
        # The yield: the summary of the turn after is started, and a request comes.
        prepared.clear()
        started = await counter("started")
        while await counter("started") <= started:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # into its prefill or decode
        await replay(requests[at + 1:at + 2], config, mode="forced", url=url, loaded=loaded)
        stats = (await app[CACHE_STATS]())["compaction_preparer"]
    return {"turns": head["turns"] + tail["turns"], "written_s": written_s,
            "yield_ms": stats.get("yield_ms_last"), "yielded": stats.get("yielded")}


def _row(name: str, turn: dict | None, after: dict | None) -> str:
    if turn is None:
        return f"| {name} | - | - | - | - | - |"
    return (f"| {name} | {turn['prompt_tokens']} | {turn['reread']} | {turn['ttft_ms']:.0f} | "
            f"{turn['source']} | {after['source'] if after else '-'} "
            f"{after['cached'] if after else ''} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=5, help="tasks before the compaction")
    parser.add_argument("--steps", type=int, default=3, help="tool calls a task")
    parser.add_argument("--lines", type=int, default=120, help="lines a tool result")
    parser.add_argument("--summary-tokens", type=int, default=256,
                        help="tokens the preparer writes of a summary (2,048 in the server)")
    args, config, loaded = bench_config(parser)
    rows = session_rows(args.turns, args.steps, args.lines)
    at = compaction_index(rows)
    requests = [r for r in rows if "body" in r]
    before = requests[at - 1]["body"]
    size = len(encode_chat(loaded.tokenizer, before["messages"], before.get("tools")))
    print(f"model {loaded.name}, prefix_chunk {config.engine.prefix_chunk}, window "
          f"{config.engine.window}; the conversation before its compaction: {size} tokens "
          f"({args.turns} tasks of {args.steps} tool calls, results of {args.lines} lines)\n")
    docs = {}
    for mode, name in (("client", "cold"), ("continue", "continuation")):
        # Each in a fresh home of its own: the spill and the disk tier would bring one run's
        # conversation (or an earlier run's) to the next.
        # (removed after the run: each holds a disk tier and a spill of the conversation)
        with tempfile.TemporaryDirectory(prefix=f"bench-compaction-{name}-") as home:
            docs[name] = asyncio.run(run(rows, msgspec.structs.replace(config, home=home),
                                         loaded, mode))
        print(f"{name}: {docs[name]['wall_s']:.0f} s, errors "
              f"{docs[name]['totals']['errors']}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-compaction-prepared-") as home:
        prepared = asyncio.run(prepared_run(rows, msgspec.structs.replace(config, home=home),
                                            loaded, at, args.summary_tokens))
    print("| compaction | prompt tokens | forwarded | TTFT ms | source | the turn after: "
          "source, cached |\n|---|---:|---:|---:|---|---|")
    picked = {}
    for name, doc in (*docs.items(), ("prepared", prepared)):
        turns = doc["turns"] if doc is not None else None
        picked[name] = turns[at] if turns else None
        print(_row(name, picked[name], turns[at + 1] if turns else None))
    cold, cont = picked["cold"], picked["continuation"]
    print(f"\nforwarded cold / continuation: {cold['reread']} / {cont['reread']} = "
          f"{cold['reread'] / max(cont['reread'], 1):.1f}x; TTFT cold / continuation: "
          f"{cold['ttft_ms']:.0f} / {cont['ttft_ms']:.0f} ms = "
          f"{cold['ttft_ms'] / max(cont['ttft_ms'], 1e-3):.1f}x")
    prep = picked["prepared"]
    chunk = config.engine.prefix_chunk
    chunk_ms = chunk * cold["ttft_ms"] / max(cold["reread"], 1)  # one chunk at the cold rate
    print(f"prepared: TTFT {prep['ttft_ms']:.0f} ms, forwarded {prep['reread']} (the summary "
          f"written in {prepared['written_s']:.1f} s while idle); TTFT cold / prepared "
          f"{cold['ttft_ms'] / max(prep['ttft_ms'], 1e-3):.0f}x")
    if prepared["yield_ms"] is not None:
        print(f"the preparer's yield when a request came: {prepared['yield_ms']:.0f} ms against "
              f"one {chunk}-token prefill chunk's {chunk_ms:.0f} ms at the cold rate "
              f"({prepared['yield_ms'] / chunk_ms:.2f} of it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
