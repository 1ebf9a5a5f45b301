"""The console in a real headless Chromium (Debian's `chromium`, installed by the test command).

Chromium is driven over the DevTools protocol (CDP) with aiohttp's websocket client, so no extra
Python package is needed: launch it with --remote-debugging-port=0, read the port it prints, open
the page target's websocket and evaluate JavaScript to read the DOM. Every wait is a promise in
the page that settles on the console's own "console:rendered" event, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from console_fakes import (
    ACTOR_NAMES,
    Done,
    FakeCacheStats,
    FakeEngine,
    FakeJournal,
    Work,
    build_system,
    console_app,
)

from tandem.actors import SystemClock
from tandem.actors.harness import Harness


def _chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return shutil.which("chromium")


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (/usr/bin/chromium)")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]
LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


class Page:
    """One page target, over its CDP websocket. Commands are sequential; events are kept."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self.exceptions: list[str] = []  # uncaught JS exceptions the page threw

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async for frame in self.ws:
            if frame.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(frame.data)
            if data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.exceptions.append(details.get("exception", {}).get("description") or details["text"])
            if data.get("id") == call_id:
                if "error" in data:
                    raise RuntimeError(f"CDP {method}: {data['error']}")
                return data["result"]
        raise ConnectionError(f"the CDP websocket closed during {method}")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise AssertionError(details.get("exception", {}).get("description") or details["text"])
        return result["result"].get("value")

    async def wait_for(self, condition: str, timeout_s: float = 5.0) -> Any:
        """Evaluate the JS expression `condition` after each render until it is truthy; return it."""
        timeout_ms = int(timeout_s * 1000)
        script = f"""new Promise((resolve, reject) => {{
            const test = () => {{ try {{ return ({condition}); }} catch (e) {{ return undefined; }} }};
            const done = (f, v) => {{ removeEventListener("console:rendered", check); clearTimeout(timer); f(v); }};
            const check = () => {{ const v = test(); if (v) done(resolve, v); }};
            const timer = setTimeout(() => done(reject, new Error(
                "timed out waiting for: " + {json.dumps(condition)} + "; status: " +
                (document.getElementById("status") || {{}}).textContent)), {timeout_ms});
            addEventListener("console:rendered", check);
            check();
        }})"""
        async with asyncio.timeout(timeout_s + 2.0):
            return await self.evaluate(script)


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def chromium(tmp_path: Path) -> AsyncIterator[Page]:
    assert CHROMIUM is not None
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    log: deque[bytes] = deque(maxlen=50)
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def drain_stderr() -> None:
        # Read to the end, always: a full pipe would stall Chromium.
        assert process.stderr is not None
        async for line in process.stderr:
            log.append(line)
            match = LISTENING.search(line)
            if match and not listening.done():
                listening.set_result(match.group(1).decode())
        if not listening.done():
            listening.set_exception(RuntimeError(b"chromium exited: " + b"".join(log)))

    drain = asyncio.create_task(drain_stderr())
    try:
        async with asyncio.timeout(20.0):
            browser_ws = await listening
        port = int(re.match(r"ws://[^:]+:(\d+)/", browser_ws).group(1))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json(content_type=None)
            page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(page_ws, max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.call("Page.enable")
                yield page
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(5.0):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        await drain


def row(actor: str, field: str) -> str:
    return f'document.querySelector(\'#actors tr[data-actor="{actor}"] td[data-field="{field}"]\')'


# The resident prefix as the page drew it over the rows bar, read back from the data- attributes.
RESIDENT = """(() => {
    const q = (s) => document.querySelector(s);
    const lines = (root) => root ? [...root.querySelectorAll("[data-line]")].map((i) => Number(i.dataset.line)) : [];
    const pin = q("#resident-pin"), park = q("#resident-park"), end = q("#resident-end");
    const stash = q("#resident-stash"), parkEnd = park && park.querySelector("i.end[data-pos]");
    return {
        anchors: lines(q("#resident-anchors")),
        end: end ? Number(end.dataset.pos) : null,
        pin: pin ? { rows: Number(pin.dataset.rows), anchors: lines(pin) } : null,
        park: park ? { head: Number(park.dataset.head), rows: Number(park.dataset.rows),
                       end: "end" in park.dataset ? Number(park.dataset.end) : null,
                       end_marker: parkEnd ? Number(parkEnd.dataset.pos) : null } : null,
        stash: stash ? Number(stash.dataset.bytes) : null,
        keys: [...document.querySelectorAll("#engine-key [data-key]")].map((k) => k.dataset.key),
    };
})()"""


def resident_when(condition: str) -> str:
    """A wait_for condition: RESIDENT once `condition` (JS, over `r`) holds."""
    return f"(r => ({condition}) && r)({RESIDENT})"


async def test_the_console_shows_every_actor_the_engine_the_journal_and_the_cache(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    async with harness:
        await harness.inject("frontend", Work(1), sender="server")
        await harness["recorder"].expect(Done, timeout_s=1.0)
        app = console_app(harness, engine=FakeEngine(), journal=FakeJournal())
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.getElementById("status").dataset.state === "live"')

            shown = await page.evaluate(
                '[...document.querySelectorAll("#actors tbody tr[data-actor]")]'
                ".map((tr) => tr.dataset.actor)"
            )
            assert sorted(shown) == sorted(ACTOR_NAMES)
            for name in ACTOR_NAMES:
                assert await page.evaluate(f"{row(name, 'name')}.textContent") == name
                assert await page.evaluate(f"{row(name, 'state')}.textContent") == "running"
            assert await page.evaluate(f"{row('frontend', 'handled_total')}.textContent") == "1"
            assert await page.evaluate(f"{row('frontend', 'mailbox')}.textContent") == "0/64"
            assert "Work from server" in await page.evaluate(
                f"{row('frontend', 'last_messages')}.textContent"
            )

            nodes = await page.evaluate(
                '[...document.querySelectorAll("#graph svg g.node")].map((g) => g.dataset.node)'
            )
            assert sorted(nodes) == sorted([*ACTOR_NAMES, "server"])
            edges = await page.evaluate(
                '[...document.querySelectorAll("#graph svg g.edge")]'
                '.map((g) => [g.dataset.edge, g.querySelector("text").textContent])'
            )
            assert sorted(edges) == [
                ["frontend->backend", "1"], ["frontend->recorder", "1"], ["server->frontend", "1"]
            ]

            engine = await page.evaluate(
                """(() => { const bar = document.getElementById("engine-rows");
                   return { rows: bar.dataset.rows, window: bar.dataset.window,
                            fill: bar.querySelector(".fill").style.width,
                            ticks: document.querySelectorAll("#engine-ticks i").length,
                            taint: !!document.getElementById("engine-taint"),
                            request: document.getElementById("engine-request").textContent }; })()"""
            )
            assert engine["rows"] == "3000" and engine["window"] == "8192"
            assert engine["fill"].startswith("36.62")  # 3000 / 8192
            assert engine["ticks"] == 8192 // 512
            assert engine["taint"]
            assert "req-7" in engine["request"] and "decode" in engine["request"]

            journal = await page.evaluate(
                '[...document.querySelectorAll("#journal tbody tr")].map((tr) => tr.dataset.requestId)'
            )
            assert journal == [f"req-{i}" for i in range(24, 4, -1)]  # the last 20, newest first
            assert await page.evaluate(
                '[...document.querySelectorAll("#cache section.tier")].map((t) => t.dataset.tier)'
            ) == ["resident"]
            assert await page.evaluate(
                'document.querySelector(\'#cache [data-tier=resident] dd[data-counter="end_hits"]\').textContent'
            ) == "1"

            assert await page.evaluate(RESIDENT) == {
                "anchors": [512, 1024, 1536, 2048, 2560],
                "end": 3000,
                "pin": {"rows": 1024, "anchors": [512, 1024]},
                "park": {"head": 1024, "rows": 5200, "end": 5200, "end_marker": 5200},
                "stash": None,  # stash_bytes == 0
                "keys": ["rows", "taint", "anchor", "end", "pin", "park"],
            }
            geometry = await page.evaluate(
                """(() => { const box = (s) => document.querySelector(s).getBoundingClientRect();
                   const bar = box("#engine-rows");
                   return { anchor: document.querySelector('#resident-anchors [data-line="512"]').style.left,
                            end: document.getElementById("resident-end").style.left,
                            pin: box("#resident-pin span").width / bar.width,
                            pin_top: box("#resident-pin span").top, park_top: box("#resident-park span.rows").top,
                            bar_bottom: bar.bottom }; })()"""
            )
            assert float(geometry["anchor"].rstrip("%")) == pytest.approx(100 * 512 / 8192, abs=0.001)
            assert float(geometry["end"].rstrip("%")) == pytest.approx(100 * 3000 / 8192, abs=0.001)
            assert geometry["pin"] == pytest.approx(1024 / 8192, abs=0.01)
            assert geometry["bar_bottom"] < geometry["pin_top"] < geometry["park_top"]  # lanes under the bar
            assert page.exceptions == []


async def test_the_console_numbers_move_when_messages_flow(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    engine = FakeEngine()
    async with harness:
        app = console_app(harness, engine=engine, journal=FakeJournal())
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for(f"{row('backend', 'handled_total')}")
            before = int(await page.evaluate(f"{row('backend', 'handled_total')}.dataset.value"))

            for n in range(5):
                await harness.inject("frontend", Work(n), sender="server")
            engine.rows_in_place = 4096
            engine.request = None

            after = await page.wait_for(
                f"(v => v >= {before + 5} && v)"
                f"(Number({row('backend', 'handled_total')}.dataset.value))"
            )
            assert after == before + 5
            rate = await page.wait_for(f"Number({row('backend', 'rate')}.dataset.value) > 0 && "
                                       f"{row('backend', 'rate')}.textContent")
            assert float(rate) > 0
            assert await page.wait_for(
                '(e => e.textContent === "5" && e.textContent)(document.querySelector('
                '\'#graph g.edge[data-edge="server->frontend"] text\'))'
            ) == "5"
            assert await page.wait_for(
                'document.getElementById("engine-rows").dataset.rows === "4096"'
            )
            assert "idle" in await page.evaluate(
                'document.getElementById("engine-request").textContent'
            )
            assert page.exceptions == []


async def test_the_resident_markers_move_with_the_cache_stats(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    engine = FakeEngine()
    cache = FakeCacheStats()
    assert cache.resident is not None
    async with harness:
        app = console_app(harness, engine=engine, journal=FakeJournal(), cache=cache)
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            assert (await page.wait_for(resident_when("r.end === 3000")))["pin"]["rows"] == 1024

            # A longer conversation: more anchors, a longer head pinned, a guest in (stash held),
            # the parked session without its end anchor.
            engine.rows_in_place = 4096
            cache.resident.update(
                rows_in_place=4096, anchors=[512, 1024, 1536, 2048, 2560, 3072, 3584], end=4096,
                pinned=2048, pinned_anchors=[512, 1024, 1536, 2048], stash_bytes=3 * 1_048_576,
                parked={"head": 2048, "rows": 6000, "end": None},
            )
            moved = await page.wait_for(resident_when("r.end === 4096 && r.stash !== null"))
            assert moved == {
                "anchors": [512, 1024, 1536, 2048, 2560, 3072, 3584],
                "end": 4096,
                "pin": {"rows": 2048, "anchors": [512, 1024, 1536, 2048]},
                "park": {"head": 2048, "rows": 6000, "end": None, "end_marker": None},
                "stash": 3 * 1_048_576,
                "keys": ["rows", "taint", "anchor", "end", "pin", "park", "stash"],
            }
            assert "3.0 MiB" in await page.evaluate('document.getElementById("resident-stash").textContent')
            assert await page.evaluate(  # 3072 and 3584 are above the taint (2900)
                '[...document.querySelectorAll("#resident-anchors i.above-taint")].map((i) => i.dataset.line)'
            ) == ["3072", "3584"]

            # Everything let go: no end, nothing pinned or parked, the guest gone.
            cache.resident.update(anchors=[512], end=None, pinned=None, pinned_anchors=[],
                                  parked=None, stash_bytes=0)
            cleared = await page.wait_for(resident_when("r.anchors.length === 1 && r.end === null"))
            assert cleared == {"anchors": [512], "end": None, "pin": None, "park": None, "stash": None,
                               "keys": ["rows", "taint", "anchor"]}

            # An older server: a resident tier with most fields missing or odd, then none at all.
            cache.resident = {"anchors": [1024, "x"], "parked": {"head": 512}, "pinned": "?"}
            partial = await page.wait_for(resident_when("r.anchors[0] === 1024"))
            assert partial["anchors"] == [1024] and partial["pin"] is None and partial["park"] is None
            cache.resident = None
            await page.wait_for('!document.getElementById("resident") && '
                                '!document.querySelector("#cache [data-tier]")')
            assert await page.evaluate('document.getElementById("engine-rows").dataset.rows') == "4096"
            assert await page.evaluate(
                '[...document.querySelectorAll("#engine-key [data-key]")].map((k) => k.dataset.key)'
            ) == ["rows", "taint"]
            assert page.exceptions == []


async def test_the_console_without_an_engine_or_journal_says_so(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    async with harness:
        app = console_app(harness)
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.getElementById("status").dataset.state === "live"')
            text = await page.evaluate(
                '["engine-fields", "journal", "cache"]'
                '.map((id) => document.getElementById(id).textContent)'
            )
            assert text[0] == "no engine"
            assert "no journal" in text[1]
            assert text[2] == "no cache statistics"
            assert await page.evaluate(
                'document.querySelectorAll("#actors tr[data-actor]").length'
            ) == len(ACTOR_NAMES)
            assert page.exceptions == []
