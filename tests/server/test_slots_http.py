"""Slots through the HTTP server (tandem/cache/slots.py), on the small real model: several
conversations stay in place at once, each resumes at its own end anchor every turn whatever
came between, and answers as a server that forwards every prompt cold (greedy gate: the rows
past the end were written by decoding).

The reference is a server with the caches off, the conversations interleaved so that its
engine never extends the rows in place: each of its prompts runs from token 0."""

import asyncio
from pathlib import Path

import msgspec

from tandem.config import CacheConfig, SpeculationConfig
from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS, ENGINE

SYSTEM = "You are a careful assistant who answers in one short line. " * 8


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5003}" for i in range(n))


async def _run(client, order, first_user, turns_follow):
    """Play the conversations in ``order`` (names) on the completions route: each turn sends
    the conversation so far as text, the model's own greedy answers in it, and a new line.
    Returns every response."""
    texts = {name: SYSTEM + first_user(name) for name in set(order)}
    turn = {name: 0 for name in texts}
    out = []
    for name in order:
        resp = await client.completions.create(model="small", prompt=texts[name], max_tokens=6,
                                               temperature=0)
        out.append((name, turn[name], resp))
        turn[name] += 1
        texts[name] += resp.choices[0].text + turns_follow(name, turn[name])
    return out


async def _both(small_loaded, make_config, serve, sdk, order, first_user, follow, **knobs):
    config = make_config(window=4096, **knobs)
    async with serve(build_app(config, small_loaded)) as server:
        slots = await _run(sdk(server), order, first_user, follow)
        stats = await server.app[CACHE_STATS]()
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        reference = await _run(sdk(server), order, first_user, follow)
    for (name, turn, got), (_, _, want) in zip(slots, reference):
        assert _cache(want)["source"] == "cold", (name, turn)
        # The greedy gate: the same tokens as prompts forwarded from token 0.
        assert got.choices[0].text == want.choices[0].text, (name, turn)
    return slots, stats


async def test_two_conversations_alternating_each_resume_at_their_own_end(
        small_loaded, make_config, serve, sdk):
    slots, stats = await _both(small_loaded, make_config, serve, sdk, "ABABAB",
                               lambda name: _words(ord(name), 120),
                               lambda name, turn: f"Turn {turn} of {name}: " + _words(turn, 8))
    for name, turn, resp in slots:
        cache = _cache(resp)
        if turn == 0:
            continue
        assert cache["source"] == "end", (name, turn, cache)
        assert cache["reread"] < 60, (name, turn, cache)  # the new line, not the history
    assert {resp.usage.model_extra["tandem"]["cache"]["slot"] for name, _, resp in slots
            if name == "A"} == {0}
    assert {resp.usage.model_extra["tandem"]["cache"]["slot"] for name, _, resp in slots
            if name == "B"} == {1}
    resident = stats["tiers"]["resident"]
    assert resident["guests"] == 0 and resident["end_hits"] == 4
    assert stats["owners"]["park"]["parks"] == 0  # nobody left a slot


async def test_four_conversations_then_the_first_again_resumes_at_its_end(
        small_loaded, make_config, serve, sdk):
    slots, stats = await _both(small_loaded, make_config, serve, sdk, "ABCDA",
                               lambda name: _words(ord(name), 80),
                               lambda name, turn: f"And {name} again: " + _words(turn, 6))
    name, turn, last = slots[-1]
    assert (name, turn) == ("A", 1)
    assert _cache(last)["source"] == "end" and _cache(last)["slot"] == 0
    assert sorted(_cache(resp)["slot"] for _, _, resp in slots[:4]) == [0, 1, 2, 3]
    assert len(stats["owners"]["resident"]["slots"]) == 4


