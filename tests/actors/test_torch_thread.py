"""The torch thread (tandem/torch_thread.py): `tandem serve` loads the model on it and hands it
to the engine actor, so the engine runs on the thread whose OpenMP team is the fast one; the
engine actor works on the executor it is given and leaves it to its owner when it stops."""

import threading

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (GenerationFinished, GenerationParams, Generate)
from tandem.actors.harness import Harness
from tandem.torch_thread import torch_thread


def test_the_torch_thread_is_one_thread_for_the_process():
    first = torch_thread()
    assert torch_thread() is first
    names = {first.submit(lambda: threading.current_thread().name).result() for _ in range(4)}
    assert len(names) == 1 and names.pop().startswith("tandem-torch")


async def test_the_engine_runs_on_the_executor_it_is_given_and_leaves_it_running():
    threads: list[str] = []
    engine = ScriptedEngine([5, 6, 7])

    def make():
        threads.append(threading.current_thread().name)
        return engine

    harness = Harness()
    client = harness.probe("client")
    harness.add(EngineActor("engine", make_engine=make, executor=torch_thread(),
                            clock=harness.clock))
    async with harness:
        await harness.ask("engine", Generate("r1", [1, 2, 3], GenerationParams(max_tokens=2),
                                             reply_to=client))
        assert isinstance(await client.expect(GenerationFinished), GenerationFinished)
    assert threads and threads[0].startswith("tandem-torch")
    # Stopped, the actor did not shut its owner's executor down.
    assert torch_thread().submit(lambda: 41 + 1).result() == 42


def test_a_background_thread_keeps_its_openmp_regions_to_itself():
    import ctypes
    import os
    from concurrent.futures import ThreadPoolExecutor

    import pytest
    import torch

    from tandem.torch_thread import one_openmp_thread_here

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        pytest.skip("this torch build has no GNU OpenMP runtime of its own")
    gomp = ctypes.CDLL(path)
    before = torch_thread().submit(gomp.omp_get_max_threads).result()
    other = ThreadPoolExecutor(1)

    def background():
        assert one_openmp_thread_here()
        # torch's first parallel op on a thread sets its OpenMP threads to torch's count
        # (lazy_init_num_threads): the setting must survive it (it did not, and a spill
        # writer's copies slowed the engine's prefill 1.6x for good)
        torch.ones(1 << 20).add_(1)
        return gomp.omp_get_max_threads()

    assert other.submit(background).result() == 1
    # The setting is that thread's own: the torch thread's team keeps its size.
    assert torch_thread().submit(gomp.omp_get_max_threads).result() == before
    other.shutdown()
