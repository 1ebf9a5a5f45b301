"""Requests in different slots at once (issue 14, part 3), through the real EngineActor, Engine
and tier actors with requests injected by the harness: prefills run one at a time in grid
chunks, a decoding slot gets a step between every two chunks of another's prefill, the decode
steps of the slots run as one batched forward, and each request's tokens are those it gets
alone (greedy gate: the test model's recurrent state remembers, so a step that mixed a
neighbour's state in would change the tokens). Cancelling one leaves the others' tokens."""

from __future__ import annotations

import asyncio

import torch
from generation_run import run_generation

from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (CancelGeneration, CaptureLockGranted, Generate,
                                           GenerationFinished, GenerationParams,
                                           GenerationStarted, ReleaseCaptureLock,
                                           RequestCaptureLock, TokenGenerated)
from tandem.actors.harness import Harness
from tandem.actors.tiers import ParkActor, ResidentActor
from tandem.cache.memory import PARK_LEVELS, RESIDENT_LEVELS, Accounts, MemoryAccountant, Share
from tandem.cache.resident import ResidentPrefix, make_holdings
from tandem.engine import Engine
from tandem.models.third import ThirdModel

WINDOW, CHUNK = 1024, 16
MiB = 1 << 20
# The test model decodes thousands of tokens a second: a probe's mailbox must hold a burst of
# them, or the engine sees its sink full and cancels the generation (a real sink is a queue).
PROBE_CAPACITY = 4096


def _prompt(n: int, seed: int) -> list[int]:
    return [(i * 7 + seed * 13 + 3) % 97 for i in range(n)]


def _system(harness: Harness, parallel: int, model=None):
    memory = MemoryAccountant({level: 64 * MiB for level in RESIDENT_LEVELS + PARK_LEVELS})
    resident_memory, park_memory = memory.part(RESIDENT_LEVELS), memory.part(PARK_LEVELS)
    slots, parked = [], None
    for share in [Share(resident_memory) for _ in range(parallel)]:
        held, park = make_holdings(share, CHUNK, park_memory=park_memory)
        parked = parked or park
        slots.append(held)
    resident = harness.add(ResidentActor("resident", slots=slots))
    park = harness.add(ParkActor("park", holdings=parked))
    composer_memory = Accounts(resident_memory, park_memory)
    model = model or ThirdModel()
    return harness.add(EngineActor(
        "engine", make_engine=lambda: Engine(model, window=WINDOW, prefix_chunk=CHUNK),
        make_resident=lambda e: ResidentPrefix.lent_to(e, composer_memory),
        tiers=(resident, park), parallel=parallel))


async def _alone(prompt: list[int], max_tokens: int) -> list[int]:
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
    _system(harness, 1)
    async with harness:
        tokens, done = await run_generation(harness, client, "alone", prompt, max_tokens)
    assert isinstance(done, GenerationFinished)
    return tokens


async def _read(probe, request_id: str, tokens: dict[str, list[int]],
                done: dict[str, GenerationFinished]) -> None:
    """Everything ``probe`` got, sorted by request, until ``request_id`` finished."""
    while request_id not in done:
        got = await probe.expect((TokenGenerated, GenerationFinished, GenerationStarted), 20)
        if isinstance(got, TokenGenerated):
            tokens.setdefault(got.request_id, []).append(got.token_id)
        elif isinstance(got, GenerationFinished):
            done[got.request_id] = got


