"""The compaction preparer (issue 17, part 3), through the real EngineActor, Engine and tier
actors over the test model (two slots), its ticks sent by the test and its clock a FakeClock.

Gates: the conversation it wrote over is put back bit for bit (torch.equal on the slot's rows,
sections, anchors and end anchor, and the same token ids and taint), whether the preparation
finished or a request, a drain or a lock waiter stopped it; the prepared tokens are the greedy
tokens the same continuation ids get as a request resumed at the end anchor (greedy gate).
The yield latency is recorded (``yield_ms_last``, printed) and bounded in chunks forwarded,
never in seconds."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import threading

import pytest
import torch
from generation_run import run_generation

from tandem.actors.compaction_preparer import CompactionPreparer, GetPreparerStats, PreparerTick
from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (Drain, Generate, GenerationFinished,
                                           GenerationParams, GenerationRejected)
from tandem.actors.harness import Harness
from tandem.actors.tiers import ParkActor, ResidentActor
from tandem.cache.memory import PARK_LEVELS, RESIDENT_LEVELS, Accounts, MemoryAccountant, Share
from tandem.cache.prepared import (DEFAULT_INSTRUCTIONS, DEFAULT_SYSTEM_TEXT, PreparedAnswers,
                                   rows_digest)
from tandem.cache.resident import ResidentPrefix, make_holdings
from tandem.engine import Engine
from tandem.models.third import ThirdModel
from tandem.server.boxlock import BoxLock

WINDOW, CHUNK = 1024, 16
MiB = 1 << 20
PROBE_CAPACITY = 4096
SESSION, CLIENT = "session-a", "opencode"
TEMPLATE = "template-sha"
IDLE_S, MIN_TOKENS, MAX_TOKENS = 30.0, 64, 12
CONVERSATION = [(i * 7 + 3) % 97 for i in range(100)]  # rows 0..~107 after its answer


def _turn(system_text: str, instructions: str) -> list[int]:
    """The test's user turn: a few chunks of ids made from the texts (the route renders and
    encodes the real one)."""
    data = (system_text + "|" + instructions).encode()
    return [3 + data[i] % 90 for i in range(0, min(len(data), 4 * 60), 4)]


def continuation(rows: list[int], system_text: str, instructions: str) -> list[int]:
    return list(rows) + _turn(system_text, instructions)


class _Gated(ThirdModel):
    """The test model, which records each forward's sequence and can hold the next prefill
    chunk of an armed sequence (on the engine thread) until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.armed: int | None = None  # id(state) whose next chunk waits
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, state, token_ids, start, decode=False, on_logits=None, logits=True):
        self.calls.append(("decode" if decode else "chunk", id(state)))
        if not decode and self.armed == id(state):
            self.armed = None
            self.entered.set()
            assert self.release.wait(20), "the test never let the chunk go"
        return super().forward(state, token_ids, start, decode, on_logits, logits)

    def forward_batch(self, states, token_ids, positions):
        for s in states:
            self.calls.append(("decode", id(s)))
        return torch.stack([ThirdModel.forward(self, s, torch.tensor([t]), p, decode=True)
                            for s, t, p in zip(states, token_ids, positions)])


