"""The session spill through the HTTP server (issue 16, parts 1 and 2), on the small real model:
a planned stop writes the conversation in its slot and the next process reads it back before
its first request, so the next turn resumes at its end; a conversation the park gave up to a
third one is read back from the NVMe at its next turn; a corrupt block is deleted and the turn
recomputed, never served.

Gate: the rows past the end anchor were written by decoding, so the gate is the greedy one: the
same tokens as a server that never stopped (or, for a corrupt entry, as a cold server)."""

import msgspec

from tandem.config import CacheConfig, DiskConfig, SpeculationConfig, SpillConfig
from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS, ENGINE

SYSTEM = "You are a careful assistant who keeps a ledger of words and answers briefly. " * 6


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5003}" for i in range(n))


def _config(make_config, *, store: bool = True, **engine):
    config = make_config(window=4096, allow_forced_output=True, **engine)
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"),
        cache=CacheConfig(store=store),
        disk=DiskConfig(disk_cache_min_free_gb=0, disk_cache_min_tokens=1 << 20),
        spill=SpillConfig(session_spill_min_tokens=64, session_spill_park_min_tokens=64))


async def _turn(client, text: str, session: str):
    return await client.completions.create(model="small", prompt=text, max_tokens=6,
                                           temperature=0, extra_body={"session_id": session})


async def _cold(config, small_loaded, serve, sdk, turns: dict[str, str]) -> dict:
    """The reference: each (session: text) on a server with the caches off, in a home of its
    own (the spill would bring the tested server's conversations back)."""
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False),
                                   home=config.home + "-cold")
    async with serve(build_app(cold, small_loaded)) as server:
        return {name: await _turn(sdk(server), text, name) for name, text in turns.items()}


def _entries(config) -> list:
    root = config.disk_cache_path() / "sessions"
    return [p for p in root.iterdir() if p.is_dir()] if root.exists() else []


