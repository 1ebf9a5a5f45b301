import re

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from console_fakes import (
    ACTOR_NAMES,
    Done,
    FakeEngine,
    FakeJournal,
    Work,
    console_app,
    build_system,
)

from tandem.actors.harness import FakeClock, Harness
from tandem.server.console import CONSOLE_HTML, RateMeter, add_console_routes
from tandem.server.keys import ENGINE, SUPERVISOR


async def _client(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


async def test_actors_document_lists_every_actor_the_graph_engine_journal_and_cache():
    harness = Harness()
    build_system(harness)
    async with harness:
        client = await _client(console_app(harness, engine=FakeEngine(), journal=FakeJournal()))
        try:
            await harness.inject("frontend", Work(1), sender="server")
            await harness["recorder"].expect(Done, timeout_s=1.0)
            response = await client.get("/v1/actors")
            assert response.status == 200
            assert response.content_type == "application/json"
            doc = await response.json()
        finally:
            await client.close()

    assert set(doc) == {"at_s", "actors", "graph", "engine", "journal", "cache", "memory",
                        "errors"}
    assert [a["name"] for a in doc["actors"]] == ["backend", "recorder", "frontend"]  # start order
    frontend = next(a for a in doc["actors"] if a["name"] == "frontend")
    assert frontend["handled_total"] == 1
    assert frontend["handled_by_type"] == {"Work": 1}
    assert frontend["state"] == "running"
    assert frontend["mailbox_capacity"] == 64
    assert frontend["rate_msg_s"] is None  # one sample so far
    assert frontend["last_messages"][0]["type"] == "Work"
    assert frontend["last_messages"][0]["sender"] == "server"
    assert frontend["last_messages"][0]["ago_s"] == 0.0  # the fake clock has not moved

    nodes = {n["name"]: n for n in doc["graph"]["nodes"]}
    assert nodes["server"]["kind"] == "external"
    assert {n for n, node in nodes.items() if node["kind"] == "actor"} == set(ACTOR_NAMES)
    edges = {(e["sender"], e["receiver"]): e["messages"] for e in doc["graph"]["edges"]}
    assert edges == {("server", "frontend"): 1, ("frontend", "backend"): 1, ("frontend", "recorder"): 1}

    assert doc["engine"]["rows_in_place"] == 3000
    assert doc["engine"]["request"]["id"] == "req-7"
    assert len(doc["journal"]) == 20
    assert doc["journal"][-1]["request_id"] == "req-24"  # newest last
    resident = doc["cache"]["tiers"]["resident"]  # what the page draws over the rows bar
    assert resident["anchors"] == [512, 1024, 1536, 2048, 2560]
    assert resident["end"] == 3000
    assert resident["pinned"] == 1024 and resident["pinned_anchors"] == [512, 1024]
    assert resident["parked"] == {"head": 1024, "rows": 5200, "end": 5200}
    assert doc["errors"] == {}


async def test_rates_are_messages_per_second_between_polls_on_the_console_clock():
    harness = Harness()
    build_system(harness)
    async with harness:
        client = await _client(console_app(harness, clock=harness.clock))
        try:
            first = await (await client.get("/v1/actors")).json()
            for n in range(10):
                await harness.inject("frontend", Work(n), sender="server")
            for _ in range(10):
                await harness["recorder"].expect(Done, timeout_s=1.0)
            harness.clock.advance(2.0)
            second = await (await client.get("/v1/actors")).json()
        finally:
            await client.close()

    rate = {a["name"]: a["rate_msg_s"] for a in second["actors"]}
    assert all(a["rate_msg_s"] is None for a in first["actors"])
    assert rate == {"backend": 5.0, "recorder": 5.0, "frontend": 5.0}


def test_a_rate_meter_keeps_its_last_rate_between_close_polls():
    clock = FakeClock()
    meter = RateMeter(clock, min_interval_s=0.25)
    assert meter.rate("a", 0) is None
    clock.advance(1.0)
    assert meter.rate("a", 10) == 10.0
    clock.advance(0.1)  # a second page polling right after the first
    assert meter.rate("a", 11) == 10.0
    clock.advance(0.4)
    assert meter.rate("a", 13) == pytest.approx(3 / 0.5)


async def test_missing_parts_are_null_and_a_failing_source_is_named_not_fatal():
    class BrokenEngine:
        def snapshot(self) -> dict:
            raise RuntimeError("engine thread busy")

    bare = web.Application()
    add_console_routes(bare)
    client = await _client(bare)
    try:
        doc = await (await client.get("/v1/actors")).json()
    finally:
        await client.close()
    assert doc["actors"] == [] and doc["graph"] is None
    assert doc["engine"] is None and doc["journal"] is None and doc["cache"] is None

    harness = Harness()
    build_system(harness)
    async with harness:
        app = web.Application()
        app[SUPERVISOR] = harness.supervisor
        app[ENGINE] = BrokenEngine()
        add_console_routes(app)
        client = await _client(app)
        try:
            response = await client.get("/v1/actors")
            doc = await response.json()
        finally:
            await client.close()
    assert response.status == 200
    assert len(doc["actors"]) == 3
    assert doc["engine"] is None
    assert doc["errors"] == {"engine": "RuntimeError"}


async def test_the_console_page_is_one_self_contained_file():
    app = web.Application()
    add_console_routes(app)
    client = await _client(app)
    try:
        response = await client.get("/console")
        html = await response.text()
    finally:
        await client.close()
    assert response.status == 200
    assert response.content_type == "text/html"
    assert html == CONSOLE_HTML.read_text()
    # Offline machines: nothing is loaded from elsewhere. The one URL is the SVG namespace name.
    urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", html))
    assert urls == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    assert "@import" not in html
    for element_id in ("actors", "graph", "engine-rows", "engine-request", "journal", "cache"):
        assert f'id="{element_id}"' in html