async def test_a_short_conversation_beside_a_long_one_resumes_at_its_end_every_turn(
        small_loaded, make_config, serve, sdk):
    """The short one is under a quarter of the long one: with one slot it would be a guest
    and keep nothing; with slots it takes a side slot, needs no stash and keeps its end."""
    order = "LSLSLS"
    slots, stats = await _both(small_loaded, make_config, serve, sdk, order,
                               lambda name: _words(3, 400) if name == "L" else "Hi there.",
                               lambda name, turn: f"More {turn}.")
    for name, turn, resp in slots:
        if turn:
            assert _cache(resp)["source"] == "end", (name, turn, _cache(resp))
    resident = stats["tiers"]["resident"]
    assert resident["guests"] == 0 and resident["stash_bytes"] == 0


async def test_a_new_conversation_with_every_slot_held_keeps_a_slot_from_its_first_turn(
        small_loaded, make_config, serve, sdk):
    """Four long conversations hold the four slots; a short new one takes the least recently
    used (A's: A leaves for the park) as no guest, and resumes at its own end from its next
    turn on. Greedy gate against a server that forwards every prompt cold. Before, its first
    turn was a guest that kept nothing and its second re-read the whole conversation."""
    slots, stats = await _both(small_loaded, make_config, serve, sdk, "ABCDSASCS",
                               lambda name: ("Hi there." if name == "S"
                                             else _words(ord(name), 400)),
                               lambda name, turn: f"More {turn} for {name}.")
    short = [_cache(resp) for name, turn, resp in slots if name == "S"]
    # A's slot (the least recently used), from the grid line of the system text they share
    assert short[0]["source"] == "resident" and short[0]["slot"] == 0, short[0]
    # A came back from the park to the slot it left, S left for the park and came back at its
    # end; then S resumes at its end in place
    assert [(c["source"], c["slot"]) for c in short[1:]] == [("park", 0), ("end", 0)], short
    assert all(c["reread"] < 30 for c in short[1:]), short  # the new line, not the history
    back = [_cache(resp) for name, turn, resp in slots if name == "A" and turn]
    assert back[0]["source"] == "park" and back[0]["reread"] < 30, back
    for name, turn, resp in slots:
        if name == "C" and turn:  # the long ones in place resume at their end
            assert _cache(resp)["source"] == "end", (name, _cache(resp))
    resident = stats["tiers"]["resident"]
    assert resident["guests"] == 0 and resident["stash_bytes"] == 0


async def test_one_slot_serves_the_short_conversation_as_a_guest_that_keeps_nothing(
        small_loaded, make_config, serve, sdk):
    """The same conversations with ``parallel`` 1: the short one is a guest every turn and
    re-reads its whole prompt, which is what the side slot saves."""
    config = make_config(window=4096, parallel=1)
    async with serve(build_app(config, small_loaded)) as server:
        slots = await _run(sdk(server), "LSLS",
                           lambda name: _words(3, 400) if name == "L" else "Hi there.",
                           lambda name, turn: f"More {turn}.")
        stats = await server.app[CACHE_STATS]()
    short = [resp for name, turn, resp in slots if name == "S"]
    assert all(_cache(resp)["source"] != "end" for resp in short)
    assert stats["tiers"]["resident"]["guests"] == 2


async def test_every_slot_is_reported_in_stats_console_metrics_usage_and_journal(
        small_loaded, make_config, serve, sdk):
    import aiohttp

    from tandem.server.keys import ENGINE, JOURNAL

    config = make_config(window=4096)
    app = build_app(config, small_loaded)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        slots = await _run(sdk(server), "ABA", lambda name: _words(ord(name), 150),
                           lambda name, turn: f"Next {turn}.")
        stats = await app[CACHE_STATS]()
        snapshot = app[ENGINE].snapshot()
        async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
            metrics = await resp.text()
        rows = app[JOURNAL].tail(3)
    assert [_cache(resp)["slot"] for _, _, resp in slots] == [0, 1, 0]
    assert [row["slot"] for row in rows] == [0, 1, 0]
    owners = stats["owners"]["resident"]["slots"]
    assert [s["slot"] for s in owners] == [0, 1, 2, 3]
    assert owners[0]["end"] is not None and owners[1]["end"] is not None
    assert owners[2]["end"] is None and owners[2]["anchors"] == []
    assert stats["owners"]["resident"]["placements"] == {"empty": 2, "continues": 1}
    per_slot = stats["tiers"]["resident"]["slots"]
    assert per_slot[0]["rows_in_place"] > per_slot[1]["rows_in_place"] > 0
    assert [s["rows_in_place"] > 0 for s in snapshot["slots"]] == [True, True, False, False]
    assert not any(s["busy"] for s in snapshot["slots"])
    assert "tandem_slots_idle 4.0" in metrics and "tandem_slots_busy 0.0" in metrics
    assert "tandem_slots_holding 2.0" in metrics


