"""POST /v1/cache/peek (issue 18, part 2) through the HTTP server, on the small real model: for
every tier (the rows in place, the park, the state store, the session spill, the disk tier,
none) the peek's tier, cached_tokens and reread_tokens are what the next real request's usage
says; the peek changes no counter (/v1/cache/stats before and after are equal); a 409 at once
while a request waits for the engine, after the wait while one runs; the admin rules."""

import asyncio
import time

import aiohttp
import msgspec

from tandem.config import CacheConfig, DiskConfig, SpeculationConfig, SpillConfig
from tandem.server import peek_routes
from tandem.server.app import build_app
from tandem.server.keys import ENGINE

SYSTEM = "You are a careful assistant who keeps a ledger of words and answers briefly. " * 6
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5003}" for i in range(n))


def _config(make_config, *, store: bool = True, disk: bool = True, spill: bool = True,
            **engine):
    config = make_config(window=4096, **engine)
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"),
        cache=CacheConfig(store=store),
        disk=DiskConfig(disk_cache="on" if disk else "off", disk_cache_min_free_gb=0,
                        disk_cache_min_tokens=128),
        spill=SpillConfig(session_spill="on" if spill else "off",
                          session_spill_min_tokens=64, session_spill_park_min_tokens=64))


def body(messages: list[dict], session: str | None) -> dict:
    doc = {"model": "small", "messages": messages, "max_tokens": 6, "temperature": 0,
           **NO_THINKING}
    if session is not None:
        doc["session_id"] = session
    return doc


async def post(server, path: str, doc: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=doc,
                             headers=headers or {}) as resp:
            return resp.status, await resp.json()


async def stats(server) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/v1/cache/stats") as resp:
            return await resp.json()


def _steady(doc):
    """The stats without what moves by itself (the disk's free space, clocks)."""
    if isinstance(doc, dict):
        return {k: _steady(v) for k, v in doc.items()
                if k not in ("free_gb", "free_bytes", "age_s", "at", "now")}
    if isinstance(doc, list):
        return [_steady(v) for v in doc]
    return doc


async def chat(server, sdk, messages: list[dict], session: str | None):
    extra = dict(NO_THINKING)
    if session is not None:
        extra["session_id"] = session
    resp = await sdk(server).chat.completions.create(model="small", messages=messages,
                                                     max_tokens=6, temperature=0,
                                                     extra_body=extra)
    return resp


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


async def peek_then_send(server, sdk, messages: list[dict], session: str | None):
    """The peek of a turn (the stats equal before and after it), then the turn itself."""
    before = _steady(await stats(server))
    status, seen = await post(server, "/v1/cache/peek", body(messages, session))
    assert status == 200, seen
    after = _steady(await stats(server))
    assert before == after, "the peek changed the stats"
    resp = await chat(server, sdk, messages, session)
    got = _cache(resp)
    assert (seen["tier"], seen["cached_tokens"], seen["reread_tokens"]) == \
        (got["tier"], got["cached"], got["reread"]), (seen, got)
    assert seen["slot"] == got["slot"] and seen["tokens"] == got["cached"] + got["reread"]
    assert seen["reread_eta_ms"] >= seen["restore_ms"] >= 0
    return seen, resp


def _turn(seed: int, n: int = 150) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _words(seed, n)}]


def _next(messages: list[dict], resp, seed: int) -> list[dict]:
    return messages + [{"role": "assistant", "content": resp.choices[0].message.content or ""},
                       {"role": "user", "content": "Go on: " + _words(seed, 20)}]


async def test_a_fresh_server_peeks_none_and_the_rows_in_place_resident(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, disk=False, spill=False)
    async with serve(build_app(config, small_loaded)) as server:
        first = _turn(1)
        seen, resp = await peek_then_send(server, sdk, first, "a")
        assert seen["tier"] == "none" and seen["cached_tokens"] == 0
        assert seen["session"] is not None and seen["restore_ms"] == 0
        second = _next(first, resp, 2)
        seen, resp = await peek_then_send(server, sdk, second, "a")
        assert seen["tier"] == "resident" and _cache(resp)["source"] == "end"
        # The same prompt again (a retry): the prompt-end anchor, nothing to re-read.
        seen, resp = await peek_then_send(server, sdk, second, "a")
        assert _cache(resp)["source"] == "prompt_end" and seen["reread_tokens"] == 0


async def test_a_parked_conversation_peeks_ram_park(small_loaded, make_config, serve, sdk):
    config = _config(make_config, parallel=1, store=False, disk=False, spill=False)
    async with serve(build_app(config, small_loaded)) as server:
        a = _turn(3)
        one = await chat(server, sdk, a, "A")
        await chat(server, sdk, _turn(4), "B")  # B parks A
        seen, resp = await peek_then_send(server, sdk, _next(a, one, 5), "A")
    assert seen["tier"] == "ram_park" and _cache(resp)["source"] == "park"


