"""The engine actor over the harness: a scripted engine for the protocol (gated, so each test
decides when a token comes out), the small real model for determinism."""

import asyncio
import threading

import pytest

from scripted_engine import ScriptedEngine
from small_hybrid import make_small_hybrid
from tandem.actors.engine_actor import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    CaptureLockMisuse,
    EngineActor,
    EngineBroken,
    estimate_retry_after,
)
from tandem.actors.engine_messages import (
    CancelGeneration,
    CaptureLockGranted,
    Drain,
    DrainStarted,
    EngineDrained,
    Generate,
    GenerationAccepted,
    GenerationFailed,
    GenerationFinished,
    GenerationParams,
    GenerationRejected,
    GenerationStarted,
    ReleaseCaptureLock,
    RequestCaptureLock,
    TokenGenerated,
)
from tandem.actors.harness import Harness
from tandem.engine import Engine

GREEDY = GenerationParams(max_tokens=8)


def system(engine: ScriptedEngine, *, queue_limit: int = 4, check_failures: bool = True):
    harness = Harness(check_failures=check_failures)
    client = harness.probe("client")
    actor = harness.add(EngineActor("engine", make_engine=lambda: engine,
                                    queue_limit=queue_limit, clock=harness.clock))
    return harness, client, actor


async def generate(harness, client, request_id, prompt=(1, 2, 3), params=GREEDY):
    return await harness.ask("engine", Generate(request_id, list(prompt), params,
                                                reply_to=client))


async def test_tokens_stream_back_in_order_then_finished():
    engine = ScriptedEngine([5, 6, 7, 248046, 9])
    harness, client, actor = system(engine)
    async with harness:
        reply = await generate(harness, client, "r1",
                               params=GenerationParams(max_tokens=8, stop_token_ids=(248046,)))
        assert reply == GenerationAccepted("r1", 0)
        started = await client.expect(GenerationStarted)
        assert started.prompt_tokens == 3
        got = [(await client.expect(TokenGenerated)) for _ in range(3)]
        assert [(t.token_id, t.index) for t in got] == [(5, 0), (6, 1), (7, 2)]
        done = await client.expect(GenerationFinished)
        assert (done.finish_reason, done.completion_tokens, done.stop_token) == ("stop", 3, 248046)
        actor.check_invariants()
        assert actor.snapshot()["request"] is None


async def test_all_engine_work_runs_on_one_thread_that_is_not_the_loop():
    built: list[ScriptedEngine] = []
    harness = Harness()
    client = harness.probe("client")
    harness.add(EngineActor("engine", make_engine=lambda: built.append(ScriptedEngine([5, 6]))
                            or built[0]))
    async with harness:
        for rid in ("a", "b"):
            await generate(harness, client, rid)
            await client.expect(GenerationFinished)
    (engine,) = built
    assert len(engine.threads) == 1  # where it was built and where both generations ran
    assert threading.get_ident() not in engine.threads


async def test_cancel_stops_a_running_generation_at_its_next_token():
    engine = ScriptedEngine(list(range(10, 30)), gated=True)
    harness, client, actor = system(engine)
    async with harness:
        await generate(harness, client, "r1", params=GenerationParams(max_tokens=20))
        engine.step(2)
        await client.expect(TokenGenerated)
        await client.expect(TokenGenerated)
        snap = actor.snapshot()
        assert snap["request"]["id"] == "r1" and snap["request"]["phase"] == "decode"
        engine.step(1)
        await client.expect(TokenGenerated)
        # The engine now waits for its fourth token: the cancel is seen there.
        await harness.inject("engine", CancelGeneration("r1"))
        done = await client.expect(GenerationFinished)
        assert done.finish_reason == "cancelled" and done.completion_tokens == 3
        actor.check_invariants()
        # the engine is free for the next request
        engine.gate = None
        await generate(harness, client, "r2")
        assert (await client.expect(GenerationFinished)).request_id == "r2"