class _System:
    def __init__(self, tmp_path, *, parallel: int = 2, model=None, box_lock=True,
                 min_tokens: int = MIN_TOKENS) -> None:
        self.harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
        self.client = self.harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
        memory = MemoryAccountant({level: 64 * MiB for level in RESIDENT_LEVELS + PARK_LEVELS})
        resident_memory, park_memory = memory.part(RESIDENT_LEVELS), memory.part(PARK_LEVELS)
        slots, parked = [], None
        for share in [Share(resident_memory) for _ in range(parallel)]:
            held, park = make_holdings(share, CHUNK, park_memory=park_memory)
            parked = parked or park
            slots.append(held)
        self.resident = self.harness.add(ResidentActor("resident", slots=slots))
        park = self.harness.add(ParkActor("park", holdings=parked))
        composer_memory = Accounts(resident_memory, park_memory)
        self.model = model or ThirdModel()
        self.engine = self.harness.add(EngineActor(
            "engine", make_engine=lambda: Engine(self.model, window=WINDOW, prefix_chunk=CHUNK),
            make_resident=lambda e: ResidentPrefix.lent_to(e, composer_memory),
            tiers=(self.resident, park), parallel=parallel))
        self.prepared = PreparedAnswers()
        self.lock_path = tmp_path / "box.lock"
        self.box_lock = BoxLock(self.lock_path) if box_lock else None
        # Ticks come from the test: the preparer's own poll (a FakeClock sleep) never fires.
        self.preparer = self.harness.add(CompactionPreparer(
            engine=self.engine, prepared=self.prepared, continuation=continuation,
            template_sha=TEMPLATE, box_lock=self.box_lock, idle_s=IDLE_S,
            min_tokens=min_tokens, max_tokens=MAX_TOKENS, poll_s=1e6,
            clock=self.harness.clock))

    async def conversation(self, prompt=CONVERSATION, session=SESSION, request_id="turn-1"):
        tokens, done = await run_generation(self.harness, self.client, request_id, prompt,
                                            max_tokens=8, session=session)
        assert isinstance(done, GenerationFinished) and done.finish_reason == "length"
        return done.slot

    async def tick(self) -> None:
        await self.harness.ask("compaction_preparer", PreparerTick(), 10)

    async def idle_tick(self) -> None:
        self.harness.clock.advance(IDLE_S + 1)
        await self.tick()

    async def stats(self) -> dict:
        return (await self.harness.ask("compaction_preparer", GetPreparerStats(), 10)).stats

    async def until(self, predicate, timeout_s: float = 20.0) -> None:
        """Wait for ``predicate(stats)`` (the preparer's mailbox order: every event before the
        stats ask is handled)."""
        async with asyncio.timeout(timeout_s):
            while not predicate(await self.stats()):
                await asyncio.sleep(0.005)

    def slot_state(self, slot: int) -> dict:
        """Everything the conversation in ``slot`` is, copied (the engine thread is idle)."""
        engine = self.engine.engines[slot]
        held = self.resident.slots[slot]
        state = engine.cache_state()
        n = engine.length
        return {
            "token_ids": list(engine.token_ids), "length": n, "taint": engine.taint,
            "sections": {k: v.clone() for k, v in state.sections.items()},
            "rows": {k: v.rows(0, n).clone() for k, v in state.views.items()},
            "anchors": {line: {k: t.clone() for k, t in copy.tensors.items()}
                        for line, copy in held.anchors.copies.items()},
            "end": None if held.ends.end is None else (
                held.ends.end.length, {k: t.clone() for k, t in
                                       held.ends.end.copy.tensors.items()}),
            "session": held.session, "namespace": held.namespace,
            "stash": held.stash.active,
        }


def _same(a: dict, b: dict) -> None:
    for key in ("token_ids", "length", "taint", "session", "namespace", "stash"):
        assert a[key] == b[key], key
    assert a["sections"].keys() == b["sections"].keys()
    assert all(torch.equal(a["sections"][k], b["sections"][k]) for k in a["sections"])
    assert all(torch.equal(a["rows"][k], b["rows"][k]) for k in a["rows"])
    assert a["anchors"].keys() == b["anchors"].keys()
    for line in a["anchors"]:
        assert all(torch.equal(a["anchors"][line][k], b["anchors"][line][k])
                   for k in a["anchors"][line]), line
    assert (a["end"] is None) == (b["end"] is None)
    if a["end"] is not None:
        assert a["end"][0] == b["end"][0]
        assert all(torch.equal(a["end"][1][k], b["end"][1][k]) for k in a["end"][1])


async def test_a_finished_preparation_leaves_the_conversation_and_writes_a_continuations_tokens(
        tmp_path):
    s = _System(tmp_path)
    s.prepared.note_session(SESSION, CLIENT)
    async with s.harness:
        slot = await s.conversation()
        before = s.slot_state(slot)
        end_ids = before["token_ids"][:before["end"][0]]
        await s.idle_tick()
        await s.until(lambda st: st["finished"] == 1)
        s.preparer.check_invariants()
        s.engine.check_invariants()
        _same(before, s.slot_state(slot))
        assert not s.box_lock.held
        answer = s.prepared.lookup(SESSION, rows_digest(end_ids), DEFAULT_SYSTEM_TEXT,
                                   TEMPLATE)
        assert answer is not None and answer.completion_tokens == MAX_TOKENS
        assert answer.end_tokens == len(end_ids)
        # The same continuation ids as a request of the session: it resumes at the end
        # anchor and writes the same greedy tokens.
        ids = continuation(end_ids, DEFAULT_SYSTEM_TEXT, DEFAULT_INSTRUCTIONS)
        assert answer.prompt_tokens == len(ids)
        tokens, done = await run_generation(s.harness, s.client, "continuation", ids,
                                            max_tokens=MAX_TOKENS, session=SESSION)
        assert done.cache_source == "end" and done.reused_tokens == len(end_ids)
        assert tokens == answer.token_ids
        stats = await s.stats()
        assert (stats["started"], stats["finished"], stats["yielded"], stats["served"]) == \
            (1, 1, 0, 1)


