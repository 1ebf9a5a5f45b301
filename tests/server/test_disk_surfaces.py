"""The disk tier's surfaces (issue 15, part 8) through the HTTP server, on the small real model:
its settings read and changed at run time behind the admin token (a bad value is a 400 naming
it; a change holds from the next request), its events in the journal (writes, a hit after a
restart, a failed restore; token counts and key prefixes, never text), and a clear of every
tier that can be emptied from the loop (?tier=all)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import msgspec

from tandem.actors.disk_messages import DrainDisk
from tandem.config import CacheConfig, DiskConfig, SpeculationConfig, SpillConfig
from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS, DISK_WRITER, ENGINE, JOURNAL

HEAD = "You are a careful assistant who keeps a ledger of words. " * 30
OTHER = "Every morning the harbour master counts the boats and the gulls. " * 26
FOLLOW = " Now list three more words."
ADMIN = {"Authorization": "Bearer s3cret"}


def _config(make_config, *, admin_token: str | None = None, cache: CacheConfig | None = None,
            **disk):
    config = make_config(window=4096, **({"admin_token": admin_token} if admin_token else {}))
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"),
        cache=cache or config.cache,
        disk=DiskConfig(**{"disk_cache_min_free_gb": 0, "disk_cache_min_tokens": 128, **disk}),
        # The disk tier alone: the spill would bring a restarted server's conversation back.
        spill=SpillConfig(session_spill="off"))


def _source(resp) -> str:
    return resp.usage.model_extra["tandem"]["cache"]["source"]


async def _complete(server, sdk, prompt: str):
    return await sdk(server).completions.create(model="small", prompt=prompt, max_tokens=3,
                                                temperature=0)


async def _call(server, method: str, path: str, body=None, headers=None):
    url = f"http://127.0.0.1:{server.port}{path}"
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, json=body, headers=headers) as resp:
            return resp.status, await resp.json()


async def _drained(server) -> dict:
    """The disk tier's stats once every job told the writer is written."""
    await server.app[DISK_WRITER].ask(DrainDisk(), 30.0, sender="test")
    return (await server.app[CACHE_STATS]())["tiers"]["disk"]


async def _journaled(server, event: str, timeout_s: float = 1.0, count: int = 1) -> list[dict]:
    """The disk_cache rows of ``event`` once there are ``count``, waiting at most ``timeout_s``
    (the issue's bound for a hit or a failed restore to reach the journal)."""
    async with asyncio.timeout(timeout_s):
        while True:
            rows = [r for r in server.app[JOURNAL].tail(1000)
                    if r.get("task") == "disk_cache" and r.get("event") == event]
            if len(rows) >= count:
                return rows
            await asyncio.sleep(0.02)


def _check_event_rows(rows: list[dict]) -> None:
    for row in rows:
        assert row["kind"] == "memory" and set(row["detail"]) == {"tokens", "key"}, row
        assert re.fullmatch(r"[0-9a-f]{12}", row["detail"]["key"]), row
        assert isinstance(row["detail"]["tokens"], int)


