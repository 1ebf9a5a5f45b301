"""The session spill's surfaces through the HTTP server (issue 16): the spill writer runs beside
the disk writer (only with the disk tier and the spill on), /v1/actors lists it, a save shows in
/v1/cache/stats, /metrics and /health's write count; POST /v1/cache/clear?tier=spill (admin)
empties it and is journaled, ?tier=all includes it, a server without a spill answers 409; the
shutdown drains it; and the console's spill panel.

The engine builds no spill on its own yet (the engine's wiring is another part of the issue):
these tests hand the engine actor one before the server starts, as its build will."""

from __future__ import annotations

import copy
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
from console_fakes import FakeCacheStats, FakeEngine, FakeJournal, build_system, console_app
from test_console_browser import CHROMIUM, chromium, serve as serve_console

from tandem.actors import SystemClock
from tandem.actors.harness import Harness
from tandem.actors.spill_messages import SpillSave, SpillSaved
from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import namespace_of
from tandem.config import DiskConfig, SpeculationConfig, SpillConfig
from tandem.engine import Engine
from tandem.io.spill import EntryMeta, SpillEnd, session_digest
from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS, ENGINE, JOURNAL, SPILL_WRITER

ADMIN = {"Authorization": "Bearer s3cret"}
GRID = 64
GiB = 1 << 30

needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="no chromium binary (/usr/bin/chromium)")


def _config(make_config, *, session_spill: str = "on", disk_cache: str = "on"):
    config = make_config(window=1024, admin_token="s3cret")
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"),
        disk=DiskConfig(disk_cache=disk_cache, disk_cache_min_free_gb=0),
        spill=SpillConfig(session_spill=session_spill))


def _conversation(model, n: int = 150) -> SpillSave:
    """A conversation an engine really wrote (a prefill and a few decoded tokens), as the
    engine's plan will send it."""
    eng = Engine(model, window=1024, prefix_chunk=GRID)
    anchors: dict[int, SectionsCopy] = {}

    def on_chunk(end: int) -> None:
        if end % GRID == 0:
            anchors[end] = SectionsCopy.take(eng.cache_state())

    ids = torch.randint(0, model.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    logits = eng.prefill(ids, on_chunk=on_chunk)
    for _ in range(3):
        logits = eng.decode(int(torch.argmax(logits)))
    meta = EntryMeta(session_digest("chat-1"), namespace_of(None), eng.taint)
    end = SpillEnd(eng.length, SectionsCopy.take(eng.cache_state()).tensors, None)
    return SpillSave("evict", 0, meta.entry_id, eng.cache_state(), eng.length,
                     list(eng.token_ids), anchors, end, meta)


async def _call(server, method: str, path: str, headers=None):
    url = f"http://127.0.0.1:{server.port}{path}"
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, json={}, headers=headers) as resp:
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, await resp.text()


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no gauge {name}")


