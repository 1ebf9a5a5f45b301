"""The graphs' captures under the capture lock (issue 20, part 3; spec: test_capture_lock.py and
capture_race_check): a capture runs on the engine thread while the running generations hold
the lock, a writer's copy (an outside holder) waits for the capture running and for no other,
and no capture starts while a writer holds the lock. On a CPU with the recorded graph
(tests/graph_fake.py), held inside its capture; on a GPU (skipped here) with CUDA graphs against a
writer that copies device rows to pinned memory whenever it holds the lock."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from graph_fake import RecordedGraphs
from small_hybrid import make_small_hybrid
from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (CancelGeneration, CaptureLockGranted, Generate,
                                           GenerationFinished, GenerationParams,
                                           ReleaseCaptureLock, RequestCaptureLock)
from tandem.actors.harness import Harness
from tandem.engine import Engine
from tandem.models.graphs import CudaGraphs, StepGraphs
from tandem.models.hybrid import HybridModel

TIMEOUT_S = 30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# The recorded graph sees torch's ops alone: decode's native CPU kernels bypass torch's
# dispatch, so these tests run torch's matmuls (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_matmuls")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False)


class Log:
    """What happened, in order, from every thread."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)

    def count(self, event: str) -> int:
        with self.lock:
            return self.events.count(event)


def _actor(model) -> tuple[Harness, object, EngineActor]:
    harness = Harness(ready_timeout_s=TIMEOUT_S, stop_timeout_s=TIMEOUT_S)
    client = harness.probe("client")
    actor = harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(model, window=600, prefix_chunk=64)))
    return harness, client, actor


async def test_a_writer_waits_for_the_capture_running_and_none_starts_while_it_holds(small_dir):
    model = HybridModel.load(small_dir, dtype=torch.float32)
    log = Log()
    inside, proceed = threading.Event(), threading.Event()
    actor: EngineActor | None = None
    holders: list[object] = []

    def on_capture(phase: str) -> None:
        log.add(f"capture_{phase}")
        if phase == "start":
            holders.append(actor._lock.holder is actor._group)
            if log.count("capture_start") == 1:  # the first capture waits for the test
                inside.set()
                assert proceed.wait(TIMEOUT_S)

    backend = RecordedGraphs(on_capture)
    model.graphs = StepGraphs(backend, capture_after=1)
    harness, client, actor = _actor(model)
    writer = harness.probe("writer")
    async with harness:
        # 250 prompt tokens: decode crosses the 256 span line, a second shape to capture
        await harness.ask("engine", Generate("g", list(range(250)),
                                             GenerationParams(max_tokens=16), reply_to=client))
        assert await asyncio.to_thread(inside.wait, TIMEOUT_S)
        await harness.inject("engine", RequestCaptureLock("writer", reply_to=writer))
        await harness.ask("engine", CancelGeneration("nothing"))  # handled: the writer waits
        assert writer.unread == [] and actor.snapshot()["capture_lock"] == "engine"
        proceed.set()
        grant = await writer.expect(CaptureLockGranted, TIMEOUT_S)
        log.add("granted")
        # the writer holds: the engine thread is parked between two rounds, nothing starts
        await harness.ask("engine", CancelGeneration("nothing"))
        assert log.count("capture_start") == 1 and log.count("capture_end") == 1
        actor.check_invariants()
        log.add("released")
        await harness.inject("engine", ReleaseCaptureLock("writer", grant.grant_id))
        done = await client.expect(GenerationFinished, TIMEOUT_S)
        assert done.completion_tokens == 16
    assert log.events[:4] == ["capture_start", "capture_end", "granted", "released"]
    assert log.events[4:] == ["capture_start", "capture_end"]  # the 512-span shape, after
    assert holders == [True, True]  # every capture under the generations' hold
    engine_threads = backend.threads
    assert len(engine_threads) == 1 and threading.get_ident() not in engine_threads
    model.graphs = None


async def test_a_round_captures_at_most_one_graph_and_only_under_the_generations_hold(
        small_dir):
    """The gate's rule alone: outside a round, a second capture in one round, and a round
    whose generations do not hold the lock are declined (the step then runs eagerly)."""
    model = HybridModel.load(small_dir, dtype=torch.float32)
    model.graphs = StepGraphs(RecordedGraphs())
    harness, client, actor = _actor(model)
    async with harness:
        assert model.graphs.gate == actor._capture_gate
        assert actor._capture_gate(lambda: "ran") is None  # no round runs
        actor._in_round, actor._round_captured = True, False
        actor._lock.take(actor._group)  # as running generations hold it
        try:
            assert actor._capture_gate(lambda: "ran") == "ran"
            assert actor._capture_gate(lambda: "ran") is None  # one a round
            actor._round_captured = False
            actor._lock.release(actor._group)
            assert actor._capture_gate(lambda: "ran") is None  # nobody's hold
        finally:
            actor._in_round = False
    model.graphs = None


# -- on a GPU: the real race ----------------------------------------------------------------------

@cuda
async def test_cuda_captures_never_fail_under_a_busy_writer(small_dir):
    """capture_race_check: two generations decode across many span lines (a capture at each
    shape's first step) while a writer copies device rows to pinned memory every time it holds
    the lock, back to back. A copy during a global-mode capture would fail the capture; every
    request must finish, every shape be captured, and no capture run outside the lock."""
    model = HybridModel.load(small_dir, device="cuda")
    graphs = StepGraphs(CudaGraphs(torch.device("cuda", 0)), capture_after=1)
    model.graphs = graphs
    harness, client, actor = _actor(model)
    writer = harness.probe("writer")
    rows = torch.randn(64, 1 << 20, device="cuda")
    pinned = torch.empty(rows.shape, pin_memory=True)
    copies = 0
    stop = asyncio.Event()

    def copy() -> None:
        pinned.copy_(rows, non_blocking=True)
        torch.cuda.synchronize()

    async def busy() -> None:
        nonlocal copies
        while not stop.is_set():
            await harness.inject("engine", RequestCaptureLock("writer", reply_to=writer))
            grant = await writer.expect(CaptureLockGranted, TIMEOUT_S)
            await asyncio.to_thread(copy)
            copies += 1
            await harness.inject("engine", ReleaseCaptureLock("writer", grant.grant_id))

    async with harness:
        task = asyncio.create_task(busy())
        for rid, n in (("a", 120), ("b", 200)):
            await harness.ask("engine", Generate(rid, list(range(n)),
                                                 GenerationParams(max_tokens=300),
                                                 reply_to=client))
        done = [await client.expect(GenerationFinished, 120) for _ in range(2)]
        stop.set()
        await task
    assert all(d.completion_tokens == 300 for d in done)
    assert graphs.counts["captures"] >= 4 and copies > 10
    model.graphs = None