async def test_the_disk_settings_need_the_admin_token_and_a_bad_value_is_a_400_naming_it(
        small_loaded, make_config, serve):
    config = _config(make_config, admin_token="s3cret", disk_cache_min_free_gb=0.001)
    path = "/v1/cache/disk/settings"
    async with serve(build_app(config, small_loaded)) as server:
        status, before = await _call(server, "GET", path, headers=ADMIN)
        assert status == 200
        assert before == {"mode": "on", "budget_gb": 16.0, "ttl_days": 7.0, "admit_after": 2,
                          "min_free_gb": 0.001, "min_free_gb_floor": 0.001}
        status, body = await _call(server, "POST", path, {"budget_gb": 1})
        assert status == 401, body
        status, body = await _call(server, "POST", path, {"budget_gb": 1},
                                   {"Authorization": "Bearer nope"})
        assert status == 403, body
        bad = [({"mode": "sometimes"}, "mode"), ({"budget_gb": -1}, "budget_gb"),
               ({"budget_gb": "8"}, "budget_gb"), ({"ttl_days": 0}, "ttl_days"),
               ({"admit_after": 0}, "admit_after"), ({"admit_after": 1.5}, "admit_after"),
               ({"admit_after": True}, "admit_after"), ({"min_free_gb": 0.0005}, "min_free_gb"),
               # a good field with a bad one: nothing of the set is applied
               ({"mode": "off", "ttl_days": -2}, "ttl_days")]
        for settings, field in bad:
            status, body = await _call(server, "POST", path, settings, ADMIN)
            assert status == 400 and body["error"]["param"] == field, (settings, body)
        for settings in ({}, {"budget": 8}):
            status, body = await _call(server, "POST", path, settings, ADMIN)
            assert status == 400 and body["error"]["code"] == "invalid_disk_settings", body
        assert (await _call(server, "POST", path, [1], ADMIN))[0] == 400
        assert (await _call(server, "GET", path, headers=ADMIN))[1] == before
        status, after = await _call(server, "POST", path,
                                    {"budget_gb": 0.5, "ttl_days": 2, "min_free_gb": 0.25},
                                    ADMIN)
        assert status == 200
        assert after == {**before, "budget_gb": 0.5, "ttl_days": 2.0, "min_free_gb": 0.25}
        disk = (await server.app[CACHE_STATS]())["tiers"]["disk"]
        rows = [r for r in server.app[JOURNAL].tail(100) if r.get("event") == "settings"]
    assert disk["budget_nbytes"] == 500_000_000 and disk["floor_nbytes"] == 250_000_000
    assert disk["ttl_days"] == 2.0
    assert [r["detail"] for r in rows] == [{"budget_gb": 0.5, "ttl_days": 2.0,
                                            "min_free_gb": 0.25}]
    assert rows[0]["kind"] == "memory" and rows[0]["task"] == "disk_cache"