async def test_a_save_through_the_servers_spill_writer_shows_on_every_surface_and_clears(
        small_loaded, make_config, serve):
    config = _config(make_config)
    app = build_app(config, small_loaded)
    save = _conversation(small_loaded.model)
    writer = app[SPILL_WRITER]
    async with serve(app) as server:
        spill = app[ENGINE].spill  # built on the engine thread, beside the disk tier
        status, actors = await _call(server, "GET", "/v1/actors")
        assert status == 200
        names = [a["name"] for a in actors["actors"]]
        assert names.index("spill_writer") == names.index("disk_writer") + 1
        saved = await writer.ask(save, 30.0, sender="engine")
        assert isinstance(saved, SpillSaved) and saved.skipped == "", saved

        status, stats = await _call(server, "GET", "/v1/cache/stats")
        s = stats["tiers"]["spill"]
        assert (s["entries"], s["saves"], s["restores"], s["skips_total"], s["failures"]) == \
            (1, 1, 0, 0, 0)
        assert s["nbytes"] == spill.nbytes > 0 and s["budget_nbytes"] == 64 * 10 ** 9
        assert s["last_save"]["rows"] == save.valid and s["last_save"]["ms"]["total"] > 0
        status, metrics = await _call(server, "GET", "/metrics")
        assert _gauge(metrics, "tandem_session_spill_entries") == 1.0
        assert _gauge(metrics, "tandem_session_spill_nbytes") == float(spill.nbytes)
        assert _gauge(metrics, "tandem_session_spill_saves_total") == 1.0
        assert _gauge(metrics, "tandem_session_spill_restores_total") == 0.0
        assert _gauge(metrics, "tandem_session_spill_skips_total") == 0.0
        assert _gauge(metrics, "tandem_session_spill_failures_total") == 0.0
        # one day's count: the tier's guard holds the spill's bytes
        status, health = await _call(server, "GET", "/health")
        writes = health["cache"]["disk_writes"]
        assert writes["spill_nbytes"] == saved.report.nbytes_written + \
            saved.report.manifest_nbytes

        assert (await _call(server, "POST", "/v1/cache/clear?tier=spill"))[0] == 401
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=spill", ADMIN)
        assert status == 200, body
        assert body == {"tier": "spill", "cleared": ["spill"],
                        "dropped": {"entries": 1, "nbytes": s["nbytes"]}}
        assert spill.entries() == {}
        clears = [r for r in app[JOURNAL].tail(1000) if r.get("event") == "clear"]
        assert [(r["task"], r["detail"]) for r in clears] == [
            ("session_spill", body["dropped"])]

        assert (await writer.ask(save, 30.0, sender="engine")).skipped == ""
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=all", ADMIN)
        assert status == 200, body
        assert "spill" in body["cleared"] and body["dropped"]["spill"]["entries"] == 1
        assert (await app[CACHE_STATS]())["tiers"]["spill"]["entries"] == 0
    # the shutdown drained it after the engine
    assert writer.statistics().handled_by_type.get("DrainSpill") == 1
    assert writer.senders.get("server", 0) >= 1


async def test_a_server_without_a_spill_answers_a_clear_of_it_409_and_shows_none(
        small_loaded, make_config, serve):
    # off in the config: no writer at all
    app = build_app(_config(make_config, session_spill="off"), small_loaded)
    assert app[SPILL_WRITER] is None
    async with serve(app) as server:
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=spill", ADMIN)
        assert status == 409 and body["error"]["code"] == "tier_off"
        status, actors = await _call(server, "GET", "/v1/actors")
        assert "spill_writer" not in [a["name"] for a in actors["actors"]]
        assert "spill" not in (await app[CACHE_STATS]())["tiers"]
    # on, but the disk tier off: no writer either
    assert build_app(_config(make_config, disk_cache="off"), small_loaded)[SPILL_WRITER] is None
    # on, but the engine built none: the writer answers off, the surfaces show none
    app = build_app(_config(make_config), small_loaded)
    app[ENGINE]._make_spill = None
    async with serve(app) as server:
        assert not app[SPILL_WRITER].on
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=spill", ADMIN)
        assert status == 409 and body["error"]["code"] == "tier_off"
        status, body = await _call(server, "POST", "/v1/cache/clear?tier=all", ADMIN)
        assert status == 200 and "spill" not in body["cleared"]
        status, metrics = await _call(server, "GET", "/metrics")
        assert _gauge(metrics, "tandem_session_spill_entries") == 0.0


# -- the console's panel ---------------------------------------------------------------------

SPILL: dict[str, Any] = {  # shaped like SpillWriterActor.report()
    "on": True, "entries": 3, "nbytes": 6 * GiB, "tokens": 90_000, "budget_nbytes": 24 * GiB,
    "ttl_s": 172800.0, "oldest_used": 1_700_000_000.0, "dropped_at_open": {}, "queued": 0,
    "saves": 5, "unchanged": 1,
    "saves_by_reason": {"drain": 2, "evict": 3, "park": 0, "store_restore": 0},
    "skips": {"guard": 2, "budget": 0, "failed": 1, "off": 0}, "skips_total": 3,
    "restores": 4, "restore_failures": 1, "failures": 1, "nbytes_written": 7 * GiB,
    "blocks_written": 40, "blocks_kept": 10, "nbytes_read": 5 * GiB, "sweeps": 2, "swept": 0,
    "clears": 0,
    "last_save": {"reason": "evict", "rows": 32768, "nbytes": GiB, "entry_nbytes": 2 * GiB,
                  "blocks_written": 8, "blocks_kept": 0, "at": 1_700_000_001.0,
                  "ms": {"writer": 0.5, "lock": 0.1, "waits": 2.0, "staging": 0.0,
                         "sums": 3.0, "total": 250.0}},
}