async def test_a_refusal_for_memory_with_a_slot_held_costs_that_conversation_nothing(
        small_loaded, make_config, serve, sdk):
    """A's conversation is in its slot when B's prefill cannot fit: B gets a 503 with
    Retry-After, and A's next turn still resumes over its rows in place (the slots' rows are
    no cache the governor sheds) with the answer of a cold server."""
    import aiohttp

    from tandem.cache.governor import CpuAllocator

    config = make_config(window=4096)
    app = build_app(config, small_loaded)
    text = SYSTEM + _words(1, 150)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{server.port}"
        client = sdk(server)
        first = await client.completions.create(model="small", prompt=text, max_tokens=6,
                                                temperature=0)
        text += first.choices[0].text + " And then?"
        async with http.post(url + "/v1/memory/limits", json={
                "mem_ceiling_gib": 0.002, "mem_peak_gib": 0.004,
                "reserve_slack_gib": 0.001}) as resp:
            assert resp.status == 200
        body = {"model": "small", "prompt": _words(9, 200), "max_tokens": 4, "temperature": 0}
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_memory"
        machine_gib = CpuAllocator().total_nbytes() / (1 << 30)
        async with http.post(url + "/v1/memory/limits", json={
                "mem_ceiling_gib": machine_gib * 0.9, "mem_peak_gib": machine_gib,
                "reserve_slack_gib": 0.25}) as resp:
            assert resp.status == 200
        second = await client.completions.create(model="small", prompt=text, max_tokens=6,
                                                 temperature=0)
        assert _cache(second)["slot"] == 0 and _cache(second)["source"] in ("end", "resident")
        assert _cache(second)["reread"] < 20
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        want = await sdk(server).completions.create(model="small", prompt=text, max_tokens=6,
                                                    temperature=0)
    assert second.choices[0].text == want.choices[0].text


async def test_a_request_that_leaves_mid_stream_costs_the_other_slots_nothing(
        small_loaded, make_config, serve, sdk):
    """B's client leaves in the middle of its answer: B's slot is cut back, and A, in its own
    slot, resumes at its end with the answer of a cold server."""
    import aiohttp

    from tandem.server.keys import JOURNAL

    config = make_config(window=4096)
    app = build_app(config, small_loaded)
    text = SYSTEM + _words(2, 150)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        client = sdk(server)
        first = await client.completions.create(model="small", prompt=text, max_tokens=6,
                                                temperature=0)
        text += first.choices[0].text + " Go on."
        body = {"model": "small", "prompt": _words(5, 200), "max_tokens": 400,
                "temperature": 0, "stream": True}
        async with http.post(f"http://127.0.0.1:{server.port}/v1/completions",
                             json=body) as resp:
            assert (await resp.content.readline()).startswith(b"data: ")
        # leaving the block closed the connection mid-stream
        for _ in range(400):
            if len(app[JOURNAL].tail(2)) == 2:
                break
            await asyncio.sleep(0.05)
        rows = app[JOURNAL].tail(2)
        assert rows[-1]["finish_reason"] == "cancelled"
        second = await client.completions.create(model="small", prompt=text, max_tokens=6,
                                                 temperature=0)
        assert _cache(second)["slot"] == 0 and _cache(second)["source"] == "end"
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        want = await sdk(server).completions.create(model="small", prompt=text, max_tokens=6,
                                                    temperature=0)
    assert second.choices[0].text == want.choices[0].text


