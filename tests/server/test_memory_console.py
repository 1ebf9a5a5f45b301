"""The console's memory panel in headless Chromium: each level's bytes and shed count, and the
limits edited live through the form (POST /v1/memory/limits)."""

import asyncio

import aiohttp
import pytest

from test_console_browser import CHROMIUM, chromium, serve
from tandem.cache.governor import CpuAllocator
from tandem.config import Config, EngineConfig, MemoryConfig, ServerConfig
from tandem.server.app import build_app

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (/usr/bin/chromium)")


async def test_the_memory_panel_shows_the_levels_and_edits_the_limits(small_loaded, tmp_path):
    # Whole GiB under the machine's memory: an edit over it is refused.
    machine = CpuAllocator().total_nbytes() >> 30
    assert machine >= 4
    ceiling, peak = machine // 2, machine // 2 + 1
    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64),
                 memory=MemoryConfig(mem_ceiling_gib=machine - 1, mem_peak_gib=machine,
                                     reserve_slack_gib=1))
    app = build_app(cfg, small_loaded)
    async with serve(app) as base, chromium(tmp_path) as page:
        await page.call("Page.navigate", url=f"{base}/console")
        await page.wait_for('document.querySelector("#memory tr[data-level=pin]") !== null')
        levels = await page.evaluate(
            '[...document.querySelectorAll("#memory tr[data-level]")].map((r) => r.dataset.level)')
        assert levels == ["store", "prompt_end", "anchors", "end", "stash", "park", "pin"]
        await page.wait_for('document.querySelector("#memory-limits input[name=mem_peak_gib]")'
                            '.value === "%d"' % machine)
        await page.evaluate("""(() => {
            const f = document.getElementById("memory-limits");
            f.elements.mem_ceiling_gib.value = "%d";
            f.elements.mem_peak_gib.value = "%d";
            f.requestSubmit();
        })()""" % (ceiling, peak))
        await page.wait_for('document.getElementById("memory-limits-status").dataset.state === "ok"')
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/memory") as resp:
                limits = (await resp.json())["limits"]
        assert limits == {"mem_ceiling_gib": ceiling, "mem_peak_gib": peak, "reserve_slack_gib": 1}
        await page.evaluate("""(() => {
            const f = document.getElementById("memory-limits");
            f.elements.mem_ceiling_gib.value = "%d";
            f.requestSubmit();
        })()""" % (peak + 1))
        await page.wait_for(
            'document.getElementById("memory-limits-status").dataset.state === "error"')


async def test_the_console_sends_the_admin_token_it_was_given(small_loaded, tmp_path):
    machine = CpuAllocator().total_nbytes() >> 30
    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64),
                 server=ServerConfig(admin_token="adm-7", api_key="sk-7"),
                 memory=MemoryConfig(mem_ceiling_gib=machine - 1, mem_peak_gib=machine,
                                     reserve_slack_gib=1))
    app = build_app(cfg, small_loaded)
    submit = """(() => {
        const f = document.getElementById("memory-limits");
        f.elements.reserve_slack_gib.value = "%s";
        f.requestSubmit();
    })()"""
    async with serve(app) as base, chromium(tmp_path) as page:
        # Given in the fragment: kept for the tab, out of the address bar, sent on every call
        # (the API key check of /v1/actors takes the admin token too).
        await page.call("Page.navigate", url=f"{base}/console#token=adm-7")
        await page.wait_for('document.getElementById("status").dataset.state === "live"')
        assert await page.evaluate("location.href") == f"{base}/console"
        await page.evaluate(submit % "0.5")
        await page.wait_for('document.getElementById("memory-limits-status").dataset.state === "ok"')
        # A wrong token is refused; the page asks for the right one and tries again.
        await page.evaluate('sessionStorage.setItem("tandem-token", "wrong"); '
                            'window.prompt = () => "adm-7"')
        await page.evaluate(submit % "0.75")
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-7"}) as http:
            async with asyncio.timeout(5):
                while True:
                    async with http.get(f"{base}/v1/memory") as resp:
                        if (await resp.json())["limits"]["reserve_slack_gib"] == 0.75:
                            break
                    await asyncio.sleep(0.05)
        assert await page.evaluate('sessionStorage.getItem("tandem-token")') == "adm-7"
