"""POST /v1/cache/prewarm (issue 18, part 3) through the HTTP server, on the small real model: a
conversation the peek finds on the NVMe is read back into its slot (the one in place going to
the NVMe first), and its next turn resumes at its end with the greedy tokens of a server that
never let it go; every why: not_on_nvme, resident_in_use, too_long, yielded (a request came
during it: the entry stays on the NVMe, the conversation in place in its slot).

Gate: the rows past the end anchor were written by decoding: the same greedy tokens."""

import asyncio

import msgspec

from tandem.actors import engine_peek
from tandem.io.spill import SessionSpill
from tandem.server.app import build_app
from tandem.server.keys import ENGINE

from test_cache_peek import _cache, _config, _next, _turn, body, chat, post, stats


async def _three(server, sdk):
    """A, then B (parks A, written as it is parked), then C (parks B: A's park goes); A is on
    the NVMe alone, C in the slot."""
    a = _turn(30)
    one = await chat(server, sdk, a, "A")
    await chat(server, sdk, _turn(31), "B")
    c = _turn(32)
    c_one = await chat(server, sdk, c, "C")
    return _next(a, one, 33), _next(c, c_one, 34)


def _prewarm_config(make_config):
    return _config(make_config, parallel=1, store=False)


async def test_a_conversation_on_the_nvme_is_read_back_and_its_next_turn_resumes_at_its_end(
        small_loaded, make_config, serve, sdk, monkeypatch):
    monkeypatch.setattr(engine_peek, "PREWARM_IN_USE_S", 0.0)  # C's use is old enough
    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        a_two, _ = await _three(server, sdk)
        status, doc = await post(server, "/v1/cache/peek", body(a_two, "A"))
        assert doc["tier"] == "nvme_spill", doc
        status, doc = await post(server, "/v1/cache/prewarm", body(a_two, "A"))
        assert status == 200 and doc["prewarmed"] is True, doc
        assert doc["restore"]["blocks_read"] > 0 and doc["restore"]["ms"] > 0
        assert doc["saved"]["skipped"] is None  # C, in place, went to the NVMe first
        status, after = await post(server, "/v1/cache/peek", body(a_two, "A"))
        assert after["tier"] == "resident", after
        got = await chat(server, sdk, a_two, "A")
    assert _cache(got)["source"] == "end", _cache(got)
    # The reference: A's two turns on a server that never let A go.
    other = msgspec.structs.replace(config, home=config.home + "-ref")
    async with serve(build_app(other, small_loaded)) as server:
        a = _turn(30)
        one = await chat(server, sdk, a, "A")
        assert _next(a, one, 33) == a_two
        want = await chat(server, sdk, a_two, "A")
    assert _cache(want)["source"] == "end"
    assert got.choices[0].message.content == want.choices[0].message.content


async def test_a_conversation_in_ram_or_nowhere_is_not_on_nvme(
        small_loaded, make_config, serve, sdk):
    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        status, doc = await post(server, "/v1/cache/prewarm", body(_turn(35), "D"))
        assert status == 200 and doc == {"prewarmed": False, "why": "not_on_nvme",
                                         "peek": doc["peek"]}
        assert doc["peek"]["tier"] == "none"


async def test_rows_another_conversation_used_lately_are_kept_resident_in_use(
        small_loaded, make_config, serve, sdk):
    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        a_two, c_two = await _three(server, sdk)
        status, doc = await post(server, "/v1/cache/prewarm", body(a_two, "A"))
        assert doc["prewarmed"] is False and doc["why"] == "resident_in_use", doc
        got = await chat(server, sdk, c_two, "C")  # C is where it was
    assert _cache(got)["source"] == "end"


async def test_a_read_longer_than_the_limit_is_not_begun_too_long(
        small_loaded, make_config, serve, sdk, monkeypatch):
    monkeypatch.setattr(engine_peek, "PREWARM_IN_USE_S", 0.0)
    monkeypatch.setattr(engine_peek, "PREWARM_MAX_S", 0.0)
    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        a_two, _ = await _three(server, sdk)
        status, doc = await post(server, "/v1/cache/prewarm", body(a_two, "A"))
        assert doc["prewarmed"] is False and doc["why"] == "too_long", doc


async def test_a_request_during_the_prewarm_stops_it_and_leaves_both_conversations_yielded(
        small_loaded, make_config, serve, sdk, monkeypatch):
    monkeypatch.setattr(engine_peek, "PREWARM_IN_USE_S", 0.0)
    read = SessionSpill._read_file
    reading = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_read(self, fd, rec, slot):  # each file of the prewarm's read takes a while
        loop.call_soon_threadsafe(reading.set)
        import time
        time.sleep(0.3)
        return read(self, fd, rec, slot)

    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        engine = server.app[ENGINE]
        a_two, c_two = await _three(server, sdk)
        monkeypatch.setattr(SessionSpill, "_read_file", slow_read)
        prewarm = asyncio.create_task(post(server, "/v1/cache/prewarm", body(a_two, "A")))
        async with asyncio.timeout(30):
            await reading.wait()
        assert engine._prewarming
        turn = asyncio.create_task(chat(server, sdk, c_two, "C"))  # C's next turn comes
        status, doc = await prewarm
        got = await turn
        monkeypatch.setattr(SessionSpill, "_read_file", read)
        assert doc["prewarmed"] is False and doc["why"] == "yielded", doc
        assert _cache(got)["source"] == "end", _cache(got)  # C stayed in place
        status, seen = await post(server, "/v1/cache/peek", body(a_two, "A"))
    assert seen["tier"] == "nvme_spill", seen  # A's entry stayed on the NVMe


async def test_a_request_during_the_save_of_the_conversation_in_place_stops_it_between_files(
        small_loaded, make_config, serve, sdk, monkeypatch):
    # C, in place, goes to the NVMe before A is read; C's next turn comes while C's files are
    # written: the save stops before its next file, A is never read (its entry stays on the
    # NVMe) and C's turn resumes at its end in place.
    monkeypatch.setattr(engine_peek, "PREWARM_IN_USE_S", 0.0)
    write = SessionSpill._write_file
    writing = asyncio.Event()
    loop = asyncio.get_running_loop()
    written = []

    def slow_write(self, *args, **kwargs):
        loop.call_soon_threadsafe(writing.set)
        import time
        time.sleep(0.3)
        written.append(1)
        return write(self, *args, **kwargs)

    config = _prewarm_config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        a_two, c_two = await _three(server, sdk)
        monkeypatch.setattr(SessionSpill, "_write_file", slow_write)
        prewarm = asyncio.create_task(post(server, "/v1/cache/prewarm", body(a_two, "A")))
        async with asyncio.timeout(30):
            await writing.wait()
        turn = asyncio.create_task(chat(server, sdk, c_two, "C"))
        status, doc = await prewarm
        got = await turn
        monkeypatch.setattr(SessionSpill, "_write_file", write)
        assert doc["prewarmed"] is False and doc["why"] == "yielded", doc
        assert doc["saved"]["skipped"] == "stopped", doc
        assert "restore" not in doc
        assert _cache(got)["source"] == "end", _cache(got)
        status, seen = await post(server, "/v1/cache/peek", body(a_two, "A"))
        spill = (await stats(server)).get("tiers", {}).get("spill", {})
    assert seen["tier"] == "nvme_spill", seen
    assert spill.get("skips", {}).get("stopped") == 1, spill