class SpillCacheStats(FakeCacheStats):
    def __init__(self) -> None:
        super().__init__()
        self.spill: dict[str, Any] | None = copy.deepcopy(SPILL)

    def __call__(self) -> dict[str, Any]:
        doc = super().__call__()
        if self.spill is not None:
            doc["tiers"]["spill"] = copy.deepcopy(self.spill)
        return doc


PANEL = """(() => {
    const q = (s) => document.querySelector(s);
    const field = (f) => q(`#spill-summary dd[data-field="${f}"]`);
    return {
        entries: Number(field("entries").dataset.value),
        bytes: field("bytes").textContent, budget: Number(field("bytes").dataset.budget),
        meter: parseFloat(field("bytes").querySelector(".meter > span").style.width),
        saves: field("saves").textContent, restores: field("restores").textContent,
        skips: field("skips").textContent, failures: Number(field("failures").dataset.value),
        last: [...document.querySelectorAll("#spill-last-save tr[data-part]")].map(
            (tr) => [tr.dataset.part, Number(tr.dataset.ms)]),
        title: q("#spill h4").textContent,
        more: [...document.querySelectorAll("#spill details dd[data-counter]")].map(
            (dd) => dd.dataset.counter),
        tiers: [...document.querySelectorAll("#cache section.tier")].map((t) => t.dataset.tier),
    };
})()"""


@needs_chromium
async def test_the_spill_panel_renders_entries_bytes_saves_skips_and_the_last_saves_time(
        tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    cache = SpillCacheStats()
    async with harness:
        app = console_app(harness, engine=FakeEngine(), journal=FakeJournal(), cache=cache)
        async with serve_console(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.querySelector("#spill-summary") !== null')
            panel = await page.evaluate(PANEL)
            assert panel["tiers"] == ["resident", "spill"]
            assert panel["entries"] == 3
            assert panel["bytes"] == "6.0 GiB / 24.0 GiB" and panel["budget"] == 24 * GiB
            assert panel["meter"] == 25.0
            assert panel["saves"] == "5 (2 drain \u00b7 3 evict)"
            assert panel["restores"] == "4 \u00b7 1 refused"
            assert panel["skips"] == "3 (2 guard \u00b7 1 failed)"
            assert panel["failures"] == 1
            assert panel["last"] == [["writer", 0.5], ["lock", 0.1], ["waits", 2.0],
                                     ["staging", 0.0], ["sums", 3.0], ["total", 250.0]]
            assert panel["title"] == "last save (evict, 32,768 rows, 1.0 GiB)"
            assert "blocks_written" in panel["more"] and "saves" not in panel["more"]

            cache.spill = None  # a server without a spill: the panel goes
            await page.wait_for('document.getElementById("spill") === null')
            assert page.exceptions == []


async def test_a_clear_without_a_tier_empties_ram_and_leaves_the_nvmes_files(
        small_loaded, make_config, serve):
    config = _config(make_config)
    app = build_app(config, small_loaded)
    async with serve(app) as server:
        assert (await app[SPILL_WRITER].ask(_conversation(small_loaded.model), 30.0,
                                            sender="engine")).skipped == ""
        status, body = await _call(server, "POST", "/v1/cache/clear", ADMIN)
        assert status == 200, body
        assert body["tier"] == "ram" and "spill" not in body["cleared"]
        assert "disk" not in body["cleared"] and {"disk", "spill"} <= set(body["kept"])
        assert {"resident", "store"} <= set(body["cleared"])
        assert (await app[CACHE_STATS]())["tiers"]["spill"]["entries"] == 1
        # the same with ?tier=ram; an unknown tier is a 400 naming it
        status, again = await _call(server, "POST", "/v1/cache/clear?tier=ram", ADMIN)
        assert status == 200 and again["tier"] == "ram"
        status, bad = await _call(server, "POST", "/v1/cache/clear?tier=nvme", ADMIN)
        assert status == 400 and bad["error"]["param"] == "tier"
