"""The peek's latency with every tier filled, and the prewarm's restore against a raw read of
the same bytes, side by side in one run (issue 18; spec: "Peek and prewarm").

Three in-process servers in one temporary home, each over the same model:

1. and 2. read a long system text cold, so that its grid lines are admitted to the disk tier;
3. the store off: a conversation on the disk tier's files (a new user turn under that system
   text), one in place (``resident``), one parked (``ram_park``), one on the NVMe
   (``nvme_spill``: parked, then given up to a third) and one never seen (``none``); then the
   state store on in a fourth server for ``ram_snapshot`` (with the store on, a conversation
   the park gave up resumes from its session snapshot, so the two are measured apart).

Each tier's body is peeked ``--peeks`` times: p50 and p99 in milliseconds, and the tier each
answered. Then the NVMe's conversation is prewarmed (the one in place going to the NVMe first)
and its restore time set against a plain read of the entry's files (the same bytes, through the
page cache as they lie). Absolute times on a shared machine mean little; the ratio is the
figure.

    .venv/bin/python scripts/bench_peek.py [--peeks 200] [--words 600]
        [tandem config flags: --model ... --prefix-chunk ...]
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
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_setup import bench_config  # noqa: E402

from tandem.actors import engine_peek  # noqa: E402
from tandem.config import CacheConfig, DiskConfig, SpillConfig  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

SYSTEM = "You are a careful assistant who keeps a ledger of words and answers briefly. "


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5003}" for i in range(n))


class Client:
    def __init__(self, server: Any, model: str) -> None:
        import aiohttp

        self.base = f"http://127.0.0.1:{server.port}"
        self.http = aiohttp.ClientSession()
        self.model = model

    def body(self, messages: list[dict], session: str | None) -> dict:
        doc = {"model": self.model, "messages": messages, "max_tokens": 4, "temperature": 0,
               "chat_template_kwargs": {"enable_thinking": False}}
        if session is not None:
            doc["session_id"] = session
        return doc

    async def post(self, path: str, doc: dict) -> dict:
        async with self.http.post(self.base + path, json=doc) as resp:
            got = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"{path}: {resp.status} {got}")
            return got

    async def chat(self, messages: list[dict], session: str | None) -> list[dict]:
        got = await self.post("/v1/chat/completions", self.body(messages, session))
        content = got["choices"][0]["message"].get("content") or ""
        return messages + [{"role": "assistant", "content": content},
                           {"role": "user", "content": "Go on: " + words(99, 20)}]

    async def close(self) -> None:
        await self.http.close()


async def serving(config: Any, loaded: Any, work) -> Any:
    from aiohttp.test_utils import TestServer

    server = TestServer(build_app(config, loaded), host="127.0.0.1")
    await server.start_server()
    client = Client(server, loaded.name)
    try:
        return await work(client, server)
    finally:
        await client.close()
        await server.close()


def turn(system: str, seed: int, n: int) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": words(seed, n)}]


async def peeks(client: Client, bodies: dict[str, dict], n: int) -> dict[str, dict]:
    out = {}
    for name, doc in bodies.items():
        times, tiers = [], set()
        for _ in range(n):
            t = time.perf_counter()
            got = await client.post("/v1/cache/peek", doc)
            times.append((time.perf_counter() - t) * 1000.0)
            tiers.add(got["tier"])
        times.sort()
        out[name] = {"tiers": sorted(tiers), "p50": statistics.median(times),
                     "p99": times[min(len(times) - 1, int(len(times) * 0.99))],
                     "cached": got["cached_tokens"], "reread": got["reread_tokens"]}
    return out


def raw_read_ms(folder: Path) -> tuple[int, float]:
    """Every block, anchor and end file of the entry, read whole with plain reads (the
    restore reads them all when no block is in place)."""
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(
        ("manifest", "."))]
    t = time.perf_counter()
    nbytes = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 22):
                nbytes += len(chunk)
        finally:
            os.close(fd)
    return nbytes, (time.perf_counter() - t) * 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peeks", type=int, default=200, help="peeks of each tier's body")
    parser.add_argument("--words", type=int, default=600, help="words of a conversation")
    args, config, loaded = bench_config(parser)
    n = args.words
    head = SYSTEM * max(1, n // 12)
    engine_peek.PREWARM_IN_USE_S = 0.0  # the bench's conversations are all recent
    with tempfile.TemporaryDirectory(prefix="bench-peek-") as home:
        base = msgspec.structs.replace(
            config, home=home,
            cache=msgspec.structs.replace(config.cache, store=False),
            engine=msgspec.structs.replace(config.engine, parallel=1),
            disk=msgspec.structs.replace(config.disk, disk_cache="on", disk_cache_min_free_gb=0,
                                         disk_cache_min_tokens=128),
            spill=SpillConfig(session_spill="on", session_spill_min_tokens=64,
                              session_spill_park_min_tokens=64))
        for seed in (1, 2):  # the head read cold twice: admitted to the disk tier
            asyncio.run(serving(base, loaded, lambda c, s, seed=seed: c.chat(
                turn(head, seed, 10), None)))

        async def filled(client: Client, server: Any) -> dict:
            a = await client.chat(turn(SYSTEM, 10, n), "A")  # to the NVMe
            b = await client.chat(turn(SYSTEM, 11, n), "B")  # parked
            c = await client.chat(turn(SYSTEM, 12, n), "C")  # in place
            bodies = {"resident": client.body(c, "C"), "ram_park": client.body(b, "B"),
                      "nvme_spill": client.body(a, "A"),
                      "disk_tier": client.body(turn(head, 3, 10), None),
                      "none": client.body(turn(SYSTEM, 13, n), "D")}
            got = await peeks(client, bodies, args.peeks)
            prewarm = await client.post("/v1/cache/prewarm", bodies["nvme_spill"])
            folder = None
            root = Path(home) / "disk" / "sessions"
            entry = (prewarm.get("restore") or {}).get("entry")
            if entry and root.exists():  # the entry read back (its folder is its id)
                folder = next((p for p in root.iterdir() if p.name.startswith(entry)), None)
            return {"peeks": got, "prewarm": prewarm, "folder": folder}

        third = asyncio.run(serving(base, loaded, filled))
        store = msgspec.structs.replace(
            base, home=home + "-store", cache=msgspec.structs.replace(base.cache, store=True),
            disk=DiskConfig(disk_cache="off"))

        async def snapshot(client: Client, server: Any) -> dict:
            a = await client.chat(turn(SYSTEM, 20, n), "A")
            await client.chat(turn(SYSTEM, 21, n), "B")
            await client.chat(turn(SYSTEM, 22, n), "C")
            return await peeks(client, {"ram_snapshot": client.body(a, "A")}, args.peeks)

        try:
            fourth = asyncio.run(serving(store, loaded, snapshot))
        finally:
            import shutil
            shutil.rmtree(home + "-store", ignore_errors=True)
        raw = raw_read_ms(third["folder"]) if third["folder"] is not None else None
    print(f"model {loaded.name}, prefix_chunk {config.engine.prefix_chunk}, {args.peeks} peeks "
          f"a tier\n")
    print("| body | tier answered | cached | reread | p50 ms | p99 ms |\n"
          "|---|---|---:|---:|---:|---:|")
    for name, row in {**third["peeks"], **fourth}.items():
        print(f"| {name} | {', '.join(row['tiers'])} | {row['cached']} | {row['reread']} | "
              f"{row['p50']:.2f} | {row['p99']:.2f} |")
    pw = third["prewarm"]
    print(f"\nprewarm: {pw.get('prewarmed')} ({pw.get('why', 'read back')})")
    restore = pw.get("restore")
    if restore and raw is not None:
        print(f"restore {restore['nbytes']} bytes in {restore['ms']:.2f} ms "
              f"({restore['blocks_read']} blocks read, {restore['blocks_in_place']} in place); "
              f"a plain read of the entry's {raw[0]} bytes: {raw[1]:.2f} ms; restore / read "
              f"{restore['ms'] / max(raw[1], 1e-3):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