async def test_four_conversations_at_once_answer_as_each_alone(small_loaded, make_config, serve,
                                                              sdk):
    """Four conversations sent together, twice: each first turn's tokens and logprobs are the
    bits of the same prompt alone on a fresh server (gate 1: every state a cold prefill's),
    each second turn (resumed at its end in its own slot) the tokens of a cold server.
    Speculation off: a verify block's logprobs round otherwise than a decode step's, and the
    suffix store would draft one conversation from another's text."""
    config = msgspec.structs.replace(make_config(window=4096),
                                     speculation=SpeculationConfig(speculation="off"))

    async def turn(client, prompts):
        return await asyncio.gather(*(client.completions.create(
            model="small", prompt=p, max_tokens=6, temperature=0, logprobs=3) for p in prompts))

    firsts = [SYSTEM + f"Conversation {i}. " + _words(40 + i, 100) for i in range(4)]
    app = build_app(config, small_loaded)
    async with serve(app) as server:
        client = sdk(server)
        one = await turn(client, firsts)
        seconds = [p + r.choices[0].text + " Then?" for p, r in zip(firsts, one)]
        two = await turn(client, seconds)
        batches = app[ENGINE].snapshot()["decode_batches"]
    # They ran at once: decode steps of several slots forwarded as one batch.
    assert max(batches) >= 2, batches
    assert sorted(_cache(r)["slot"] for r in one) == [0, 1, 2, 3]
    assert [_cache(r)["slot"] for r in two] == [_cache(r)["slot"] for r in one]
    assert all(_cache(r)["source"] == "end" for r in two)
    for i, prompt in enumerate(firsts):
        async with serve(build_app(config, small_loaded)) as server:
            alone = (await turn(sdk(server), [prompt]))[0]
        assert one[i].choices[0].text == alone.choices[0].text
        assert one[i].choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
        assert one[i].choices[0].logprobs.top_logprobs == alone.choices[0].logprobs.top_logprobs
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        client = sdk(server)
        want = [(await turn(client, [p]))[0] for p in seconds]
    assert [r.choices[0].text for r in two] == [r.choices[0].text for r in want]


async def test_a_stream_that_leaves_mid_batch_costs_the_one_beside_it_nothing(
        small_loaded, make_config, serve, sdk):
    """Two streams decode in one batch; one client leaves mid-stream: its generation is
    cancelled at its next token and the other's tokens, and those of its next turn resumed at
    its end, are the ones it gets with nothing beside it (its rows are its own: a decode step's
    row is the same bits alone or in a batch)."""
    import aiohttp

    from tandem.server.keys import JOURNAL


    config = msgspec.structs.replace(make_config(window=4096),
                                     speculation=SpeculationConfig(speculation="off"))
    app = build_app(config, small_loaded)
    stays = SYSTEM + "Stays. " + _words(7, 90)
    leaves = {"model": "small", "prompt": "Leaves. " + _words(8, 90), "max_tokens": 300,
              "temperature": 0, "stream": True}
    async with serve(app) as server, aiohttp.ClientSession() as http:
        client = sdk(server)
        async with http.post(f"http://127.0.0.1:{server.port}/v1/completions",
                             json=leaves) as resp:
            assert (await resp.content.readline()).startswith(b"data: ")
            kept = asyncio.create_task(client.completions.create(
                model="small", prompt=stays, max_tokens=40, temperature=0))
            # Both decoding (the one that stays has its first token out) before it leaves.
            while not [r for r in app[ENGINE].snapshot()["requests"]
                       if r["phase"] == "decode"][1:]:
                await asyncio.sleep(0.01)
        # leaving the block closed the streaming connection mid-batch
        got = await kept
        for _ in range(400):
            if len(app[JOURNAL].tail(2)) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(r["finish_reason"] for r in app[JOURNAL].tail(2)) == ["cancelled",
                                                                            "length"]
        assert app[ENGINE].snapshot()["decode_batches"].get(2, 0) >= 1
        again = await client.completions.create(model="small", prompt=stays + got.choices[0].text
                                                + " More.", max_tokens=6, temperature=0)
        assert _cache(again)["source"] == "end" and _cache(again)["slot"] == _cache(got)["slot"]
    # The reference: the same two turns on a server where nothing ran beside them (the second
    # is served at the end with the engine's own rows, aligned to the client's copy, as there).
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        want = await client.completions.create(model="small", prompt=stays, max_tokens=40,
                                               temperature=0)
        want_again = await client.completions.create(
            model="small", prompt=stays + want.choices[0].text + " More.", max_tokens=6,
            temperature=0)
        assert _cache(want_again) == _cache(again) | {"slot": 0}
    assert got.choices[0].text == want.choices[0].text
    assert again.choices[0].text == want_again.choices[0].text



