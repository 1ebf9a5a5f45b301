"""The console's disk panel in headless Chromium, drawn from a /v1/cache/stats document's
tiers.disk (DiskTier.statistics() and the writer's queue): free space, the hit rate, the bytes
against the budget, the most-hit prefixes by their token count, the last events newest first;
and the journal part of /v1/actors, whose request rows the tier's event rows never push out."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from console_fakes import FakeCacheStats, FakeEngine, FakeJournal, build_system, console_app
from test_console_browser import CHROMIUM, chromium, serve

from aiohttp.test_utils import TestClient, TestServer

from tandem.actors import SystemClock
from tandem.actors.harness import Harness

needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="no chromium binary (/usr/bin/chromium)")

GiB = 1 << 30
DISK: dict[str, Any] = {  # shaped like DiskTier.statistics() plus the writer's fields
    "mode": "on", "chunks": 40, "anchors": 2, "nbytes": 3 * GiB, "budget_nbytes": 12 * GiB,
    "free_nbytes": 200 * GiB, "floor_nbytes": 50 * GiB, "ttl_days": 7.0, "admit_after": 2,
    "hit_rate": 0.25, "hits": 1, "misses": 3, "failed_restores": 0, "restored_tokens": 1536,
    "read_nbytes": 1 << 20, "writes": 42, "written_nbytes": 3 * GiB, "write_failures": 0,
    "skipped_no_room": 0, "evictions": 0, "evicted_nbytes": 0, "window_drops": 0, "drops": 0,
    "clears": 0, "read_gb_s": 6.5, "write_gb_s": 3.25, "transfers": {"direct": 42},
    "admission": {"lines": 7}, "fingerprint": "0123456789ab", "adopted": 0,
    "top_prefixes": [{"tokens": 1536, "key": "aaaaaaaaaaaa", "hits": 1},
                     {"tokens": 512, "key": "bbbbbbbbbbbb", "hits": 0}],
    "last_events": [{"t": 1_700_000_000.0, "event": "write", "tokens": 512, "key": "cccccccccccc"},
                    {"t": 1_700_000_001.0, "event": "write", "tokens": 1536,
                     "key": "aaaaaaaaaaaa"},
                    {"t": 1_700_000_002.0, "event": "hit", "tokens": 1536, "key": "aaaaaaaaaaaa"}],
    "queued_jobs": 0, "writer": {"jobs": 1, "copied_chunks": 40, "grants": 40, "window_drops": 0},
}


class DiskCacheStats(FakeCacheStats):
    """The fake stats with a disk tier beside the resident; tests change ``disk`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.disk: dict[str, Any] | None = copy.deepcopy(DISK)

    def __call__(self) -> dict[str, Any]:
        doc = super().__call__()
        if self.disk is not None:
            doc["tiers"]["disk"] = copy.deepcopy(self.disk)
        return doc


PANEL = """(() => {
    const q = (s) => document.querySelector(s);
    const field = (f) => q(`#disk-summary dd[data-field="${f}"]`);
    return {
        free: field("free").textContent, free_value: Number(field("free").dataset.value),
        hit_rate: field("hit_rate").textContent,
        bytes: field("bytes").textContent, bytes_value: Number(field("bytes").dataset.value),
        budget: Number(field("bytes").dataset.budget),
        meter: parseFloat(field("bytes").querySelector(".meter > span").style.width),
        files: field("files").textContent, mode: field("mode").textContent,
        prefixes: [...document.querySelectorAll("#disk-prefixes tr[data-tokens]")].map(
            (tr) => [Number(tr.dataset.tokens), Number(tr.dataset.hits)]),
        events: [...document.querySelectorAll("#disk-events tr[data-event]")].map(
            (tr) => [tr.dataset.event, Number(tr.dataset.tokens)]),
        more: [...document.querySelectorAll("#disk details dd[data-counter]")].map(
            (dd) => dd.dataset.counter),
        tiers: [...document.querySelectorAll("#cache section.tier")].map((t) => t.dataset.tier),
    };
})()"""


@needs_chromium
async def test_the_disk_panel_renders_free_space_hit_rate_bytes_prefixes_and_events(tmp_path):
    harness = Harness(clock=SystemClock())
    build_system(harness)
    cache = DiskCacheStats()
    async with harness:
        app = console_app(harness, engine=FakeEngine(), journal=FakeJournal(), cache=cache)
        async with serve(app) as base, chromium(tmp_path) as page:
            await page.call("Page.navigate", url=f"{base}/console")
            await page.wait_for('document.querySelector("#disk-summary") !== null')
            panel = await page.evaluate(PANEL)
            assert panel["tiers"] == ["resident", "disk"]
            assert panel["free"] == "200.0 GiB (floor 50.0 GiB)"
            assert panel["free_value"] == 200 * GiB
            assert panel["hit_rate"] == "25.0% of 4 asked"
            assert panel["bytes"] == "3.0 GiB / 12.0 GiB"
            assert panel["bytes_value"] == 3 * GiB and panel["budget"] == 12 * GiB
            assert panel["meter"] == 25.0
            assert panel["files"] == "40 chunks \u00b7 2 anchors" and panel["mode"] == "on"
            assert panel["prefixes"] == [[1536, 1], [512, 0]]  # most hit first, as the tier sorts
            assert panel["events"] == [["hit", 1536], ["write", 1536], ["write", 512]]
            # the rest under "more counters", the panel's own fields not twice
            assert "writes" in panel["more"] and "queued_jobs" in panel["more"]
            assert "top_prefixes" not in panel["more"] and "hit_rate" not in panel["more"]

            # The next poll shows what changed: a failed restore, the tier cleared.
            cache.disk.update(
                chunks=0, anchors=0, nbytes=0, top_prefixes=[], hits=1, misses=7, hit_rate=0.125,
                last_events=[*cache.disk["last_events"],
                             {"t": 1_700_000_003.0, "event": "failed_restore", "tokens": 1536,
                              "key": "aaaaaaaaaaaa"}])
            moved = await page.wait_for(
                f'(p => p.events.length === 4 && p)({PANEL})')
            assert moved["events"][0] == ["failed_restore", 1536]
            assert moved["prefixes"] == [] and moved["hit_rate"] == "12.5% of 8 asked"
            assert moved["bytes"] == "0 B / 12.0 GiB" and moved["meter"] == 0.0
            assert await page.evaluate(
                'document.querySelector("#disk-prefixes tbody").textContent'
            ) == "no prefix on the disk yet"

            # A server whose tier is off sends none: the panel goes, the other tiers stay.
            cache.disk = None
            await page.wait_for('document.getElementById("disk") === null')
            assert await page.evaluate(
                '[...document.querySelectorAll("#cache section.tier")].map((t) => t.dataset.tier)'
            ) == ["resident"]
            assert page.exceptions == []


async def test_the_disk_tiers_journal_rows_never_push_the_requests_out_of_the_console():
    harness = Harness()
    build_system(harness)
    journal = FakeJournal()  # 25 request rows (no kind: as older rows were written)
    journal.rows += [{"kind": "memory", "task": "disk_cache", "event": "write", "t": 1.0 + i,
                      "detail": {"tokens": 64 * i, "key": "dddddddddddd"}} for i in range(300)]
    async with harness:
        client = TestClient(TestServer(console_app(harness, journal=journal), host="127.0.0.1"))
        await client.start_server()
        try:
            doc = await (await client.get("/v1/actors")).json()
        finally:
            await client.close()
    assert [row["request_id"] for row in doc["journal"]] == [f"req-{i}" for i in range(5, 25)]
