"""The console's memory panel in headless Chromium: each level's bytes and shed count, and the
limits edited live through the form (POST /v1/memory/limits)."""

import aiohttp
import pytest

from test_console_browser import CHROMIUM, chromium, serve
from tandem.config import Config, EngineConfig, MemoryConfig
from tandem.server.app import build_app

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (/usr/bin/chromium)")


async def test_the_memory_panel_shows_the_levels_and_edits_the_limits(small_loaded, tmp_path):
    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64),
                 memory=MemoryConfig(mem_ceiling_gib=500, mem_peak_gib=600,
                                     reserve_slack_gib=2))
    app = build_app(cfg, small_loaded)
    async with serve(app) as base, chromium(tmp_path) as page:
        await page.call("Page.navigate", url=f"{base}/console")
        await page.wait_for('document.querySelector("#memory tr[data-level=pin]") !== null')
        levels = await page.evaluate(
            '[...document.querySelectorAll("#memory tr[data-level]")].map((r) => r.dataset.level)')
        assert levels == ["store", "anchors", "end", "stash", "park", "pin"]
        await page.wait_for('document.querySelector("#memory-limits input[name=mem_peak_gib]")'
                            '.value === "600"')
        await page.evaluate("""(() => {
            const f = document.getElementById("memory-limits");
            f.elements.mem_ceiling_gib.value = "300";
            f.elements.mem_peak_gib.value = "400";
            f.requestSubmit();
        })()""")
        await page.wait_for('document.getElementById("memory-limits-status").dataset.state === "ok"')
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/memory") as resp:
                limits = (await resp.json())["limits"]
        assert limits == {"mem_ceiling_gib": 300, "mem_peak_gib": 400, "reserve_slack_gib": 2}
        await page.evaluate("""(() => {
            const f = document.getElementById("memory-limits");
            f.elements.mem_ceiling_gib.value = "900";
            f.requestSubmit();
        })()""")
        await page.wait_for(
            'document.getElementById("memory-limits-status").dataset.state === "error"')