class _Recording(ThirdModel):
    """The test model, recording on the engine thread what each forward ran: a prefill chunk
    of one sequence, or a decode step of several."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def forward(self, state, token_ids, start, decode=False, on_logits=None, logits=True):
        self.calls.append(("decode" if decode else "chunk", (id(state),)))
        return super().forward(state, token_ids, start, decode, on_logits, logits)

    def forward_batch(self, states, token_ids, positions):
        self.calls.append(("decode", tuple(id(s) for s in states)))
        return torch.stack([super(_Recording, self).forward(s, torch.tensor([t]), p,
                                                            decode=True)
                            for s, t, p in zip(states, token_ids, positions)])


async def test_a_decoding_slot_gets_a_step_between_every_two_chunks_of_another_prefill():
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
    model = _Recording()
    actor = _system(harness, 2, model)
    long = _prompt(10 * CHUNK, 2)
    async with harness:
        await harness.ask("engine", Generate("a", _prompt(5, 1), GenerationParams(max_tokens=80),
                                             reply_to=client))
        await client.expect(TokenGenerated, 20)
        await harness.ask("engine", Generate("b", long, GenerationParams(max_tokens=2),
                                             reply_to=client))
        tokens: dict[str, list[int]] = {}
        done: dict[str, GenerationFinished] = {}
        await _read(client, "a", tokens, done)
        await _read(client, "b", tokens, done)
        actor.check_invariants()
        a_state = id(actor.engines[done["a"].slot].state)
        b_state = id(actor.engines[done["b"].slot].state)
    chunks = [i for i, (kind, seqs) in enumerate(model.calls)
              if kind == "chunk" and seqs == (b_state,)]
    assert len(chunks) == 10
    for before, after in zip(chunks, chunks[1:]):
        steps = model.calls[before + 1:after]
        assert any(kind == "decode" and a_state in seqs for kind, seqs in steps), \
            f"two chunks of b's prefill with no step of a between: {model.calls}"
    assert done["a"].slot != done["b"].slot
    assert ("decode", (a_state, b_state)) in model.calls  # b's tokens beside a's, one batch


async def test_three_generations_at_once_give_each_the_tokens_it_gets_alone():
    prompts = {"a": _prompt(40, 3), "b": _prompt(21, 4), "c": _prompt(70, 5)}
    wanted = {"a": 400, "b": 300, "c": 40}  # the first two decode while the others plan
    alone = {name: await _alone(prompt, wanted[name]) for name, prompt in prompts.items()}
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
    actor = _system(harness, 3)
    async with harness:
        for name, prompt in prompts.items():
            await harness.ask("engine", Generate(name, prompt,
                                                 GenerationParams(max_tokens=wanted[name]),
                                                 reply_to=client))
        tokens: dict[str, list[int]] = {}
        done: dict[str, GenerationFinished] = {}
        for name in prompts:
            await _read(client, name, tokens, done)
        actor.check_invariants()
        batches = actor.snapshot()["decode_batches"]
    assert batches.get(3, 0) >= 10, batches  # the three decoded as one batch
    assert sorted(d.slot for d in done.values()) == [0, 1, 2]
    for name, prompt in prompts.items():
        again = await _alone(prompt, wanted[name])
        assert again == alone[name], f"{name} alone differs from alone"
        assert tokens[name] == alone[name], name


async def test_cancelling_one_generation_mid_batch_leaves_the_other_its_tokens_and_rows():
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
    actor = _system(harness, 2)
    a, b = _prompt(30, 6), _prompt(50, 7)
    async with harness:
        await harness.ask("engine", Generate("a", a, GenerationParams(max_tokens=200),
                                             reply_to=client))
        await harness.ask("engine", Generate("b", b, GenerationParams(max_tokens=40),
                                             reply_to=client))
        tokens: dict[str, list[int]] = {}
        done: dict[str, GenerationFinished] = {}
        while len(tokens.get("b", [])) < 5:
            got = await client.expect((TokenGenerated, GenerationStarted), 20)
            if isinstance(got, TokenGenerated):
                tokens.setdefault(got.request_id, []).append(got.token_id)
        await harness.inject("engine", CancelGeneration("a"))
        await _read(client, "a", tokens, done)
        await _read(client, "b", tokens, done)
        assert done["a"].finish_reason == "cancelled"
        # a's conversation goes on from its end in its slot: the rows its cancel left are sound.
        follow = a + tokens["a"] + [5, 6]
        more, again = await run_generation(harness, client, "a2", follow, 6)
        actor.check_invariants()
    assert tokens["b"] == await _alone(b, 40)
    assert again.slot == done["a"].slot and again.cache_source == "end"
    assert more == await _alone(follow, 6)


async def test_an_outside_holder_takes_the_lock_between_two_steps_and_holds_off_later_ones():
    """A copier's RequestCaptureLock (the disk and spill writers' copies) is granted between two
    of the scheduler's rounds: the running generation pauses (no token while it holds), a
    request behind it in line waits for it, and the paused one goes on to the tokens it gets
    alone once it releases."""
    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client", mailbox_capacity=PROBE_CAPACITY)
    copier = harness.probe("copier")
    actor = _system(harness, 2)
    a = _prompt(9, 8)
    async with harness:
        await harness.ask("engine", Generate("a", a, GenerationParams(max_tokens=300),
                                             reply_to=client))
        first = await client.expect(TokenGenerated, 20)
        await harness.inject("engine", RequestCaptureLock("copier", reply_to=copier))
        await harness.ask("engine", Generate("b", _prompt(9, 9), GenerationParams(max_tokens=3),
                                             reply_to=client))
        grant = await copier.expect(CaptureLockGranted, 20)
        assert actor.snapshot()["capture_lock"] == "copier" and actor.running == 1
        assert actor.waiting == 1  # b waits behind the copier although a slot is idle
        actor.check_invariants()
        tokens: dict[str, list[int]] = {"a": [first.token_id]}
        for record in client.unread:  # what a wrote before the thread parked
            if isinstance(record.message, TokenGenerated):
                got = await client.expect(TokenGenerated, 1)
                tokens.setdefault(got.request_id, []).append(got.token_id)
        try:
            await client.expect(TokenGenerated, 0.2)
            raise AssertionError("a token came while the copier held the lock")
        except (TimeoutError, asyncio.TimeoutError):
            pass
        assert len(tokens["a"]) < 299
        await harness.inject("engine", ReleaseCaptureLock("copier", grant.grant_id))
        done: dict[str, GenerationFinished] = {}
        await _read(client, "a", tokens, done)
        await _read(client, "b", tokens, done)
        await asyncio.sleep(0)
        actor.check_invariants()
        assert actor.snapshot()["capture_lock"] is None
    assert len(tokens["b"]) == 3
    alone = await _alone(a, 300)
    assert tokens["a"] == alone
