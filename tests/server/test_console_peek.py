"""The console's peek and prewarm panel in headless Chromium (issue 18, part 6): the pasted body
goes to POST /v1/cache/peek or /v1/cache/prewarm as it is, the session as x-session-id, and the
answer's fields are shown; a 409 reads "busy", a body that is not JSON is refused in the page.

Against a stand-in of the two routes (they record what the page sent), so that the page's own
work is what these tests hold; tests/server/test_cache_peek.py holds the routes' answers."""

from __future__ import annotations

import contextlib
import json

import pytest
from aiohttp import web
from console_fakes import FakeCacheStats, FakeEngine, FakeJournal, build_system, console_app

from test_console_browser import CHROMIUM, chromium, serve
from tandem.actors import SystemClock
from tandem.actors.harness import Harness

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (/usr/bin/chromium)")

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
PEEK = {"tier": "nvme_spill", "cached_tokens": 4096, "reread_tokens": 12, "reread_eta_ms": 35.5,
        "tokens": 4108, "restore_ms": 21.0, "session": "s-1", "slot": None}


def _stand_in(app: web.Application, sent: list, answers: dict) -> None:
    async def answer(request: web.Request) -> web.Response:
        kind = request.path.rsplit("/", 1)[1]
        sent.append((kind, request.headers.get("x-session-id"), await request.json()))
        status, doc = answers[kind]
        return web.json_response(doc, status=status)
    app.router.add_post("/v1/cache/peek", answer)
    app.router.add_post("/v1/cache/prewarm", answer)


@contextlib.asynccontextmanager
async def _console(tmp_path, sent: list, answers: dict):
    """The console over a stand-in of the two routes, in Chromium, once it polls live."""
    harness = Harness(clock=SystemClock())
    build_system(harness)
    async with harness:
        app = console_app(harness, engine=FakeEngine(), journal=FakeJournal())
        _stand_in(app, sent, answers)
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.getElementById("status").dataset.state === "live"')
            yield page


async def _paste(page, body: str, session: str) -> None:
    await page.evaluate("""(() => {
        const f = document.getElementById("peek-form");
        f.elements.body.value = %s;
        f.elements.session.value = %s;
    })()""" % (json.dumps(body), json.dumps(session)))


FIELD = 'document.querySelector("#peek-result dd[data-field=%s]")'


async def test_the_peek_panel_sends_the_pasted_body_and_shows_the_answer(tmp_path):
    sent: list = []
    answers = {"peek": (200, PEEK),
               "prewarm": (200, {"prewarmed": True, "restore": {"rows": 4096, "ms": 20.5}})}
    async with _console(tmp_path, sent, answers) as page:
        await _paste(page, json.dumps(BODY), "s-1")
        await page.evaluate('document.getElementById("peek-button").click()')
        await page.wait_for('document.getElementById("peek-status").dataset.state === "ok"')
        assert sent == [("peek", "s-1", BODY)]
        assert await page.evaluate(
            'document.getElementById("peek-result").dataset.kind') == "peek"
        assert await page.evaluate(f"{FIELD % 'tier'}.dataset.value") == "nvme_spill"
        assert await page.evaluate(f"{FIELD % 'cached_tokens'}.dataset.value") == "4096"
        assert await page.evaluate(f"{FIELD % 'reread_eta_ms'}.textContent") == "35.5"
        assert "nvme_spill" in await page.evaluate(
            'document.getElementById("peek-status").textContent')

        await page.evaluate('document.getElementById("prewarm-button").click()')
        await page.wait_for(
            'document.getElementById("peek-result").dataset.kind === "prewarm"')
        assert sent[-1] == ("prewarm", "s-1", BODY)
        assert await page.evaluate(f"{FIELD % 'prewarmed'}.dataset.value") == "true"
        assert "4,096" in await page.evaluate(f"{FIELD % 'restore'}.textContent")

        # Not prewarmed: the why is in the status line.
        answers["prewarm"] = (200, {"prewarmed": False, "why": "not_on_nvme"})
        await page.evaluate('document.getElementById("prewarm-button").click()')
        await page.wait_for(
            'document.getElementById("peek-status").textContent.includes("not_on_nvme")')