async def test_a_waiting_request_cancelled_never_runs_and_the_queue_moves_on():
    engine = ScriptedEngine([1, 2], gated=True)
    harness, client, actor = system(engine)
    async with harness:
        await generate(harness, client, "r1")
        assert await generate(harness, client, "r2") == GenerationAccepted("r2", 0)
        assert await generate(harness, client, "r3") == GenerationAccepted("r3", 1)
        await harness.inject("engine", CancelGeneration("r2"))
        failed = await client.expect(GenerationFailed)
        assert (failed.request_id, failed.reason) == ("r2", "cancelled")
        actor.check_invariants()
        engine.step(4)
        finished = [await client.expect(GenerationFinished) for _ in range(2)]
        assert [f.request_id for f in finished] == ["r1", "r3"]
        assert len(engine.prompts) == 2


async def test_a_queue_over_its_limit_is_refused():
    engine = ScriptedEngine([1], gated=True)
    harness, client, actor = system(engine, queue_limit=2)
    async with harness:
        await generate(harness, client, "running")
        await generate(harness, client, "w1")
        await generate(harness, client, "w2")
        reply = await generate(harness, client, "w3")
        assert isinstance(reply, GenerationRejected) and reply.reason == "queue_full"
        assert reply.retry_after_s > 0
        assert isinstance(await generate(harness, client, "w1"), GenerationRejected)  # duplicate
        engine.step(3)
        for _ in range(3):
            await client.expect(GenerationFinished)


async def test_drain_finishes_the_running_generation_and_starts_nothing_new():
    engine = ScriptedEngine([1, 2, 3], gated=True)
    harness, client, actor = system(engine)
    drained: asyncio.Queue = asyncio.Queue()
    async with harness:
        await generate(harness, client, "running")
        await generate(harness, client, "waiting")
        started = await harness.ask("engine", Drain(reply_to=drained))
        assert started == DrainStarted(running=1, dropped=1)
        failed = await client.expect(GenerationFailed)
        assert (failed.request_id, failed.reason) == ("waiting", "draining")
        reply = await generate(harness, client, "late")
        assert isinstance(reply, GenerationRejected) and reply.reason == "draining"
        assert drained.empty()
        engine.step(3)
        done = await client.expect(GenerationFinished)
        assert (done.request_id, done.completion_tokens) == ("running", 3)
        async with asyncio.timeout(1):
            assert isinstance(await drained.get(), EngineDrained)
        assert engine.prompts == [[1, 2, 3]]


async def test_capture_lock_is_granted_in_fifo_order_and_holds_off_generations():
    """An outside holder gets the lock between two of the engine's steps (the running
    generation pauses there while it holds), in arrival order with the generations behind it."""
    engine = ScriptedEngine([1], gated=True)
    harness, client, actor = system(engine)
    tier = harness.probe("tier")
    copier = harness.probe("copier")
    async with harness:
        await generate(harness, client, "g1")  # the engine's generations hold the lock
        await harness.inject("engine", RequestCaptureLock("tier", reply_to=tier))
        await generate(harness, client, "g2")  # behind the tier in the FIFO
        await harness.inject("engine", RequestCaptureLock("copier", reply_to=copier))
        # A scripted generation is one step: g1's ends before the tier's turn, or the tier's
        # comes first and g1 waits for it.
        engine.step(1)
        grant = await tier.expect(CaptureLockGranted)
        assert actor.snapshot()["capture_lock"] == "tier"
        assert not engine.running.is_set()  # nothing runs while the tier holds
        assert copier.unread == [] and actor.waiting == 1  # g2 (the copier is no request)
        actor.check_invariants()
        await harness.inject("engine", ReleaseCaptureLock("tier", grant.grant_id))
        assert (await client.expect(GenerationFinished)).request_id == "g1"
        engine.step(1)  # g2's token, let out before or after the copier's turn
        grant2 = await copier.expect(CaptureLockGranted)
        assert grant2.grant_id != grant.grant_id
        await harness.inject("engine", ReleaseCaptureLock("copier", grant2.grant_id))
        assert (await client.expect(GenerationFinished)).request_id == "g2"
        await harness.ask("engine", CancelGeneration("nothing"))  # a round trip: all handled
        assert actor.snapshot()["capture_lock"] is None
        actor.check_invariants()


async def test_releasing_a_capture_lock_not_held_stops_the_system():
    harness, client, actor = system(ScriptedEngine([1]), check_failures=False)
    async with harness:
        await harness.inject("engine", ReleaseCaptureLock("intruder", 7))
        await harness.until_stopped()
    assert isinstance(harness.supervisor.exception, CaptureLockMisuse)