async def test_a_planned_stop_writes_the_conversation_and_the_next_start_resumes_at_its_end(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    first = SYSTEM + _words(1, 120)
    async with serve(build_app(config, small_loaded)) as server:
        one = await _turn(sdk(server), first, "a")
    assert len(_entries(config)) == 1, "the drain wrote nothing"
    second = first + one.choices[0].text + " And then? " + _words(2, 30)
    async with serve(build_app(config, small_loaded)) as server:
        assert server.app[ENGINE].spill_counts["read_at_start"] == 1
        two = await _turn(sdk(server), second, "a")
    assert _cache(two)["source"] == "end", _cache(two)
    assert _cache(two)["cached"] >= len(small_loaded.tokenizer.encode_text(first))
    # The reference: the same two turns in one process that never stopped.
    other = msgspec.structs.replace(config, home=config.home + "-ref")
    async with serve(build_app(other, small_loaded)) as server:
        ref_one = await _turn(sdk(server), first, "a")
        ref_two = await _turn(sdk(server), second, "a")
    assert ref_one.choices[0].text == one.choices[0].text
    assert _cache(ref_two)["source"] == "end"
    assert two.choices[0].text == ref_two.choices[0].text


async def test_a_conversation_the_park_gave_up_is_read_back_from_the_spill_at_its_next_turn(
        small_loaded, make_config, serve, sdk):
    # One slot, and no state store (whose session snapshots would serve the turn from RAM).
    config = _config(make_config, parallel=1, store=False)
    texts = {name: SYSTEM + _words(seed, 150) for seed, name in enumerate("ABC", 3)}
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        for name in "ABC":  # B parks A (written as it is parked); C parks B: A's park goes
            resp = await _turn(client, texts[name], name)
            texts[name] += resp.choices[0].text + " Go on: " + _words(9, 20)
        again = await _turn(client, texts["A"], "A")
        engine = server.app[ENGINE]
        counts = dict(engine.spill_counts)
    assert counts["saves"] >= 2, counts
    assert _cache(again)["source"] == "spill", (_cache(again), counts)
    assert counts["served"] == 1
    want = (await _cold(config, small_loaded, serve, sdk, {"A": texts["A"]}))["A"]
    assert again.choices[0].text == want.choices[0].text


async def test_a_corrupt_block_is_deleted_at_the_read_and_the_turn_recomputed(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    first = SYSTEM + _words(5, 120)
    async with serve(build_app(config, small_loaded)) as server:
        one = await _turn(sdk(server), first, "a")
    [entry] = _entries(config)
    blocks = sorted(p for p in entry.iterdir() if p.name.startswith("blk-"))
    assert blocks
    data = bytearray(blocks[0].read_bytes())
    data[len(data) // 2] ^= 0x5A
    blocks[0].write_bytes(bytes(data))
    second = first + one.choices[0].text + " Once more: " + _words(6, 20)
    async with serve(build_app(config, small_loaded)) as server:
        engine = server.app[ENGINE]
        assert engine.spill_counts["read_at_start"] == 0
        two = await _turn(sdk(server), second, "a")
    assert _cache(two)["source"] == "cold"
    want = (await _cold(config, small_loaded, serve, sdk, {"a": second}))["a"]
    assert two.choices[0].text == want.choices[0].text


QUESTION = ("I am planning a small vegetable garden on a balcony that gets morning sun. What "
            "should I grow first, and how deep do the pots need to be? ") * 6
REASONING = "The user asks about a balcony garden; morning sun suits leafy greens."
ANSWER = "Start with lettuce and herbs in pots 20 cm deep."
FOLLOW = "And what about tomatoes?"


async def _chat(client, messages, session, forced=None, max_tokens=8):
    extra = {"session_id": session}
    if forced is not None:
        extra["tandem_forced_output"] = forced
    return await client.chat.completions.create(model="small", messages=messages,
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body=extra)


async def _first_turn(client, session="chat"):
    """The chat's first turn, its reasoning forced; the copy the client sends back next, the
    answer without that reasoning (Open WebUI's)."""
    messages = [{"role": "user", "content": QUESTION}]
    first = await _chat(client, messages, session, f"{REASONING}\n</think>\n\n{ANSWER}",
                        max_tokens=120)
    assert first.choices[0].message.content == ANSWER
    return messages + [{"role": "assistant", "content": ANSWER},
                       {"role": "user", "content": FOLLOW}]


async def _reference(config, small_loaded, serve, sdk):
    """The second turn on a server that kept the chat in place all along."""
    other = msgspec.structs.replace(config, home=config.home + "-ref")
    async with serve(build_app(other, small_loaded)) as server:
        client = sdk(server)
        return await _chat(client, await _first_turn(client), "chat")


async def test_a_copy_without_its_reasoning_resumes_at_the_end_read_back_at_the_start(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    async with serve(build_app(config, small_loaded)) as server:
        second = await _first_turn(sdk(server))
    async with serve(build_app(config, small_loaded)) as server:
        got = await _chat(sdk(server), second, "chat")
    want = await _reference(config, small_loaded, serve, sdk)
    assert _cache(want)["source"] == "end" and _cache(want)["aligned"] == "reasoning"
    # The end record (its regions) came back with the entry: the copy aligns as in RAM.
    assert {k: _cache(got)[k] for k in ("source", "cached", "reread", "aligned")} == \
        {k: _cache(want)[k] for k in ("source", "cached", "reread", "aligned")}
    assert got.choices[0].message.content == want.choices[0].message.content


async def test_a_copy_without_its_reasoning_aligns_on_the_entry_the_park_gave_up(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config, parallel=1, store=False)
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        second = await _first_turn(client)
        for seed, name in ((11, "B"), (12, "C")):  # B parks the chat, C takes the park
            await _turn(client, SYSTEM + _words(seed, 150), name)
        got = await _chat(client, second, "chat")
        counts = dict(server.app[ENGINE].spill_counts)
    want = await _reference(config, small_loaded, serve, sdk)
    assert _cache(got)["source"] == "spill", (_cache(got), counts)
    assert _cache(got)["aligned"] == "reasoning"
    assert _cache(got)["cached"] == _cache(want)["cached"]
    assert got.choices[0].message.content == want.choices[0].message.content


async def test_a_full_disk_mid_save_costs_the_entry_and_never_the_request(
        small_loaded, make_config, serve, sdk, monkeypatch):
    import errno

    from tandem.io import direct

    config = _config(make_config, parallel=1, store=False)
    texts = {name: SYSTEM + _words(seed, 150) for seed, name in enumerate("ABC", 21)}
    real = direct.DirectFile.pwrite_from
    failing = {"on": False}

    def full(self, *args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    # The spill's block and anchor files go out through DirectFile (the disk tier's too, which
    # the config keeps from writing anything here).
    monkeypatch.setattr(direct.DirectFile, "pwrite_from", full)
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        resp = await _turn(client, texts["A"], "A")
        texts["A"] += resp.choices[0].text + " Go on: " + _words(9, 20)
        failing["on"] = True  # every save from here finds the disk full
        for name in "BC":
            await _turn(client, texts[name], name)
        again = await _turn(client, texts["A"], "A")
        failing["on"] = False
        counts = dict(server.app[ENGINE].spill_counts)
    assert counts["save_skipped"].get("failed", 0) >= 1, counts
    assert _cache(again)["source"] != "spill"
    want = (await _cold(config, small_loaded, serve, sdk, {"A": texts["A"]}))["A"]
    assert again.choices[0].text == want.choices[0].text


async def test_a_planned_stop_writes_the_parked_conversation_too_and_both_resume_after_it(
        small_loaded, make_config, serve, sdk):
    # One slot, no store, and no write as a conversation is parked: only the drain writes.
    config = _config(make_config, parallel=1, store=False)
    config = msgspec.structs.replace(config, spill=SpillConfig(
        session_spill_min_tokens=1 << 20, session_spill_park_min_tokens=1 << 20))
    texts = {name: SYSTEM + _words(seed, 150) for seed, name in enumerate("AB", 31)}
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        for name in "AB":  # B parks A
            resp = await _turn(client, texts[name], name)
            texts[name] += resp.choices[0].text + " Go on: " + _words(9, 20)
        assert server.app[ENGINE].spill_counts["saves"] == 0
    assert len(_entries(config)) == 2, "the drain wrote the slot's and the parked conversation"
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        # B was in place: it comes back into the slot; A is read back at its turn.
        b = await _turn(client, texts["B"], "B")
        a = await _turn(client, texts["A"], "A")
    assert _cache(b)["source"] == "end", _cache(b)
    assert _cache(a)["source"] == "spill", _cache(a)
    want = await _cold(config, small_loaded, serve, sdk, {name: texts[name] for name in "AB"})
    assert a.choices[0].text == want["A"].choices[0].text
    assert b.choices[0].text == want["B"].choices[0].text


async def test_the_slot_read_back_at_the_start_is_its_sessions_again(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    first = SYSTEM + _words(41, 120)
    async with serve(build_app(config, small_loaded)) as server:
        one = await _turn(sdk(server), first, "mine")
    async with serve(build_app(config, small_loaded)) as server:
        stats = (await server.app[CACHE_STATS]())["owners"]["resident"]["slots"]
        two = await _turn(sdk(server), first + one.choices[0].text + " More.", "mine")
    # The slot holds the session again (placed by its key, not by its rows alone).
    assert [s["session"] for s in stats] == [True, False, False, False], stats
    assert _cache(two)["source"] == "end" and _cache(two)["slot"] == 0
