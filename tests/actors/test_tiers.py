"""The resident prefix and the park as actors (issue 12, parts 1 and 2): when a job gets the
engine, each tier answers the engine actor's OfferTiers and lends its holdings; the plan is
built on the loop and handed to the engine thread; the thread tells AnchorWritten as its
prefill anchors grid lines; GenerationEnded gives the holdings back. Driven through the real
EngineActor, Engine and tiers, with requests injected by the harness.

Gates: the plan's resume is the one the synchronous composer makes over the same tiers (the
greedy tokens and the bits of the rows are a plain engine's: tests/cache hold the composer's
exactness; here the protocol)."""

from __future__ import annotations

import asyncio

import pytest
from generation_run import run_generation

from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (Generate, GenerationFailed, GenerationFinished,
                                           GenerationParams, TokenGenerated)
from tandem.actors.harness import Harness
from tandem.actors.tier_messages import GetTierStats, OfferTiers
from tandem.actors.tiers import ParkActor, ResidentActor, TierLendingError
from tandem.cache.memory import MemoryAccountant
from tandem.cache.resident import ResidentPrefix, make_holdings
from tandem.engine import Engine, SamplingParams
from tandem.models.third import ThirdModel

WINDOW, CHUNK = 512, 16
MiB = 1 << 20
LEVELS = ("anchors", "end", "stash", "park", "pin", "prompt_end")


def _prompt(n: int, seed: int) -> list[int]:
    return [(i * 7 + seed * 13 + 3) % 97 for i in range(n)]


def _system(harness: Harness, model=None):
    memory = MemoryAccountant({level: 64 * MiB for level in LEVELS})
    held, parked = make_holdings(memory, CHUNK)
    resident = harness.add(ResidentActor("resident", holdings=held))
    park = harness.add(ParkActor("park", holdings=parked))
    engines: list[Engine] = []

    def make_engine():
        engines.append(Engine(model or ThirdModel(), window=WINDOW, prefix_chunk=CHUNK))
        return engines[0]

    engine = harness.add(EngineActor(
        "engine", make_engine=make_engine,
        make_resident=lambda e: ResidentPrefix.lent_to(e, memory), tiers=(resident, park)))
    return resident, park, engine, engines




async def test_a_generate_goes_through_offers_a_plan_anchor_tells_and_generation_ended():
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    resident, park, _, _ = _system(harness)
    prompt = _prompt(40, 1)
    async with harness:
        _, done = await run_generation(harness, client, "a", prompt)
        assert isinstance(done, GenerationFinished)
        follow = prompt + [5, 6, 7] + _prompt(30, 2)
        _, done = await run_generation(harness, client, "b", follow)
        await asyncio.sleep(0)  # the give-back tells are queued before the finish event
        stats = await harness.ask("resident", GetTierStats())
    entries = [(e.type, e.sender, e.receiver) for e in harness.trace.entries()]
    for request in ("a", "b"):
        seq = [t for t in entries if t[0] in ("OfferTiers", "PrefillPlan", "AnchorWritten",
                                               "GenerationEnded")]
        assert ("OfferTiers", "engine", "resident") in seq
        assert ("OfferTiers", "engine", "park") in seq
    kinds = [t[0] for t in entries if t[0] in ("OfferTiers", "PrefillPlan", "AnchorWritten",
                                               "GenerationEnded")]
    # a: two offers, the plan, the park given back once the restore is done (the next plan
    # may borrow it while this one runs), anchors at 16 and 32, the resident given back; b
    # likewise, its anchors at 48 and 64 (its prefill resumed past 32).
    assert kinds == (["OfferTiers", "OfferTiers", "PrefillPlan", "GenerationEnded",
                      "AnchorWritten", "AnchorWritten", "GenerationEnded"] * 2)
    plans = [e for e in harness.trace.entries() if e.type == "PrefillPlan"]
    assert [e.receiver for e in plans] == ["engine.thread"] * 2
    assert stats.lent_to is None and stats.stats["lent_total"] == 2
    assert stats.stats["anchors_written"] == 4
    assert stats.stats["anchors"] == [16, 32, 48, 64]


async def test_the_resident_is_lent_while_a_generation_runs_and_the_park_through_its_restore():
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    resident, park, engine, _ = _system(harness)
    async with harness:
        await harness.ask("engine", Generate("long", _prompt(60, 3),
                                             GenerationParams(max_tokens=200),
                                             reply_to=client))
        await client.expect(TokenGenerated, 20)
        during = await harness.ask("resident", GetTierStats())
        during_park = await harness.ask("park", GetTierStats())
        while not isinstance(await client.expect((TokenGenerated, GenerationFinished), 20),
                             GenerationFinished):
            pass
        await asyncio.sleep(0)
        after = await harness.ask("resident", GetTierStats())
    # The park went back once the restore was done: the next request's plan borrows it while
    # this one decodes.
    assert during.lent_to == "long" and during_park.lent_to is None
    assert during_park.stats["lent_total"] == 1
    assert after.lent_to is None