async def test_a_prompt_over_the_window_fails_with_both_counts():
    harness, client, actor = system(ScriptedEngine([1], window=4))
    async with harness:
        await generate(harness, client, "long", prompt=range(6))
        failed = await client.expect(GenerationFailed)
        assert (failed.reason, failed.num_tokens, failed.window) == ("context_overflow", 6, 4)
        await generate(harness, client, "ok", prompt=[1, 2])
        assert (await client.expect(GenerationFinished)).request_id == "ok"


async def test_an_engine_bug_fails_that_request_only_and_the_rows_are_reset():
    engine = ScriptedEngine([5, 6, 7])
    harness, client, actor = system(engine)
    async with harness:
        await generate(harness, client, "r0", prompt=[1, 2, 3])
        await client.expect(GenerationFinished)
        engine.fail_with = RuntimeError("kaboom")
        await generate(harness, client, "r1", prompt=[1, 2, 3, 5, 6, 7, 8])
        failed = await client.expect(GenerationFailed)
        assert (failed.request_id, failed.reason) == ("r1", "engine_error")
        assert "kaboom" not in failed.detail
        # No cache: the engine's own rows are what a half-written request leaves; they go.
        assert engine.resets == 1 and engine.length == 0
        engine.fail_with = None
        await generate(harness, client, "r2", prompt=[1, 2, 3, 5, 6, 7, 8])
        done = await client.expect(GenerationFinished)
        assert done.request_id == "r2" and done.reused_tokens == 0
        assert (actor.failed_total, actor.finished_total) == (1, 2)
        actor.check_invariants()
    assert harness.supervisor.exception is None


@pytest.mark.parametrize("fatal", [MemoryError()])
async def test_an_error_that_leaves_the_process_untrusted_stops_the_system(fatal):
    harness, client, actor = system(ScriptedEngine(fail_with=fatal), check_failures=False)
    async with harness:
        await generate(harness, client, "r1")
        failed = await client.expect(GenerationFailed)
        assert failed.reason == "engine_error"
        await harness.until_stopped()
    assert isinstance(harness.supervisor.exception, type(fatal))


async def test_a_recovery_that_fails_stops_the_system():
    engine = ScriptedEngine(fail_with=RuntimeError("kaboom"))

    def broken_reset():
        raise RuntimeError("cannot reset")
    engine.reset = broken_reset
    harness, client, actor = system(engine, check_failures=False)
    async with harness:
        await generate(harness, client, "r1")
        assert (await client.expect(GenerationFailed)).reason == "engine_error"
        await harness.until_stopped()
    assert isinstance(harness.supervisor.exception, EngineBroken)


async def test_params_the_engine_refuses_fail_that_request_as_a_model_error():
    harness, client, actor = system(ScriptedEngine([5]))
    async with harness:
        await generate(harness, client, "bad", params=GenerationParams(max_tokens=4, top_p=0.0))
        failed = await client.expect(GenerationFailed)
        assert (failed.request_id, failed.reason) == ("bad", "model_error")
        await generate(harness, client, "ok")
        assert (await client.expect(GenerationFinished)).request_id == "ok"


# -- Retry-After ------------------------------------------------------------------------------

def test_retry_after_is_the_queue_times_the_median_plus_what_the_running_one_has_left():
    recent = [2.0, 2.0, 3.0, 100.0, 2.0]  # one outlier does not move the median (2 s)
    assert estimate_retry_after(3, recent, running_elapsed_s=0.5) == 3 * 2.0 + 1.5
    assert estimate_retry_after(3, recent, running_elapsed_s=9.0) == 6.0  # overdue: 0 left
    assert estimate_retry_after(0, [], None) == RETRY_AFTER_MIN_S
    assert estimate_retry_after(0, [0.01], 0.0) == RETRY_AFTER_MIN_S
    assert estimate_retry_after(500, recent, 0.0) == RETRY_AFTER_MAX_S
    assert estimate_retry_after(2, [], None, default_s=4.0) == 8.0


