"""A request whose work raises on the engine thread fails alone (issue 11, finding 1): the engine
actor serves the next request, and no cache resumes it over the rows the failed one half wrote.

The failure is injected through the real EngineActor, Engine and resident prefix: a model whose
forward raises on a chosen call after it wrote the state (a forward cut short has absorbed rows
that ``token_ids`` does not show). Gate: a grid resume after the failure gives the sections a
cold prefill gives, torch.equal, and the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from generation_run import run_generation

from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import GenerationFailed, GenerationFinished
from tandem.actors.harness import Harness
from tandem.cache.memory import MemoryAccountant
from tandem.cache.resident import ResidentPrefix
from tandem.engine import Engine, SamplingParams
from tandem.models.third import ThirdModel

WINDOW, CHUNK = 256, 16
MiB = 1 << 20
PROMPT = [(i * 7 + 3) % 97 for i in range(40)]
MORE = [(i * 5 + 1) % 97 for i in range(30)]


class Flaky:
    """ThirdModel whose forward raises on the calls in ``fail_at`` (1-based), after writing."""

    def __init__(self) -> None:
        self.model = ThirdModel()
        self.calls = 0
        self.fail_at: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, state, token_ids, start, decode=False, **kw):
        self.calls += 1
        logits = self.model.forward(state, token_ids, start, decode=decode, **kw)
        if self.calls in self.fail_at:
            raise RuntimeError("injected failure")
        return logits


def _resident(engine: Engine) -> ResidentPrefix:
    budgets = {level: 64 * MiB for level in ("anchors", "end", "stash", "park", "pin")}
    return ResidentPrefix(engine, MemoryAccountant(budgets))


def _cold(prompt: list[int], max_tokens: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A fresh engine's greedy tokens, and its sections after them (the rows: the prompt)."""
    engine = Engine(ThirdModel(), window=WINDOW, prefix_chunk=CHUNK)
    out = engine.generate(prompt, SamplingParams(max_tokens=max_tokens)).token_ids
    return out, {k: v.clone() for k, v in engine.cache_state().sections.items()}




@pytest.mark.parametrize("caches", [True, False])
@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_a_failed_forward_fails_its_request_and_the_next_is_served_from_sound_rows(
        caches, where):
    model = Flaky()
    built: list[Engine] = []

    def make_engine():
        built.append(Engine(model, window=WINDOW, prefix_chunk=CHUNK))
        return built[0]

    harness = Harness(ready_timeout_s=10, stop_timeout_s=10)
    client = harness.probe("client")
    actor = harness.add(EngineActor("engine", make_engine=make_engine,
                                    make_resident=_resident if caches else None))
    async with harness:
        _, done = await run_generation(harness, client, "a", PROMPT, 4)
        assert isinstance(done, GenerationFinished)
        # b shares a's prompt but not its answer: with caches it resumes at the anchor at 32
        # (below the decoded rows: every anchor b takes is a cold prefill's) and its chunks end
        # at 48, 64 (anchors) and 70; without, it starts at 0 (five chunks). Then it decodes.
        follow = PROMPT + MORE
        forwards = (3 if caches else 5) + (1 if where == "decode" else 0)
        model.fail_at = {model.calls + forwards}
        _, failed = await run_generation(harness, client, "b", follow, 3)
        assert isinstance(failed, GenerationFailed)
        assert (failed.reason, failed.request_id) == ("engine_error", "b")
        engine = built[0]
        if caches:
            # Cut back to its highest sound anchor, the ones above it and the end gone.
            assert engine.length == 64
            assert sorted(actor.resident.anchors) == [16, 32, 48, 64]
            assert actor.resident.end is None
        else:
            assert engine.length == 0
        # The next request runs, and resumes where the rows are sound: at the anchor with
        # caches, from token 0 without; never over what b half wrote.
        tokens, done = await run_generation(harness, client, "c", follow, 1)
        assert isinstance(done, GenerationFinished)
        assert (done.reused_tokens, done.cache_source) == \
            ((64, "resident") if caches else (0, "cold"))
        sections = {k: v.clone() for k, v in engine.cache_state().sections.items()}
        assert actor.snapshot()["failed_total"] == 1
        actor.check_invariants()
    want_tokens, want_sections = _cold(follow, 1)
    assert tokens == want_tokens
    assert all(torch.equal(sections[k], want_sections[k]) for k in want_sections)
    assert harness.supervisor.exception is None


def test_an_anchor_whose_copy_a_failure_cut_short_is_dropped_and_the_rows_cut_below_it():
    engine = Engine(ThirdModel(), window=WINDOW, prefix_chunk=CHUNK)
    resident = _resident(engine)
    prompt = PROMPT + MORE  # 70 tokens: anchors at 16, 32, 48, 64
    resident.begin(prompt, 4)
    engine.prefill(prompt, on_chunk=resident.on_chunk)
    assert sorted(resident.anchors) == [16, 32, 48, 64]
    anchor = resident.anchors[64]

    def cut_short(state):
        first = next(iter(anchor.tensors.values()))
        first.fill_(float("nan"))  # part written, then the failure
        raise RuntimeError("injected failure")
    anchor.copy_from = cut_short  # the next take at 64 overwrites it in place
    with pytest.raises(RuntimeError):
        resident.on_chunk(64)
    resident.abort()
    assert sorted(resident.anchors) == [16, 32, 48] and engine.length == 48
    resident.check_invariants()
    # The rows resume from the anchor at 48 and give a cold prefill's state.
    engine.prefill(prompt)
    _, want = _cold(prompt, 1)
    assert all(torch.equal(engine.cache_state().sections[k], want[k]) for k in want)