async def test_a_tier_lent_already_refuses_a_second_offer():
    memory = MemoryAccountant({level: MiB for level in LEVELS})
    held, _ = make_holdings(memory, CHUNK)
    harness = Harness()
    harness.add(ResidentActor("resident", holdings=held))
    with pytest.raises(AssertionError, match="an actor failed"):
        async with harness:
            await harness.ask("resident", OfferTiers("a", [1, 2, 3], []))
            with pytest.raises(Exception):
                await harness.ask("resident", OfferTiers("b", [1, 2, 3], []), timeout_s=1)
            await harness.until_stopped()
    assert isinstance(harness.supervisor.exception, TierLendingError)


async def test_two_sessions_and_guests_alternating_hard_keep_every_tier_sound():
    """The engine thread and the loop run hard together: two sessions that park each other, a
    guest between them, while the loop asks the tiers and the engine for their state as fast
    as it can. Each tier checks its holdings' invariants every time they come back (a failed
    check stops the tier, and the harness fails); the greedy tokens are the ones the
    synchronous composer gives for the same sequence."""
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    _system(harness)
    head = _prompt(33, 9)
    a, b = head + _prompt(70, 4), head + _prompt(60, 5)
    guest = _prompt(10, 6)
    turns = []
    for i in range(6):
        turns += [("a", a), ("b", b)]
        if i % 2:
            turns.append((None, guest))
        a = a + _prompt(5, 10 + i)
        b = b + _prompt(4, 20 + i)
    stop = asyncio.Event()
    asked = 0

    async def hammer():
        nonlocal asked
        while not stop.is_set():
            for name in ("resident", "park"):
                await harness.ask(name, GetTierStats())
            harness["engine"].snapshot()
            asked += 1
            # A breath between rounds: a loop that never lets go of the GIL makes the engine
            # thread wait out the switch interval (5 ms) after each torch op it runs, and the
            # test model's token-by-token recurrence is thousands of them (on a two-core Xeon
            # the first turn alone took over 20 s). Still hundreds of asks a second.
            await asyncio.sleep(0.001)

    outs = []
    async with harness:
        task = asyncio.create_task(hammer())
        for n, (session, prompt) in enumerate(turns):
            tokens, done = await run_generation(harness, client, f"r{n}", prompt, 3, session)
            assert isinstance(done, GenerationFinished), done
            outs.append(tokens)
        stop.set()
        await task
    assert asked > len(turns)
    # The same sequence on the synchronous composer (its own tiers, one thread).
    memory = MemoryAccountant({level: 64 * MiB for level in LEVELS})
    engine = Engine(ThirdModel(), window=WINDOW, prefix_chunk=CHUNK)
    composer = ResidentPrefix(engine, memory)
    expected = []
    for session, prompt in turns:
        composer.begin(prompt, 3, session)
        result = engine.generate(prompt, SamplingParams(max_tokens=3),
                                 on_chunk=composer.on_chunk, on_prefill=composer.on_prefill)
        composer.finish(prompt + result.token_ids)
        expected.append(result.token_ids)
    assert outs == expected


class _Process:
    """The memory the governor measures: a base plus exactly what the caches hold."""

    device = "fake"
    BASE = 1 << 30

    def __init__(self, memory: MemoryAccountant) -> None:
        self.memory = memory

    def measure(self):
        from tandem.cache.governor import Reading
        return Reading(self.BASE + sum(self.memory.held.values()), 0)

    def release_reserve(self) -> None:
        pass

    def total_nbytes(self) -> int:
        return 4 * self.BASE


def _governed(harness: Harness):
    from tandem.cache.governor import MemoryGovernor, MemoryLimits

    memory = MemoryAccountant({level: 64 * MiB for level in LEVELS})
    held, parked = make_holdings(memory, CHUNK)
    resident = harness.add(ResidentActor("resident", holdings=held))
    park = harness.add(ParkActor("park", holdings=parked))
    process = _Process(memory)
    governor = MemoryGovernor(MemoryLimits(2 * process.BASE, 3 * process.BASE, 1 << 20),
                              process)
    harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(ThirdModel(), window=WINDOW, prefix_chunk=CHUNK),
        make_resident=lambda e: ResidentPrefix.lent_to(e, memory), tiers=(resident, park),
        governor=governor))
    return memory, governor, process