async def test_a_conversation_the_park_gave_up_peeks_ram_snapshot(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, parallel=1, store=True, disk=False, spill=False)
    async with serve(build_app(config, small_loaded)) as server:
        a = _turn(6)
        one = await chat(server, sdk, a, "A")
        await chat(server, sdk, _turn(7), "B")  # B parks A
        await chat(server, sdk, _turn(8), "C")  # C parks B: A's session snapshot remains
        seen, resp = await peek_then_send(server, sdk, _next(a, one, 9), "A")
    assert seen["tier"] == "ram_snapshot" and _cache(resp)["source"] == "store"


async def test_a_conversation_on_the_nvme_peeks_nvme_spill_with_its_read_time(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, parallel=1, store=False)
    async with serve(build_app(config, small_loaded)) as server:
        a = _turn(10)
        one = await chat(server, sdk, a, "A")
        await chat(server, sdk, _turn(11), "B")  # B parks A (written as it is parked)
        await chat(server, sdk, _turn(12), "C")  # C parks B: A's park goes
        seen, resp = await peek_then_send(server, sdk, _next(a, one, 13), "A")
    assert seen["tier"] == "nvme_spill" and _cache(resp)["source"] == "spill"
    assert seen["restore_ms"] > 0


async def test_a_prefix_on_the_disk_peeks_disk_tier(small_loaded, make_config, serve, sdk):
    config = msgspec.structs.replace(_config(make_config), spill=SpillConfig(
        session_spill="off"))
    head = [{"role": "system", "content": SYSTEM * 3}]
    for seed in (14, 15):  # two processes read the head cold: its lines admitted
        async with serve(build_app(config, small_loaded)) as server:
            await chat(server, sdk, head + [{"role": "user", "content": _words(seed, 10)}],
                       None)
    async with serve(build_app(config, small_loaded)) as server:
        seen, resp = await peek_then_send(
            server, sdk, head + [{"role": "user", "content": _words(16, 10)}], None)
    assert seen["tier"] == "disk_tier" and _cache(resp)["source"] == "disk"
    assert seen["restore_ms"] > 0 and seen["session"] is None


async def _long_stream(server, session: str):
    """A chat that decodes for a long while (cancelled by the caller)."""
    client = aiohttp.ClientSession()
    doc = dict(body(_turn(20, 40), session), max_tokens=3000, stream=True)
    try:
        resp = await client.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                 json=doc)
    except BaseException:
        await client.close()
        raise
    return client, resp


async def _until(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_peek_is_a_409_at_once_while_a_request_waits_and_after_the_wait_while_one_runs(
        small_loaded, make_config, serve, sdk, monkeypatch):
    monkeypatch.setattr(peek_routes, "PEEK_WAIT_S", 0.3)
    config = _config(make_config, parallel=1, disk=False, spill=False)
    async with serve(build_app(config, small_loaded)) as server:
        engine = server.app[ENGINE]
        first = await _long_stream(server, "x")
        await _until(lambda: engine.snapshot()["requests"])
        t = time.monotonic()
        status, doc = await post(server, "/v1/cache/peek", body(_turn(21), "y"))
        waited = time.monotonic() - t
        assert status == 409 and doc["error"]["code"] == "engine_busy"
        assert waited >= 0.3
        # A streamed answer sends its headers once admitted: the waiting one's post waits.
        second = asyncio.create_task(_long_stream(server, "z"))
        await _until(lambda: engine.waiting == 1)
        t = time.monotonic()
        status, doc = await post(server, "/v1/cache/peek", body(_turn(21), "y"))
        assert status == 409 and time.monotonic() - t < 0.3, doc
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        client, resp = first
        resp.close()
        await client.close()
        await _until(lambda: not engine.snapshot()["requests"] and not engine.waiting)
        status, doc = await post(server, "/v1/cache/peek", body(_turn(21), "y"))
        assert status == 200 and doc["tier"] in ("none", "resident"), doc


async def test_a_peek_takes_the_admin_token_as_the_clear_does_and_checks_its_body(
        small_loaded, make_config, serve):
    config = msgspec.structs.replace(
        _config(make_config, disk=False, spill=False),
        server=msgspec.structs.replace(make_config().server, admin_token="s3cret"))
    async with serve(build_app(config, small_loaded)) as server:
        status, doc = await post(server, "/v1/cache/peek", body(_turn(22), "a"))
        assert status == 401, doc
        status, doc = await post(server, "/v1/cache/peek", body(_turn(22), "a"),
                                 {"Authorization": "Bearer wrong"})
        assert status == 403, doc
        auth = {"Authorization": "Bearer s3cret"}
        status, doc = await post(server, "/v1/cache/peek", body(_turn(22), "a"), auth)
        assert status == 200 and doc["tier"] == "none", doc
        status, doc = await post(server, "/v1/cache/peek", {"model": "small"}, auth)
        assert status == 400 and doc["error"]["param"] == "messages", doc
        status, doc = await post(server, "/v1/cache/peek",
                                 dict(body(_turn(22), "a"), model="other"), auth)
        assert status == 404 and doc["error"]["code"] == "model_not_found", doc