async def test_a_waiting_request_stops_the_preparation_within_one_chunk_leaving_the_conversation(
        tmp_path):
    model = _Gated()
    s = _System(tmp_path, model=model)
    s.prepared.note_session(SESSION, CLIENT)
    async with s.harness:
        slot = await s.conversation()
        before = s.slot_state(slot)
        prep_state = id(s.engine.engines[slot].state)
        model.armed = prep_state
        await s.idle_tick()
        assert await asyncio.to_thread(model.entered.wait, 20)  # its first chunk runs
        assert (await s.stats())["running"] is not None
        # A request of another conversation arrives: the engine cancels the preparation as it
        # accepts it; the chunk running ends and no other of the preparation's runs.
        mark = len(model.calls)
        await s.harness.ask("engine", Generate("other", [5, 6, 7, 8, 9], GenerationParams(
            max_tokens=3), reply_to=s.client, session="session-b"))
        model.release.set()
        await s.until(lambda st: st["yielded"] == 1)
        done = await s.client.expect(GenerationFinished, 20)
        while done.request_id != "other":
            done = await s.client.expect(GenerationFinished, 20)
        assert done.slot != slot
        after_cancel = [c for c in model.calls[mark:] if c[1] == prep_state]
        assert after_cancel == []  # not one more chunk or step of the preparation
        _same(before, s.slot_state(slot))
        stats = await s.stats()
        assert stats["yielded_by"]["request"] == 1 and stats["finished"] == 0
        assert len(s.prepared) == 0 and not s.box_lock.held
        # The benchmark hook: the time from the cancel to the preparation's end.
        assert stats["yield_ms_last"] is not None
        print(f"preparer yield latency: {stats['yield_ms_last']:.2f} ms")
        s.preparer.check_invariants()
        s.engine.check_invariants()
        # Idle again, it writes the summary after all.
        await s.idle_tick()
        await s.until(lambda st: st["finished"] == 1)
        _same(before, s.slot_state(slot))


async def test_a_process_waiting_in_flock_for_the_box_lock_stops_the_preparation(tmp_path):
    model = _Gated()
    s = _System(tmp_path, model=model)
    s.prepared.note_session(SESSION, CLIENT)
    async with s.harness:
        slot = await s.conversation()
        before = s.slot_state(slot)
        model.armed = id(s.engine.engines[slot].state)
        await s.idle_tick()
        assert await asyncio.to_thread(model.entered.wait, 20)
        assert s.box_lock.held
        waiter = subprocess.Popen(["flock", "-w", "30", str(s.lock_path), "true"])
        try:
            async with asyncio.timeout(10):
                while not s.box_lock.waiters():
                    await asyncio.sleep(0.01)
            await s.tick()  # the poll sees the waiter and cancels the preparation
            model.release.set()
            await s.until(lambda st: st["yielded"] == 1)
            assert await asyncio.to_thread(waiter.wait, 10) == 0  # it got the lock
        finally:
            model.release.set()
            if waiter.poll() is None:
                waiter.kill()
        _same(before, s.slot_state(slot))
        stats = await s.stats()
        assert stats["yielded_by"]["lock_waiter"] == 1 and len(s.prepared) == 0
        s.preparer.check_invariants()


async def test_a_drain_stops_the_preparation(tmp_path):
    model = _Gated()
    s = _System(tmp_path, model=model)
    s.prepared.note_session(SESSION, CLIENT)
    async with s.harness:
        slot = await s.conversation()
        before = s.slot_state(slot)
        model.armed = id(s.engine.engines[slot].state)
        await s.idle_tick()
        assert await asyncio.to_thread(model.entered.wait, 20)
        await s.harness.ask("engine", Drain(reply_to=s.client))
        model.release.set()
        await s.until(lambda st: st["yielded"] == 1)
        _same(before, s.slot_state(slot))
        assert (await s.stats())["yielded_by"]["drain"] == 1