async def test_four_conversations_at_once_with_speculation_answer_as_each_alone(
        small_loaded, make_config, serve, sdk, monkeypatch):
    """Four conversations sent together with speculation on, each drafted from the suffix
    store its earlier answer wrote: their verify blocks run in the batched step beside the
    others' decode steps and blocks, and each answer's tokens and logprobs are the bits of
    the same prompt sent alone after the same history (a block's logits are its own in any
    batch), its tokens those of its earlier answer (greedy: speculation writes the target's)."""
    import aiohttp

    from tandem.actors import engine_actor
    from tandem.engine import VerifyStep
    from test_speculation_http import indexed

    kinds: list[list[bool]] = []
    batch = engine_actor.decode_batch

    def recording(steps):
        kinds.append([isinstance(s, VerifyStep) for s in steps])
        return batch(steps)

    monkeypatch.setattr(engine_actor, "decode_batch", recording)
    config = msgspec.structs.replace(make_config(window=4096),
                                     speculation=SpeculationConfig(speculation="lookup"))
    prompts = [SYSTEM + f"Conversation {i}. " + _words(60 + i, 60) for i in range(4)]

    def ask(client, prompt):
        return client.completions.create(model="small", prompt=prompt, max_tokens=24,
                                         temperature=0, logprobs=2)

    async def run(home, sent):
        """The four prompts one by one (the store learns their answers), then ``sent``
        together."""
        cfg = msgspec.structs.replace(config, home=str(home))
        async with serve(build_app(cfg, small_loaded)) as server, aiohttp.ClientSession() as s:
            client = sdk(server)
            first = [await ask(client, p) for p in prompts]
            await indexed(s, f"http://127.0.0.1:{server.port}")
            return first, await asyncio.gather(*(ask(client, prompts[i]) for i in sent))

    home = Path(config.home)
    first, together = await run(home / "together", range(4))
    assert any(any(k) and len(k) > 1 for k in kinds), "no verify block ran in a batch"
    for i, got in enumerate(together):
        assert got.usage.model_extra["tandem"]["speculation"]["drafted"] > 0, i
        _, (alone,) = await run(home / f"alone{i}", [i])
        got, want = got.choices[0], alone.choices[0]
        assert got.text == want.text == first[i].choices[0].text, i
        assert got.logprobs.token_logprobs == want.logprobs.token_logprobs, i
        assert got.logprobs.top_logprobs == want.logprobs.top_logprobs, i