async def test_settings_apply_from_the_next_request_and_the_journal_gets_writes_hits_and_fails(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    path = "/v1/cache/disk/settings"
    async with serve(build_app(config, small_loaded)) as server:
        assert _source(await _complete(server, sdk, HEAD)) == "cold"
        assert (await _drained(server))["writes"] == 0  # read once: admit_after 2 writes nothing
        status, body = await _call(server, "POST", path, {"admit_after": 1})
        assert status == 200 and body["admit_after"] == 1
        assert _source(await _complete(server, sdk, OTHER)) == "cold"
        disk = await _drained(server)
        assert disk["writes"] > 0 and disk["anchors"] == 1, disk  # read once was enough now
        # Every write's row: the journal task moves them in batches, so wait for all of them.
        writes = await _journaled(server, "write", count=disk["writes"])
    assert len(writes) == disk["writes"]
    _check_event_rows(writes)
    assert max(r["detail"]["tokens"] for r in writes) == disk["top_prefixes"][0]["tokens"]

    async with serve(build_app(config, small_loaded)) as server:
        # A restart takes the config's settings again; the tier turned off serves nothing.
        assert (await _call(server, "GET", path))[1]["admit_after"] == 2
        assert (await _call(server, "POST", path, {"mode": "off"}))[0] == 200
        assert _source(await _complete(server, sdk, OTHER + FOLLOW)) == "cold"
        assert (await server.app[CACHE_STATS]())["tiers"]["disk"]["hits"] == 0

    async with serve(build_app(config, small_loaded)) as server:
        got = await _complete(server, sdk, OTHER + FOLLOW)
        hits = await _journaled(server, "hit")  # within a second of the restore
    assert _source(got) == "disk"
    _check_event_rows(hits)
    assert [r["detail"]["tokens"] for r in hits] == [disk["top_prefixes"][0]["tokens"]]

    for file in config.disk_cache_path().rglob("*"):
        if file.is_file() and file.suffix in (".chunk", ".anchor"):
            data = bytearray(file.read_bytes())
            data[-1] ^= 0xFF
            file.write_bytes(bytes(data))
    async with serve(build_app(config, small_loaded)) as server:
        assert _source(await _complete(server, sdk, OTHER + " Then count the gulls.")) == "cold"
        failed = await _journaled(server, "failed_restore")
    _check_event_rows(failed)
    assert len(failed) == 1
    journal = config.journal_path().read_text()
    assert "ledger" not in journal and "harbour" not in journal and "gulls" not in journal


async def test_a_clear_of_all_empties_the_disk_the_store_and_the_response_cache(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, admin_token="s3cret", disk_cache_admit_after=1,
                     cache=CacheConfig(response_cache=True))
    async with serve(build_app(config, small_loaded)) as server:
        await _complete(server, sdk, HEAD)
        await _complete(server, sdk, HEAD)  # the same greedy request: the response cache's
        await _drained(server)
        tiers = (await server.app[CACHE_STATS]())["tiers"]
        assert tiers["disk"]["anchors"] == 1 and tiers["store"]["entries"] > 0, tiers
        assert tiers["response"]["entries"] == 1 and tiers["response"]["hits"] == 1, tiers
        assert (await _call(server, "POST", "/v1/cache/clear?tier=all", {}))[0] == 401
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=all", {}, ADMIN)
        assert status == 200, body
        after = (await server.app[CACHE_STATS]())["tiers"]
        clears = [r for r in server.app[JOURNAL].tail(1000) if r.get("event") == "clear"]
        owners = (await server.app[CACHE_STATS]())["owners"]
        # Nothing left to resume from: the same prompt runs cold.
        got = await _complete(server, sdk, HEAD)
        after_request = (await server.app[CACHE_STATS]())["tiers"]["response"]
    assert body["tier"] == "all"
    assert body["cleared"] == ["resident", "disk", "store", "response", "prepared"]
    assert body["kept"] == []
    assert body["dropped"]["resident"]["rows"] > 0
    assert body["dropped"]["resident"]["resident_nbytes"] > 0
    assert owners["resident"]["anchors"] == [] and owners["resident"]["end"] is None
    assert all(s["rows_in_place"] == 0 for s in after["resident"]["slots"] if s is not None)
    assert _source(got) == "cold"
    assert body["dropped"]["disk"]["files"] == tiers["disk"]["chunks"] + 1
    assert body["dropped"]["store"]["entries"] == tiers["store"]["entries"]
    assert body["dropped"]["response"]["entries"] == 1
    assert after["disk"]["chunks"] == after["disk"]["anchors"] == 0
    assert after["store"]["entries"] == 0 and after["store"]["bytes"] == 0
    assert after["response"]["entries"] == 0 and after["response"]["bytes"] == 0
    assert [(r["task"], r["detail"]) for r in clears] == [
        ("resident", body["dropped"]["resident"]), ("disk_cache", body["dropped"]["disk"]),
        ("store", body["dropped"]["store"]), ("response_cache", body["dropped"]["response"]),
        ("compaction_prepared", {"entries": 0})]
    assert after_request["hits"] == 1  # the same request again went to the engine


async def test_a_clear_of_all_without_a_disk_tier_clears_the_rest_and_disk_is_a_409(
        small_loaded, make_config, serve):
    config = _config(make_config, disk_cache="off")
    async with serve(build_app(config, small_loaded)) as server:
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=all", {})
        assert status == 200, body
        assert body["cleared"] == ["resident", "store", "prepared"]
        assert body["dropped"]["store"]["entries"] == 0
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=disk", {})
        assert status == 409 and body["error"]["code"] == "tier_off"
        status, body = await _call(server, "GET", "/v1/cache/disk/settings")
        assert status == 409 and body["error"]["code"] == "tier_off"


async def test_a_clear_of_all_while_a_request_runs_is_a_409_that_drops_nothing(
        small_loaded, make_config, serve, sdk):
    import asyncio

    config = _config(make_config, admin_token="s3cret")
    async with serve(build_app(config, small_loaded)) as server:
        await _complete(server, sdk, HEAD)
        running = asyncio.create_task(sdk(server).completions.create(
            model="small", prompt=OTHER, max_tokens=300, temperature=0))
        engine = server.app[ENGINE]
        while not engine.snapshot()["requests"]:
            await asyncio.sleep(0.01)
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=all", {}, ADMIN)
        await running
        owners = (await server.app[CACHE_STATS]())["owners"]
    assert status == 409 and body["error"]["code"] == "engine_busy"
    assert owners["resident"]["anchors"], "the clear dropped copies while refusing"