async def test_a_full_queue_answers_the_estimated_retry_after():
    engine = ScriptedEngine([1], gated=True)
    harness, client, actor = system(engine, queue_limit=2)
    async with harness:
        for i in range(3):  # three generations of 5 s each, on the fake clock
            await generate(harness, client, f"past{i}")
            await asyncio.to_thread(engine.running.wait, 5)
            harness.clock.advance(5.0)
            engine.step(1)
            await client.expect(GenerationFinished)
        await generate(harness, client, "running")
        await asyncio.to_thread(engine.running.wait, 5)
        harness.clock.advance(1.0)
        await generate(harness, client, "w1")
        await generate(harness, client, "w2")
        reply = await generate(harness, client, "w3")
        assert isinstance(reply, GenerationRejected) and reply.reason == "queue_full"
        assert reply.retry_after_s == 2 * 5.0 + 4.0
        engine.step(3)
        for _ in range(3):
            await client.expect(GenerationFinished)


async def test_stopping_the_system_cancels_the_running_generation_and_fails_the_waiting():
    engine = ScriptedEngine(list(range(100)), gated=True)
    harness, client, actor = system(engine)
    events: asyncio.Queue = asyncio.Queue()
    async with harness:
        await harness.ask("engine", Generate("running", [1], GenerationParams(max_tokens=100),
                                             reply_to=events))
        await harness.ask("engine", Generate("waiting", [1], GREEDY, reply_to=events))
        engine.step(1)
        async with asyncio.timeout(1):
            while not isinstance(await events.get(), TokenGenerated):
                pass
    # the running one saw the cancel while waiting for its next token; nothing runs now
    assert not engine.running.is_set()
    left = [events.get_nowait() for _ in range(events.qsize())]
    assert GenerationFailed("waiting", "stopped", "the engine stopped before the request ran") \
        in left
    assert len(engine.prompts) == 1


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from tandem.models.hybrid import HybridModel
    import torch

    path = make_small_hybrid(tmp_path_factory.mktemp("small_hybrid"), tokenizer=False)
    return HybridModel.load(path, dtype=torch.float32)


async def test_seeded_sampling_on_the_real_engine_gives_the_same_tokens_twice(small_model):
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    actor = harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(small_model, window=256, prefix_chunk=32)))
    params = GenerationParams(max_tokens=6, temperature=0.9, top_k=50, seed=1234)
    runs = []
    async with harness:
        for rid in ("a", "b"):
            await generate(harness, client, rid, prompt=[11, 22, 33, 44, 55], params=params)
            runs.append([(await client.expect(TokenGenerated, 5)).token_id for _ in range(6)])
            done = await client.expect(GenerationFinished, 5)
            assert done.finish_reason == "length" and done.completion_tokens == 6
        snap = actor.snapshot()
        assert snap["rows_in_place"] == 5 + 6 - 1 and snap["window"] == 256
    assert runs[0] == runs[1]


async def test_with_caches_off_another_namespace_never_extends_the_rows_in_place(small_model):
    """The engine alone resumes a prompt that extends its rows (source engine); a request of
    another cache namespace starts again from row 0, and its answer is the same (greedy)."""
    from tandem.cache.namespace import namespace_of

    a, b = namespace_of("a"), namespace_of("b")
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(small_model, window=256, prefix_chunk=32)))
    params = GenerationParams(max_tokens=4)

    async def run(rid, prompt, namespace):
        await harness.ask("engine", Generate(rid, list(prompt), params, reply_to=client,
                                             namespace=namespace))
        out = [(await client.expect(TokenGenerated, 5)).token_id for _ in range(4)]
        return out, await client.expect(GenerationFinished, 5)

    async with harness:
        first = list(range(10, 50))
        out, _ = await run("a1", first, a)
        longer = first + out + [7, 8, 9]
        out_a, done_a = await run("a2", longer, a)
        assert (done_a.cache_source, done_a.reused_tokens) == ("engine", len(first) + 3)
        out_b, done_b = await run("b1", longer + out_a + [5], b)
        assert (done_b.cache_source, done_b.reused_tokens, done_b.reread_tokens) == \
            ("cold", 0, len(longer) + 5)
        out_s, done_s = await run("s1", longer + out_a + [5], "")
        assert (done_s.cache_source, done_s.reused_tokens) == ("cold", 0)
        assert out_s == out_b


