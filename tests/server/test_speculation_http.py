"""Speculation through the HTTP server: the lookup drafter reads the suffix store the previous
requests wrote, usage.tandem.speculation and the journal say what was drafted and accepted, and
/health reports the store's rebuilds. Gate: greedy (the speculative answer is the plain one)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec

from tandem.config import Config, SpeculationConfig
from tandem.server.app import build_app

MESSAGES = [{"role": "user", "content": "Write the numbers from one to twenty in words."}]


def with_speculation(config: Config, **knobs) -> Config:
    return msgspec.structs.replace(config, speculation=SpeculationConfig(**knobs))


async def chat(session, base, **extra):
    body = {"model": "small", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **extra}
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def indexed(session, base) -> dict:
    """/health once the suffix store's index covers every append (it rebuilds off the engine)."""
    for _ in range(200):
        async with session.get(f"{base}/health") as resp:
            store = (await resp.json())["suffix_store"]
        if store["tokens"] and store["indexed_tokens"] == store["tokens"]:
            return store
        await asyncio.sleep(0.05)
    raise AssertionError(f"the suffix store was never indexed: {store}")


async def test_a_repeated_request_is_drafted_from_the_suffix_store(small_loaded, make_config,
                                                                   serve, tmp_path):
    config = with_speculation(make_config(), speculation="lookup", draft_max=8)
    async with serve(build_app(config, small_loaded)) as server, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        first = await chat(s, base)
        store = await indexed(s, base)
        assert store["state"] == "open" and store["rebuilds"] >= 1
        assert store["rebuild_ms_total"] >= store["rebuild_ms_last"] > 0
        second = await chat(s, base)
        async with s.get(f"{base}/metrics") as resp:
            metrics = await resp.text()
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    spec = second["usage"]["tandem"]["speculation"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0
    accepted = [line for line in metrics.splitlines()
                if line.startswith("tandem_spec_accepted_tokens_total ")]
    total = spec["accepted"] + first["usage"]["tandem"]["speculation"]["accepted"]
    assert accepted and float(accepted[0].split()[1]) == total
    rows = [json.loads(line) for line in config.journal_path().read_text().splitlines()]
    requests = [r for r in rows if r["kind"] == "request"]
    assert (requests[-1]["drafted"], requests[-1]["accepted"]) == (spec["drafted"],
                                                                   spec["accepted"])
    mode = (tmp_path / "home" / "suffix").stat().st_mode & 0o777
    assert mode == 0o700


async def test_speculation_off_gives_the_same_answer_and_drafts_nothing(small_loaded,
                                                                       make_config, serve):
    answers = {}
    for mode in ("off", "lookup"):
        config = with_speculation(make_config(), speculation=mode)
        async with serve(build_app(config, small_loaded)) as server, \
                aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{server.port}"
            answers[mode] = [await chat(s, base) for _ in range(2)]
    for a, b in zip(answers["off"], answers["lookup"]):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert all(r["usage"]["tandem"]["speculation"] == {"drafted": 0, "accepted": 0}
               for r in answers["off"])


async def test_a_store_of_another_tokenizer_is_refused_and_the_server_still_answers(
        small_loaded, make_config, serve, tmp_path):
    suffix = tmp_path / "home" / "suffix"
    suffix.mkdir(parents=True)
    (suffix / "meta.json").write_text(json.dumps({"format": 1, "tokenizer_sha256": "0" * 64}))
    (suffix / "tokens.u32").write_bytes(b"\x01\x00\x00\x00\xff\xff\xff\xff")
    config = with_speculation(make_config(), speculation="lookup")
    async with serve(build_app(config, small_loaded)) as server, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        async with s.get(f"{base}/health") as resp:
            store = (await resp.json())["suffix_store"]
        assert store["state"] == "refused" and "tokenizer" in store["reason"]
        answer = await chat(s, base)
    assert answer["choices"][0]["message"]["content"] is not None
    # The foreign store is left as it was: refused, never overwritten.
    assert (suffix / "tokens.u32").read_bytes() == b"\x01\x00\x00\x00\xff\xff\xff\xff"


async def test_cache_stats_list_the_suffix_store_and_the_store_actors_counters(
        small_loaded, make_config, serve):
    config = with_speculation(make_config(), speculation="lookup")
    async with serve(build_app(config, small_loaded)) as server, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        await chat(s, base)
        await indexed(s, base)
        async with s.get(f"{base}/v1/cache/stats") as resp:
            tiers = (await resp.json())["tiers"]
        async with s.get(f"{base}/v1/actors") as resp:
            actors = [a["name"] for a in (await resp.json())["actors"]]
    assert tiers["suffix"]["state"] == "open" and tiers["suffix"]["tokens"] > 0
    assert tiers["store"]["session_puts"] == 1 and tiers["store"]["leased"] == 0
    assert {"suffix", "store", "engine"} <= set(actors)