async def test_the_peek_panel_reads_a_409_as_busy_and_refuses_a_body_that_is_not_json(tmp_path):
    sent: list = []
    answers = {"peek": (409, {"error": {"message": "a request waits for the engine",
                                        "type": "invalid_request_error", "code": "engine_busy"}}),
               "prewarm": (200, {})}
    async with _console(tmp_path, sent, answers) as page:
        await _paste(page, '{"messages": [', "")
        await page.evaluate('document.getElementById("peek-button").click()')
        await page.wait_for('document.getElementById("peek-status").dataset.state === "error"')
        assert "not JSON" in await page.evaluate(
            'document.getElementById("peek-status").textContent')
        assert sent == []  # refused in the page, never sent

        await _paste(page, json.dumps(BODY), "")
        await page.evaluate('document.getElementById("peek-button").click()')
        await page.wait_for('document.getElementById("peek-status").dataset.state === "busy"')
        assert sent == [("peek", None, BODY)]  # no session typed: no header
        assert "409" in await page.evaluate(
            'document.getElementById("peek-status").textContent')


class _WithStore(FakeCacheStats):
    def __call__(self):
        doc = super().__call__()
        doc["tiers"]["store"] = {"snapshots": 2, "hits": 1}
        return doc


async def test_each_cache_tier_is_headed_with_the_name_the_peek_gives_it(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    async with harness:
        app = console_app(harness, engine=FakeEngine(), journal=FakeJournal(),
                          cache=_WithStore())
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.querySelector("#cache section.tier[data-tier=store]")')
            names = await page.evaluate(
                'Object.fromEntries([...document.querySelectorAll("#cache section.tier")].map('
                '(t) => [t.dataset.tier, t.querySelector("h3 span.tier-name").textContent]))')
            assert names.get("resident") == "resident \u00b7 ram_park"
            assert names.get("store") == "ram_snapshot"


async def test_the_console_peeks_a_pasted_body_on_the_real_server_as_its_next_turn_would_go(
        small_loaded, make_config, tmp_path):
    # The answer the panel shows is the route's: a body never sent peeks none; once its first
    # turn ran, the body of its next turn peeks resident with the line its usage then reports.
    import aiohttp
    import msgspec

    from tandem.config import SpeculationConfig
    from tandem.server.app import build_app

    config = msgspec.structs.replace(make_config(window=2048),
                                     speculation=SpeculationConfig(speculation="off"))
    first = [{"role": "system", "content": "You keep a ledger of words. " * 30},
             {"role": "user", "content": "Say one word."}]
    head = {"model": "small", "max_tokens": 4, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    async with serve(build_app(config, small_loaded)) as base, chromium(tmp_path) as page, \
            aiohttp.ClientSession(base) as http:
        await page.call("Page.navigate", url=f"{base}/console")
        await page.wait_for('document.getElementById("status").dataset.state === "live"')
        await _paste(page, json.dumps({**head, "messages": first}), "s-7")
        await page.evaluate('document.getElementById("peek-button").click()')
        await page.wait_for('document.getElementById("peek-status").dataset.state === "ok"')
        assert await page.evaluate(f"{FIELD % 'tier'}.dataset.value") == "none"

        async with http.post("/v1/chat/completions", json={**head, "messages": first},
                             headers={"x-session-id": "s-7"}) as resp:
            answer = (await resp.json())["choices"][0]["message"]["content"]
        after = first + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "And another."}]
        await _paste(page, json.dumps({**head, "messages": after}), "s-7")
        await page.evaluate('document.getElementById("peek-status").dataset.state = ""')
        await page.evaluate('document.getElementById("peek-button").click()')
        await page.wait_for('document.getElementById("peek-status").dataset.state === "ok"')
        shown = await page.evaluate(
            'Object.fromEntries([...document.querySelectorAll("#peek-result dd[data-field]")]'
            '.map((d) => [d.dataset.field, d.dataset.value]))')
        async with http.post("/v1/chat/completions", json={**head, "messages": after},
                             headers={"x-session-id": "s-7"}) as resp:
            cache = (await resp.json())["usage"]["tandem"]["cache"]
        assert shown["tier"] == cache["tier"] == "resident"
        assert int(shown["cached_tokens"]) == cache["cached"] > 0
        assert int(shown["reread_tokens"]) == cache["reread"]