async def test_it_starts_only_idle_unlocked_for_a_long_agent_conversation_and_once_an_end(
        tmp_path):
    s = _System(tmp_path)
    async with s.harness:
        await s.conversation()
        await s.idle_tick()  # not an agent session (it never sent tools)
        assert (await s.stats())["started"] == 0
        s.prepared.note_session(SESSION, CLIENT)
        s.harness.clock.advance(IDLE_S - 5)
        for hook in s.engine.request_hooks:  # as the engine calls them for a request it accepts
            hook(Generate("x", [1], GenerationParams(max_tokens=1)))
        s.harness.clock.advance(IDLE_S - 1)
        await s.tick()  # a request came less than idle_s ago
        assert (await s.stats())["started"] == 0
        s.preparer.min_tokens = len(CONVERSATION) + 100
        await s.idle_tick()  # the conversation is under min_tokens
        assert (await s.stats())["started"] == 0
        s.preparer.min_tokens = MIN_TOKENS
        fd = os.open(s.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another holder: a hold is on
            await s.idle_tick()
            stats = await s.stats()
            assert stats["started"] == 0 and stats["lock_busy"] == 1
        finally:
            os.close(fd)
        await s.idle_tick()
        await s.until(lambda st: st["finished"] == 1)
        await s.idle_tick()  # the summary at this end anchor is written: not again
        await s.idle_tick()
        stats = await s.stats()
        assert stats["started"] == 1 and stats["finished"] == 1
        s.preparer.check_invariants()


async def test_an_idle_generate_is_refused_while_a_request_is_known(tmp_path):
    s = _System(tmp_path, box_lock=False)
    async with s.harness:
        await s.harness.ask("engine", Generate("long", [1, 2, 3], GenerationParams(
            max_tokens=500), reply_to=s.client))
        reply = await s.harness.ask("engine", Generate(
            "idle", [1, 2, 3, 4], GenerationParams(max_tokens=2), reply_to=s.client,
            side=True, idle=True))
        assert isinstance(reply, GenerationRejected)
        await s.client.expect(GenerationFinished, 20)


async def test_a_prepared_answer_is_found_only_for_its_session_end_rows_system_text_and_template(
        tmp_path):
    s = _System(tmp_path)
    s.prepared.note_session(SESSION, CLIENT)
    s.prepared.remember_instructions(CLIENT, "their system text", "their instructions")
    async with s.harness:
        slot = await s.conversation()
        state = s.slot_state(slot)
        end_ids = state["token_ids"][:state["end"][0]]
        await s.idle_tick()
        await s.until(lambda st: st["finished"] == 1)
    digest = rows_digest(end_ids)
    p = s.prepared
    assert p.lookup(SESSION, digest, DEFAULT_SYSTEM_TEXT, TEMPLATE) is None  # theirs was used
    got = p.lookup(SESSION, digest, "their system text", TEMPLATE)
    assert got is not None and got.instructions == "their instructions"
    assert p.lookup("session-b", digest, "their system text", TEMPLATE) is None
    assert p.lookup(SESSION, rows_digest(end_ids[:-1]), "their system text", TEMPLATE) is None
    assert p.lookup(SESSION, rows_digest(end_ids + [5]), "their system text", TEMPLATE) is None
    assert p.lookup(SESSION, digest, "their system text", "another template") is None
    assert p.lookup(None, digest, "their system text", TEMPLATE) is None
    assert (p.served, p.missed) == (1, 5)


@pytest.mark.parametrize("parallel", [1, 2])
async def test_the_preparation_runs_in_the_conversations_own_slot_as_a_guest(tmp_path, parallel):
    s = _System(tmp_path, parallel=parallel, box_lock=False)
    s.prepared.note_session(SESSION, CLIENT)
    async with s.harness:
        slot = await s.conversation()
        if parallel > 1:  # another conversation, placed last: a side request's rule avoids it
            other = await s.conversation([(i * 5 + 1) % 97 for i in range(90)], "session-b",
                                         "turn-b")
            assert other != slot
        before = s.slot_state(slot)
        others = [s.slot_state(i) for i in range(parallel) if i != slot]
        await s.idle_tick()
        await s.until(lambda st: st["finished"] == 1)
        _same(before, s.slot_state(slot))
        for i, want in zip([i for i in range(parallel) if i != slot], others):
            _same(want, s.slot_state(i))
        last = (await s.stats())["last_finished"]
    # It went on from the conversation's end anchor, in its slot: only the turn was read.
    assert (last["slot"], last["source"], last["guest"]) == (slot, "end", True)
    assert last["reused_tokens"] == before["end"][0]
    assert last["reread_tokens"] == len(_turn(DEFAULT_SYSTEM_TEXT, DEFAULT_INSTRUCTIONS))


def test_another_program_on_the_gpu_is_a_second_pid_or_one_that_is_not_ours():
    from tandem.actors.compaction_preparer import gpu_others
    assert not gpu_others("", 10)
    assert not gpu_others("10\n", 10)
    assert gpu_others("10\n11\n", 10)
    assert not gpu_others("99\n", 10)  # another pid namespace: the one entry is this process
    assert gpu_others("99\n98\n", 10)