class EngineThreadOnly(ScriptedEngine):
    """A scripted engine whose rows and taint may be read only on the thread it was built on,
    the engine thread: a read from the loop raises."""

    def __init__(self, *args, **kwargs) -> None:
        self.owner = threading.get_ident()
        super().__init__(*args, **kwargs)

    def _check(self) -> None:
        if threading.get_ident() != self.owner:
            raise AssertionError("the engine's rows were read off the engine thread")

    @property
    def length(self) -> int:
        self._check()
        return len(self.token_ids)

    @property
    def taint(self) -> int | None:
        self._check()
        return self._taint

    @taint.setter
    def taint(self, value: int | None) -> None:
        self._check()
        self._taint = value


async def test_the_snapshot_shows_the_view_the_loop_published_never_the_engines_fields():
    built: list[EngineThreadOnly] = []
    harness = Harness()
    client = harness.probe("client")
    actor = harness.add(EngineActor("engine", make_engine=lambda: built.append(
        EngineThreadOnly(list(range(10, 20)), gated=True)) or built[0], clock=harness.clock))
    four = GenerationParams(max_tokens=4)

    def rows(snap):
        return snap["rows_in_place"], snap["taint"], snap["request"]

    async with harness:
        (engine,) = built
        snap = actor.snapshot()
        assert (snap["window"], snap["prefix_chunk"], snap["num_threads"]) == (4096, 64, 1)
        assert rows(snap) == (0, None, None)
        await generate(harness, client, "r1", params=four)
        await client.expect(GenerationStarted)
        assert rows(actor.snapshot()) == (0, None, {"id": "r1", "phase": "prefill",
                                                    "prompt_tokens": 3, "generated": 0})
        engine.step(2)
        await client.expect(TokenGenerated)
        await client.expect(TokenGenerated)
        # The tokens as the loop delivered them; the rows as the last generation left them.
        assert rows(actor.snapshot()) == (0, None, {"id": "r1", "phase": "decode",
                                                    "prompt_tokens": 3, "generated": 2})
        engine.step(2)
        assert [(await client.expect(TokenGenerated)).index for _ in range(2)] == [2, 3]
        done = await client.expect(GenerationFinished)
        assert done.completion_tokens == 4
        assert rows(actor.snapshot()) == (3 + 4 - 1, 3, None)
        await generate(harness, client, "r2", prompt=(1, 2, 3, 10, 11, 12, 99), params=four)
        engine.step(1)
        assert (await client.expect(TokenGenerated)).request_id == "r2"
        # The rows and the taint of one moment, whatever the engine holds now.
        snap = actor.snapshot()
        assert rows(snap)[:2] == (6, 3) and snap["request"]["generated"] == 1
        engine.step(3)
        await client.expect(GenerationFinished)
        assert rows(actor.snapshot()) == (7 + 4 - 1, 3, None)
        actor.check_invariants()


async def test_what_the_loop_reads_of_the_engine_actor_the_loop_alone_writes(monkeypatch):
    """The caches' counters and the view: made on the engine thread, stored by the loop."""
    from tandem.cache.memory import MemoryAccountant
    from tandem.cache.resident import ResidentPrefix
    from tandem.models.third import ThirdModel

    writers: list[tuple[str, int]] = []

    def watched(self, name, value):
        if name in ("cache_stats", "view"):
            writers.append((name, threading.get_ident()))
        object.__setattr__(self, name, value)

    monkeypatch.setattr(EngineActor, "__setattr__", watched)
    budgets = {level: 64 << 20 for level in ("anchors", "end", "stash", "park", "pin")}
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    actor = harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(ThirdModel(), window=256, prefix_chunk=16),
        make_resident=lambda engine: ResidentPrefix(engine, MemoryAccountant(budgets))))
    prompt = [(i * 7 + 3) % 97 for i in range(40)]
    async with harness:
        for rid, more in (("a", []), ("b", [5, 6, 7])):
            await generate(harness, client, rid, prompt=prompt + more,
                           params=GenerationParams(max_tokens=3))
            await client.expect(GenerationFinished, 10)
        resident = actor.cache_stats["tiers"]["resident"]
        assert resident["cold"] == 1 and resident["rows_in_place"] == actor.snapshot()[
            "rows_in_place"]
    assert {thread for _, thread in writers} == {threading.get_ident()}, "an engine-thread write"
    assert {name for name, _ in writers} == {"cache_stats", "view"}