async def test_resumed_turns_sent_together_take_their_tails_in_one_batch(
        small_loaded, make_config, serve, sdk, monkeypatch):
    """Four conversations in place, their next turns (each its answer sent back and a new line)
    sent together: each resumes at its end anchor, its few new tokens a TailStep that waits in
    the scheduler's batch for the next request's plan (TAIL_WAIT_S, raised here so that a slow
    host's plan still joins), so that two or more of them run in one batched step; and each
    answer is the one the same turn gets sent alone after the same history (greedy gate)."""
    from tandem.actors import engine_actor
    from tandem.engine import TailStep

    tails: list[int] = []
    batch = engine_actor.decode_batch

    def recording(steps):
        tails.append(sum(isinstance(s, TailStep) for s in steps))
        return batch(steps)

    monkeypatch.setattr(engine_actor, "decode_batch", recording)
    monkeypatch.setattr(engine_actor, "TAIL_WAIT_S", 2.0)
    config = make_config(window=4096)
    prompts = [SYSTEM + f"Conversation {i}. " + _words(80 + i, 40) for i in range(4)]

    def ask(client, prompt):
        return client.completions.create(model="small", prompt=prompt, max_tokens=8,
                                         temperature=0)

    async def run(home, sent):
        """Every conversation's first turn one by one, then the second turns of ``sent``
        together."""
        cfg = msgspec.structs.replace(config, home=str(home))
        async with serve(build_app(cfg, small_loaded)) as server:
            client = sdk(server)
            first = [await ask(client, p) for p in prompts]
            nexts = [p + r.choices[0].text + f" And then {i}?"
                     for i, (p, r) in enumerate(zip(prompts, first))]
            tails.clear()
            return await asyncio.gather(*(ask(client, nexts[i]) for i in sent))

    home = Path(config.home)
    together = await run(home / "together", range(4))
    assert max(tails) >= 2, tails
    for i, got in enumerate(together):
        assert _cache(got)["source"] == "end", i
        (alone,) = await run(home / f"alone{i}", [i])
        assert tails and max(tails) == 1
        assert got.choices[0].text == alone.choices[0].text, i


async def test_a_long_prefill_planned_behind_a_waiting_tail_lets_the_tail_go_first(
        small_loaded, make_config, serve, sdk, monkeypatch):
    """A resumed turn (its tail in the batch) and a long cold prompt sent right behind it: the
    batch that waited for the long prompt's plan runs before that prompt's first chunk, so the
    turn's first token never waits for a chunk it waited to batch with (the engine actor's
    _round); both answers are the ones each gets alone."""
    import tandem.engine as engine_mod
    from tandem.actors import engine_actor
    from tandem.engine import TailStep
    from tandem.models.hybrid import HybridModel

    events: list[str] = []
    batch, forward = engine_actor.decode_batch, HybridModel.forward

    class Yielded(TailStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            events.append("yield")

    monkeypatch.setattr(engine_mod, "TailStep", Yielded)

    def recording(steps):
        if any(isinstance(s, TailStep) for s in steps):
            events.append("tail")
        return batch(steps)

    def chunks(self, state, token_ids, start, *args, **kwargs):
        if len(token_ids) > 16:
            events.append("chunk")
        return forward(self, state, token_ids, start, *args, **kwargs)

    monkeypatch.setattr(engine_actor, "decode_batch", recording)
    monkeypatch.setattr(HybridModel, "forward", chunks)
    monkeypatch.setattr(engine_actor, "TAIL_WAIT_S", 2.0)
    config = make_config(window=4096)
    turn = SYSTEM + "Conversation T. " + _words(90, 40)
    long = "Another one. " + _words(91, 400)

    def ask(client, prompt):
        return client.completions.create(model="small", prompt=prompt, max_tokens=6,
                                         temperature=0)

    async def run(home, both):
        cfg = msgspec.structs.replace(config, home=str(home))
        async with serve(build_app(cfg, small_loaded)) as server:
            client = sdk(server)
            first = await ask(client, turn)
            nxt = turn + first.choices[0].text + " And then?"
            events.clear()
            if not both:
                return [await ask(client, nxt), await ask(client, long)]
            resumed = asyncio.ensure_future(ask(client, nxt))
            await asyncio.sleep(0)  # its request first, the long one right behind it
            return await asyncio.gather(resumed, ask(client, long))

    home = Path(config.home)
    got = await run(home / "both", True)
    assert "tail" in events and "chunk" in events, events
    # between the tail's yield and its batch, no chunk of the other prompt (whichever came first)
    assert "chunk" not in events[events.index("yield"):events.index("tail")], events
    want = await run(home / "alone", False)
    assert [r.choices[0].text for r in got] == [r.choices[0].text for r in want]
