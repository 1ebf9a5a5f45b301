"""The day's write budget through the HTTP server, on the small real model: /health shows
cache.disk_writes with the bytes the tier's files took, kept across a restart; past the budget
the server writes nothing to the tier, answers as before, and counts and journals the skip."""

import json

import aiohttp
from test_disk_cache_server import HEAD, _config

from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS


async def _complete(server, sdk, prompt: str):
    return await sdk(server).completions.create(model="small", prompt=prompt, max_tokens=5,
                                                temperature=0)


async def _health(server) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
            assert resp.status == 200
            return await resp.json()


async def test_health_shows_the_bytes_the_written_entries_took_and_keeps_them_across_a_restart(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    for _ in range(2):  # the head read cold in two processes: the second one writes it
        async with serve(build_app(config, small_loaded)) as server:
            await _complete(server, sdk, HEAD)
            first = (await _health(server))["cache"]["disk_writes"]
    async with serve(build_app(config, small_loaded)) as server:
        disk = (await server.app[CACHE_STATS]())["tiers"]["disk"]
        got = (await _health(server))["cache"]["disk_writes"]
    assert disk["anchors"] >= 1 and disk["nbytes"] > 0
    # what the files on the disk hold is what the day counted, saved at the stop
    assert got["tier_nbytes"] == got["today_nbytes"] == disk["nbytes"]
    assert got["today_gb"] == disk["nbytes"] / 10 ** 9
    assert got["spill_nbytes"] == 0 and got["skips"] == {"tier": 0, "spill": 0}
    assert (got["budget_gb"], got["level"]) == (200.0, "ok")
    assert len(got["days"]) == 14 and got["days"][got["date"]]["tier_nbytes"] == disk["nbytes"]
    assert first["level"] == "ok"
    assert (config.disk_cache_path() / "writes.json").stat().st_mode & 0o777 == 0o600


async def test_past_the_budget_the_tier_writes_nothing_and_the_skip_is_counted_and_journaled(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, disk_write_budget_gb=0)
    for _ in range(2):
        async with serve(build_app(config, small_loaded)) as server:
            answer = await _complete(server, sdk, HEAD)
            assert answer.choices[0].text is not None
            health = await _health(server)
            disk = (await server.app[CACHE_STATS]())["tiers"]["disk"]
    got = health["cache"]["disk_writes"]
    assert disk["writes"] == 0 and disk["chunks"] == disk["anchors"] == 0
    assert got["level"] == "hard" and got["today_nbytes"] == 0
    assert got["skips"]["tier"] >= 1 and set(got["skip_reasons"]["tier"]) == {"hard"}
    rows = [json.loads(line) for line in config.journal_path().read_text().splitlines()]
    skips = [r for r in rows if r.get("task") == "disk_guard"]
    assert skips and all(r["event"] == "skip" and r["detail"]["who"] == "tier" for r in skips)
    assert HEAD[:20] not in json.dumps(skips)
