"""/v1/cache/stats and the console's cache and memory parts ask each actor on the loop: the
store's counters are the store actor's answer (computed in its handler, in its mailbox's order),
the resident's the dict the engine actor published, and the JSON keeps its shape."""

import aiohttp

from tandem.cache.governor import MemoryGovernor
from tandem.cache.store import StoreCore
from tandem.server.app import build_app
from tandem.server.keys import SUPERVISOR


async def test_the_store_counters_are_computed_in_the_store_actors_handler(
        small_loaded, make_config, serve, sdk, monkeypatch):
    app = build_app(make_config(), small_loaded)
    actors = app[SUPERVISOR].actors
    store = actors["store"]
    asked: list[str | None] = []
    statistics = StoreCore.statistics

    def watched(core):
        asked.append(store.current_message_type)
        return statistics(core)

    monkeypatch.setattr(StoreCore, "statistics", watched)
    memory_statistics = MemoryGovernor.statistics
    reported: list[str | None] = []

    def watched_memory(core, stats=None):
        reported.append(actors["governor"].current_message_type)
        return memory_statistics(core, stats)

    monkeypatch.setattr(MemoryGovernor, "statistics", watched_memory)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "a b c"}], max_tokens=2,
            extra_body={"conversation_id": "c1"})
        base = f"http://127.0.0.1:{server.port}"
        async with http.get(f"{base}/v1/cache/stats") as resp:
            assert resp.status == 200
            tiers = (await resp.json())["tiers"]
        async with http.get(f"{base}/v1/actors") as resp:
            doc = await resp.json()
        async with http.get(f"{base}/v1/memory") as resp:
            memory = await resp.json()
    assert asked and set(asked) == {"GetStoreStats"}
    assert reported and set(reported) == {"GetMemoryReport"}
    assert {"resident", "store"} <= set(tiers)
    assert tiers["resident"]["cold"] == 1 and tiers["store"]["session_puts"] == 1
    assert set(tiers["store"]) == set(statistics(store.core))
    assert doc["errors"] == {} and doc["cache"]["tiers"]["store"] == tiers["store"]
    assert doc["memory"]["prefills"] == memory["prefills"] == 1


async def test_the_actors_document_lists_the_resident_and_the_park_with_their_mailboxes(
        small_loaded, make_config, serve, sdk):
    """The tiers are actors (issue 12, part 1): /v1/actors lists them, with their mailboxes,
    and the graph shows the engine's offers and give-backs reaching them."""
    app = build_app(make_config(), small_loaded)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "a b c"}], max_tokens=2)
        async with http.get(f"http://127.0.0.1:{server.port}/v1/actors") as resp:
            doc = await resp.json()
        async with http.get(f"http://127.0.0.1:{server.port}/v1/cache/stats") as resp:
            owners = (await resp.json())["owners"]
    # Each tier's own account, asked of it: the holdings are back, one generation lent.
    assert owners["resident"]["lent_to"] is None and owners["resident"]["lent_total"] == 1
    assert owners["park"]["lent_to"] is None and owners["park"]["parked"] is None
    actors = {a["name"]: a for a in doc["actors"]}
    for name in ("resident", "park"):
        assert actors[name]["state"] == "running"
        assert actors[name]["mailbox_capacity"] > 0
        assert actors[name]["handled_by_type"]["OfferTiers"] == 1
        assert actors[name]["handled_by_type"]["GenerationEnded"] == 1
    edges = {(e["sender"], e["receiver"]) for e in doc["graph"]["edges"]}
    assert {("engine", "resident"), ("engine", "park")} <= edges


async def test_the_engine_thread_asks_nothing_of_the_store_the_loop_asks_for_the_plan(
        small_loaded, make_config, serve, sdk, monkeypatch):
    """Issue 12, part 2: the store's offer, the prefix lines' admissions and the session put's
    admission are asked on the loop (the first two into the PrefillPlan, the last between the
    thread's decode and its end anchor); the engine thread's port only tells what it hands
    over (the lease back, the snapshots inserted)."""
    from tandem.actors.store import StoreActorPort

    asked: list[tuple[str, str | None]] = []
    ask = StoreActorPort._ask

    def watched(port, msg):
        asked.append((type(msg).__name__, getattr(msg, "kind", None)))
        return ask(port, msg)

    monkeypatch.setattr(StoreActorPort, "_ask", watched)
    app = build_app(make_config(), small_loaded)
    store = app[SUPERVISOR].actors["store"]
    text = " ".join(f"w{i}" for i in range(150))  # past two 64-token grid lines
    async with serve(app) as server:
        client = sdk(server)
        for _ in range(2):
            await client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": text}], max_tokens=2,
                extra_body={"conversation_id": "c1"})
    assert asked == []
    handled = store.statistics().handled_by_type
    assert handled["StoreOffer"] == 2 and handled["StoreAdmit"] >= 3  # a prefix line, 2 puts
    assert handled["StoreInsert"] >= 2 and handled["StoreRelease"] >= 1


async def test_each_owner_keeps_its_own_accounts_and_tells_the_governor_what_it_holds(
        small_loaded, make_config, serve, sdk):
    """Issue 12, part 4: the resident, the park and the store each keep an accountant of their
    own (none is written by another owner's thread), and /v1/memory's levels are what each
    told the governor it holds (TierHeld), equal to its own accounts once a request is done.
    The end records are the resident's too, in its holdings."""
    app = build_app(make_config(), small_loaded)
    actors = app[SUPERVISOR].actors
    resident, park, store = actors["resident"], actors["park"], actors["store"]
    accounts = {id(resident.holdings.anchors.memory), id(park.holdings.park.memory),
                id(store.core.memory)}
    assert len(accounts) == 3
    assert resident.holdings.records is not None
    async with serve(app) as server, aiohttp.ClientSession() as http:
        await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "a b c"}], max_tokens=2,
            extra_body={"conversation_id": "c1"})
        async with http.get(f"http://127.0.0.1:{server.port}/v1/memory") as resp:
            levels = (await resp.json())["levels"]
    told = actors["governor"].held
    assert set(told) == {"resident", "park", "store", "slots"}
    own = {**resident.holdings.anchors.memory.holding(), **park.holdings.park.memory.holding(),
           **store.core.memory.holding(), "slots": actors["engine"].slot_rows_nbytes()}
    assert levels == own and levels["end"] > 0 and levels["store"] > 0 and levels["slots"] > 0


async def test_the_servers_actor_trace_keeps_each_messages_route_and_time_but_no_contents(
        small_loaded, make_config, serve, sdk):
    """Nothing in the server reads a trace entry's summary, and making one walked every
    message's token lists (a 16k-token warm hit paid tens of milliseconds on a cold CPU): the
    server's trace records types, routes and handler times only."""
    app = build_app(make_config(), small_loaded)
    trace = app[SUPERVISOR].trace
    async with serve(app) as server:
        await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "a b c d"}], max_tokens=2)
    entries = trace.entries()
    assert entries and {e.type for e in entries} >= {"Generate"}
    assert all(e.summary is None for e in entries)
