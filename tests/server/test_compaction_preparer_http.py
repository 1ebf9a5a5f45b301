"""The compaction preparer in the server: built with the caches and compaction_prepare on, shown
in /v1/actors and as the compaction_preparer section of /v1/cache/stats; absent when off."""

import aiohttp

from tandem.cache.prepared import PreparedAnswers
from tandem.config import CompactionConfig, Config
from tandem.server.app import build_app
from tandem.server.compaction import CompactionAsk, build_continuation
from tandem.server.keys import PREPARED, SUPERVISOR

COUNTERS = {"started", "yielded", "yielded_by", "finished", "served", "failed", "lock_busy"}


async def _docs(app, serve):
    async with serve(app) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        async with http.get(f"{base}/v1/cache/stats") as resp:
            assert resp.status == 200
            stats = await resp.json()
        async with http.get(f"{base}/v1/actors") as resp:
            actors = await resp.text()
    return stats, actors


async def test_the_preparer_runs_with_the_caches_and_reports_its_counters(
        small_loaded, make_config, serve):
    config = make_config()
    app = build_app(config, small_loaded)
    assert "compaction_preparer" in app[SUPERVISOR].actors
    assert isinstance(app[PREPARED], PreparedAnswers)
    preparer = app[SUPERVISOR].actors["compaction_preparer"]
    assert preparer.box_lock.path == config.box_lock_path()
    stats, actors = await _docs(app, serve)
    section = stats["compaction_preparer"]
    assert COUNTERS <= set(section)
    assert (section["started"], section["finished"], section["served"]) == (0, 0, 0)
    assert section["idle_s"] == 30.0 and section["min_tokens"] == 32768
    assert '"compaction_preparer"' in actors


async def test_compaction_prepare_off_builds_no_preparer(small_loaded, make_config, serve):
    base = make_config()
    config = Config(home=base.home, server=base.server, engine=base.engine,
                    compaction=CompactionConfig(compaction_prepare="off"))
    app = build_app(config, small_loaded)
    assert "compaction_preparer" not in app[SUPERVISOR].actors and app[PREPARED] is None
    stats, _ = await _docs(app, serve)
    assert "compaction_preparer" not in stats


def test_the_preparer_writes_with_the_routes_own_continuation(small_loaded, make_config):
    """The server's preparer builds its prompt as a compaction request at that end anchor is
    served, so the summary it writes is the one that request would decode."""
    tok = small_loaded.tokenizer
    rows = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there")
    app = build_app(make_config(), small_loaded)
    ids = app[SUPERVISOR].actors["compaction_preparer"].continuation(rows, "SYSTEM",
                                                                     "SUMMARISE")
    ask = CompactionAsk("SYSTEM", "", "SUMMARISE", ())
    assert ids == build_continuation(ask, rows, "slot", tok, None).prompt_ids
    assert ids[:len(rows)] == rows
    text = tok.decode(ids[len(rows):])
    assert "SYSTEM\n\nSUMMARISE" in text and text.endswith("<think>\n\n</think>\n\n")