async def test_the_governor_admits_a_plan_on_the_loop_shedding_lent_tiers_or_refusing():
    """Issue 12, part 2: the governor's admission is asked on the loop, before the plan goes
    to the engine thread; what it sheds to make room comes out of the lent holdings, and a
    refusal gives them back untouched by any prefill."""
    from tandem.cache.governor import MemoryLimits

    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    memory, governor, process = _governed(harness)
    first = _prompt(80, 1)
    async with harness:
        _, done = await run_generation(harness, client, "a", first)
        assert isinstance(done, GenerationFinished)
        anchors = memory.held["anchors"]
        assert anchors > 0
        admitted: list[dict] = []
        admit = governor.admit_prefill

        async def watched(*args, **kwargs):
            workspace = await admit(*args, **kwargs)
            admitted.append(dict(governor.stats.shed_total))
            return workspace

        governor.admit_prefill = watched
        workspace = governor.workspace_nbytes(80)
        # The peak leaves the next prefill's workspace room only once the anchors and the
        # prompt-end anchor are gone (its rows are within those the first one backed).
        base = process.BASE + sum(memory.held.values())
        governor.set_limits(MemoryLimits(
            base - anchors - memory.held["prompt_end"] + 1, base + workspace - anchors
            - memory.held["prompt_end"], 1))
        _, done = await run_generation(harness, client, "b", _prompt(80, 2))
        assert isinstance(done, GenerationFinished)
        plans = [e for e in harness.trace.entries() if e.type == "PrefillPlan"]
        assert len(plans) == 2
        # Shed by the admission itself, on the loop, before the plan went to the thread.
        assert admitted[0]["anchors"] == 1 and admitted[0]["prompt_end"] == 1
        governor.set_limits(MemoryLimits(process.BASE // 4, process.BASE // 2, 1))
        _, failed = await run_generation(harness, client, "c", _prompt(100, 3))
        await asyncio.sleep(0)
        stats = await harness.ask("resident", GetTierStats())
    assert isinstance(failed, GenerationFailed) and failed.reason == "no_memory"
    assert stats.lent_to is None and stats.stats["lent_total"] == 3
    assert len([e for e in harness.trace.entries() if e.type == "PrefillPlan"]) == 2


async def test_the_plan_carries_the_moves_decided_on_the_loop(monkeypatch):
    """The plan says what the resident does (the leaving conversation's park, the pin swap's
    rows, a guest's stash, a compaction's pin), decided on the loop over the lent holdings;
    the thread carries it out (its tokens are the synchronous composer's: the stress test)."""
    plans = []
    steps = EngineActor._steps

    def watched(self, job, plan=None):
        plans.append(plan)
        return steps(self, job, plan)

    monkeypatch.setattr(EngineActor, "_steps", watched)
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    _system(harness)
    head = _prompt(33, 9)
    a, b = head + _prompt(70, 4), head + _prompt(60, 5)
    async with harness:
        await run_generation(harness, client, "a1", a, session="a")
        await run_generation(harness, client, "b1", b, session="b")  # parks a's rows above 32
        await run_generation(harness, client, "g", _prompt(10, 6))  # a guest over a stash
        tokens, _ = await run_generation(harness, client, "a2", a + [1, 2], session="a")  # a comes back
        await run_generation(harness, client, "c", _prompt(120, 7), session="a")  # a compaction
    moves = {plan.request_id: plan.moves for plan in plans}
    assert moves["a1"].kind == "extend" and moves["a1"].restore is None  # nothing in place
    assert moves["b1"].kind == "move" and moves["b1"].park_above == 32
    assert moves["b1"].restore == "anchor:32"
    assert moves["g"].kind == "guest" and moves["g"].stash_stop > 0
    assert moves["a2"].kind == "park" and moves["a2"].park_above == 32
    assert moves["c"].pin_head and moves["c"].kind == "move"
    assert all(plan.keep_end == (plan.moves.kind != "guest") for plan in plans)


async def test_a_request_with_a_bad_parameter_fails_before_any_tier_is_asked():
    """Its sampling parameters are checked on the loop first: nothing is lent or reserved for
    a request the engine thread would refuse (a lease it never took would stay out)."""
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    _system(harness)
    async with harness:
        await harness.ask("engine", Generate("bad", _prompt(20, 1),
                                             GenerationParams(max_tokens=2, top_p=2.0),
                                             reply_to=client))
        failed = await client.expect(GenerationFailed, 10)
        stats = await harness.ask("resident", GetTierStats())
        _, done = await run_generation(harness, client, "good", _prompt(20, 1))
    assert failed.reason == "model_error"
    assert stats.stats["lent_total"] == 0 and stats.lent_to is None
    assert isinstance(done, GenerationFinished)
