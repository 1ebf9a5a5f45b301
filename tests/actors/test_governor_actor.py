"""The governor actor keeps its limits whole and keeps running whatever an edit holds: a value
that is not a finite number of GiB, one past the machine, a 401-digit integer. Its counters are
its own: what the core counts on the engine thread comes by message, and only the actor writes
the stats its report shows."""

import asyncio
import threading

import pytest

from tandem.actors.governor import GetMemoryReport, GovernorActor, SetMemoryLimits
from tandem.actors.harness import Harness
from tandem.cache.governor import (
    MAX_NBYTES,
    MemoryGovernor,
    MemoryLimits,
    MemoryRefused,
    Reading,
)
from tandem.cache.memory import LEVELS, MemoryAccountant
from tandem.models.base import Cost

GiB = 1 << 30
MiB = 1 << 20


class Machine:
    """16 GiB, of which the process holds 1."""

    device = "fake"

    def measure(self) -> Reading:
        return Reading(GiB, 0)

    def release_reserve(self) -> None:
        pass

    def total_nbytes(self) -> int:
        return 16 * GiB


BAD = [1e308, 10 ** 400, float("inf"), float("nan"), -1, True, "8", 17, 16.5]


@pytest.mark.parametrize("value", BAD, ids=repr)
async def test_a_bad_limit_is_refused_and_the_actor_lives_on(value):
    harness = Harness()
    core = MemoryGovernor(MemoryLimits.gib(4, 8, 1), Machine())
    actor = harness.add(GovernorActor("governor", core=core, clock=harness.clock))
    async with harness:
        for field in ("mem_ceiling_gib", "mem_peak_gib", "reserve_slack_gib"):
            reply = await actor.ask(SetMemoryLimits(**{field: value}), 5.0, sender="test")
            assert reply.error is not None, field
            assert reply.report["limits"] == {"mem_ceiling_gib": 4, "mem_peak_gib": 8,
                                              "reserve_slack_gib": 1}
        reply = await actor.ask(SetMemoryLimits(mem_peak_gib=16), 5.0, sender="test")
        assert reply.error is None and reply.report["limits"]["mem_peak_gib"] == 16
        assert (await actor.ask(GetMemoryReport(), 5.0, sender="test")).report[
            "machine_bytes"] == 16 * GiB


def test_the_core_checks_every_limit_before_any_arithmetic():
    for value in (1e308, 10 ** 400, float("inf"), float("nan"), "1", None, False):
        with pytest.raises(ValueError):
            MemoryLimits.gib(value, 8, 1)
    with pytest.raises(ValueError):
        MemoryLimits(1, MAX_NBYTES + 1, 0)
    with pytest.raises(ValueError):
        MemoryLimits(1.5, 2, 0)
    with pytest.raises(ValueError, match="machine"):
        MemoryLimits.gib(4, 17, 1, total_nbytes=16 * GiB)
    # A configured limit over the machine is held to it; the same for a 0 (the spec's share).
    held = MemoryLimits.resolve(500, 600, 1, 16 * GiB)
    assert (held.ceiling_nbytes, held.peak_nbytes) == (16 * GiB, 16 * GiB)


class Process:
    """The process holds 1 GiB besides its caches, plus what a running prefill takes beyond
    them (``extra``) and the allocator's free blocks (``reserve``)."""

    device = "fake"

    def __init__(self, memory: MemoryAccountant) -> None:
        self.memory = memory
        self.extra = 0
        self.reserve = 0

    def measure(self) -> Reading:
        held = GiB + sum(self.memory.held.values()) + self.extra + self.reserve
        return Reading(held, self.reserve)

    def release_reserve(self) -> None:
        self.reserve = 0

    def total_nbytes(self) -> int:
        return 16 * GiB


