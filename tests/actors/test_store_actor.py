"""The state store actor: the engine thread's side of the store asks it for everything, in
order, from another thread; a lent entry survives the evictions a put makes until it comes back;
a stopped store answers as an empty one, never hangs. Gates: a prefix snapshot restored through
the actor is a cold prefill's bit for bit (gate 1)."""

import asyncio

import pytest
import torch

from resident_rig import CHUNK, MiB, assert_bit_exact, cold, tokens
from tandem.actors.harness import Harness
from tandem.actors.store import StoreActor
from tandem.cache.memory import MemoryAccountant
from tandem.cache.store import StateStore, StoreCore
from tandem.engine import Engine
from tandem.models.third import ThirdModel


@pytest.fixture
def model():
    return ThirdModel()


def system(model, store_nbytes=64 * MiB):
    memory = MemoryAccountant({"store": store_nbytes})
    core = StoreCore(memory, entry_nbytes=16 * MiB)
    harness = Harness()
    actor = harness.add(StoreActor("store", core=core, clock=harness.clock))
    engine = Engine(model, window=1024, prefix_chunk=CHUNK)
    return harness, actor, core, engine


def on_engine_thread(fn, *args):
    """What the engine actor does: the engine's side runs on a thread of its own."""
    return asyncio.to_thread(fn, *args)


async def test_a_prefix_snapshot_goes_to_the_actor_and_comes_back_bit_for_bit(model):
    harness, actor, core, engine = system(model)
    v = model.vocab_size
    prompt = tokens(v, 150, 1)
    async with harness:
        store = await on_engine_thread(
            lambda: StateStore(engine, actor.port(), entry_nbytes=16 * MiB))

        def first_prefill():
            store.plan_prefix(prompt, 0)
            engine.prefill(prompt, on_chunk=store.on_chunk)
            store.end_prefill()

        await on_engine_thread(first_prefill)
        assert core.statistics()["prefix_entries"] == 1 and len(core) == 1
        await on_engine_thread(engine.resume_at, 0)
        second = prompt[:130] + tokens(v, 20, 2)

        def resumed():
            start, entry = store.offer(second)
            assert (start, entry.n) == (128, 128)
            assert core.statistics()["leased"] == 1
            store.restore(entry, second)
            return engine.prefill(second)

        logits = await on_engine_thread(resumed)
        assert core.statistics()["leased"] == 0 and core.stats.prefix_hits == 1
        await on_engine_thread(store.check_invariants)
    reference, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(engine, reference, len(second))


async def test_a_lent_entry_is_not_evicted_until_it_comes_back(model):
    harness, actor, core, engine = system(model)
    v = model.vocab_size
    async with harness:
        store = await on_engine_thread(
            lambda: StateStore(engine, actor.port(), entry_nbytes=16 * MiB))
        one = await on_engine_thread(store.snapshot_nbytes, 128)
        core.memory.budgets["store"] = one  # room for one snapshot of 128 rows
        a, b = tokens(v, 140, 1), tokens(v, 140, 2)

        def put(prompt):
            engine.resume_at(0)
            store.plan_prefix(prompt, 0)
            engine.prefill(prompt, on_chunk=store.on_chunk)
            store.end_prefill()

        await on_engine_thread(put, a)
        start, entry = await on_engine_thread(store.offer, a + [1])
        assert start == 128
        await on_engine_thread(put, b)  # needs the room the lent entry holds: refused
        assert core.stats.refused == 1 and [e.key_ids for e in core._entries.values()] == [a[:128]]
        await on_engine_thread(store.release, entry)
        await on_engine_thread(put, b)  # now the old one is evicted
        assert [e.key_ids for e in core._entries.values()] == [b[:128]]
        assert core.stats.evictions == 1
        core.check_invariants()


async def test_a_stopped_store_answers_as_an_empty_one(model):
    harness, actor, core, engine = system(model)
    async with harness:
        store = await on_engine_thread(
            lambda: StateStore(engine, actor.port(timeout_s=5), entry_nbytes=16 * MiB))
        await harness.supervisor.stop()
        prompt = tokens(model.vocab_size, 100, 3)
        assert await on_engine_thread(store.offer, prompt) == (0, None)
        await on_engine_thread(engine.prefill, prompt)
        assert not await on_engine_thread(store.put_session, prompt, "conv")
        assert await on_engine_thread(store.shed, 1) == 0
        assert await on_engine_thread(store.statistics) == {}