def governed() -> tuple[MemoryGovernor, MemoryAccountant, Process]:
    memory = MemoryAccountant({"store": 512 * MiB, "anchors": 512 * MiB, "pin": 512 * MiB})
    process = Process(memory)
    core = MemoryGovernor(MemoryLimits(GiB + 300 * MiB, GiB + 400 * MiB, 8 * MiB), process)

    def shedder(level):
        def shed(need):
            freed = min(memory.held[level], max(need, 64 * MiB))
            memory.release(level, freed)
            return freed
        return shed

    core.attach(memory, {"store": shedder("store"), "anchors": shedder("anchors")},
                Cost(0, 0, 10 * MiB, 1024, 200 * MiB))
    return core, memory, process


def run(core: MemoryGovernor, memory: MemoryAccountant, process: Process) -> None:
    """What the engine thread does over six requests and two refused ones: prefills that
    shed, reserves refused growth, workspaces raised, the reserve released between requests."""
    for turn in range(6):
        core.before_prefill(10_000 * (turn + 1))
        process.extra = turn * 7 * MiB
        core.observe()
        memory.reserve("store", 100 * MiB)
        memory.reserve("anchors", 60 * MiB)
        memory.reserve("pin", 30 * MiB)
        process.extra = turn * 9 * MiB
        core.observe()
        core.after_prefill()
        process.extra = 0
        process.reserve = 20 * MiB * (turn % 2)
        core.after_request()
    process.extra = 300 * MiB  # held by something no cache can give back
    for _ in range(2):
        with pytest.raises(MemoryRefused):
            core.before_prefill(100)
    process.extra = 0


def on_engine_thread(fn, *args) -> asyncio.Event:
    """Run ``fn`` on a thread of its own to its end, holding the loop meanwhile; the event is
    set through the loop after the thread's last post, as the engine's future is."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()

    def body():
        try:
            fn(*args)
        finally:
            loop.call_soon_threadsafe(finished.set)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return finished


def zeros() -> dict[str, int]:
    return {level: 0 for level in LEVELS}


# The counters of run(), as the core counted them on its own stats before they moved to the
# governor actor (recorded on that code).
COUNTED = {
    "shed_total": {**zeros(), "store": 2, "anchors": 2},
    "shed_bytes": {**zeros(), "store": 104857600, "anchors": 125829120},
    "refused_growth": {**zeros(), "store": 5, "anchors": 4, "pin": 2},
    "refusals": 2, "prefills": 6, "reserve_releases": 3,
    "workspace_raised_bytes": 178503680, "max_prefill_bytes": 1280311296,
    "last_prefill": {"num_tokens": 60000, "workspace": 250429440, "taken": 47185920,
                     "max_held": 1246756864},
}


def counters(report: dict) -> dict:
    return {key: report[key] for key in COUNTED}


def test_a_core_used_alone_counts_on_its_own_stats_as_before():
    core, memory, process = governed()
    run(core, memory, process)
    assert counters(core.statistics()) == COUNTED


async def test_the_counters_after_a_run_on_the_engine_thread_are_what_the_core_counted():
    core, memory, process = governed()
    harness = Harness()
    actor = harness.add(GovernorActor("governor", core=core, clock=harness.clock))
    async with harness:
        finished = on_engine_thread(run, core, memory, process)
        # The loop is held here: every count the thread made is still on its way.
        assert counters(actor.report()) == counters(MemoryGovernor(
            core.limits, process).statistics()), "the engine thread wrote the report's counters"
        await asyncio.wait_for(finished.wait(), 5)
        reply = await actor.ask(GetMemoryReport(), 5.0, sender="test")
    assert counters(reply.report) == COUNTED
    assert actor.stats is not core.stats


async def test_only_the_actors_handler_writes_the_stats_it_reports():
    core, memory, process = governed()
    harness = Harness()
    actor = harness.add(GovernorActor("governor", core=core, clock=harness.clock))
    writers: list[tuple[int, str | None]] = []
    async with harness:
        apply = actor.stats.apply

        def watched(delta):
            writers.append((threading.get_ident(), actor.current_message_type))
            apply(delta)

        actor.stats.apply = watched
        finished = on_engine_thread(run, core, memory, process)
        await asyncio.wait_for(finished.wait(), 5)
        await actor.ask(GetMemoryReport(), 5.0, sender="test")
    assert writers and set(writers) == {(threading.get_ident(), "GovernorObserved")}
