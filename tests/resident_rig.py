"""A resident prefix over a real engine, driven as the engine actor drives it."""

from __future__ import annotations

import torch

from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED
from tandem.cache.resident import ResidentPrefix, Resume
from tandem.engine import Engine, SamplingParams

CHUNK = 64
MiB = 1 << 20


def budgets(**over) -> dict:
    out = {"anchors": 64 * MiB, "end": 8 * MiB, "stash": 64 * MiB, "park": 64 * MiB,
           "pin": 64 * MiB, "prompt_end": 8 * MiB}
    out.update(over)
    return out


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Rig:
    def __init__(self, model, window: int = 2048, **budget_over):
        self.model = model
        self.engine = Engine(model, window=window, prefix_chunk=CHUNK)
        self.memory = MemoryAccountant(budgets(**budget_over))
        self.resident = ResidentPrefix(self.engine, self.memory)

    def prefill(self, prompt: list[int], session: str | None = None,
                max_tokens: int = 16, namespace: str = SHARED) -> tuple[Resume, torch.Tensor]:
        """begin, prefill, keep the end: the logits of the last prompt position."""
        resume = self.resident.begin(prompt, max_tokens, session, namespace)
        logits = self.engine.prefill(prompt, on_chunk=self.resident.on_chunk)
        self.resident.finish()
        self.resident.check_invariants()
        return resume, logits

    def turn(self, prompt: list[int], session: str | None = None,
             max_tokens: int = 16, namespace: str = SHARED) -> tuple[Resume, list[int]]:
        resume = self.resident.begin(prompt, max_tokens, session, namespace)
        result = self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens),
                                      on_chunk=self.resident.on_chunk,
                                      on_prefill=self.resident.on_prefill, logits=resume.logits)
        self.resident.finish()
        self.resident.check_invariants()
        return resume, result.token_ids


def cold(model, prompt: list[int], window: int = 2048) -> tuple[Engine, torch.Tensor]:
    engine = Engine(model, window=window, prefix_chunk=CHUNK)
    return engine, engine.prefill(prompt)


def assert_bit_exact(engine: Engine, other: Engine, n: int) -> None:
    a, b = engine.cache_state(), other.cache_state()
    for name in a.sections:
        assert torch.equal(a.sections[name], b.sections[name]), name
    for name in a.views:
        assert torch.equal(a.views[name].rows(0, n), b.views[name].rows(0, n)), name


def uninterrupted(model, turns: list[list[int]], max_tokens: int = 16,
                  window: int = 2048) -> list[list[int]]:
    """Each turn's greedy tokens on an engine that only ever extends its rows (no cache)."""
    engine = Engine(model, window=window, prefix_chunk=CHUNK)
    return [engine.generate(p, SamplingParams(max_tokens=max_tokens)).token_ids for p in turns]


class Uninterrupted:
    """One conversation on a plain engine that only ever extends its rows (no cache).

    The greedy gate's reference, and more: an engine that a cache resumed where this one stands
    (the end of the last turn, or a grid line under a cold prefill's chunks) forwarded the very
    same inputs on the very same chunks, so it holds this engine's bits. ``assert_same`` holds a
    decode-written restore to them: a restore that loses or perturbs any part of the state (a
    1.001 scale included) fails it, where the greedy tokens alone may not change."""

    def __init__(self, model, window: int = 2048):
        self.engine = Engine(model, window=window, prefix_chunk=CHUNK)

    def turn(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        return self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens)).token_ids

    def assert_same(self, engine: Engine) -> None:
        assert engine.token_ids == self.engine.token_ids
        assert_bit_exact(engine, self.engine, self.engine.length)


def assert_uninterrupted(engine: Engine, model, turns: list[list[int]], outs: list[list[int]],
                         max_tokens: int = 16, window: int = 2048) -> None:
    """The greedy gate (each turn's tokens those of the uninterrupted run) and the bits the
    uninterrupted run ends with, for a conversation whose every turn resumed at the last one's
    end."""
    plain = Uninterrupted(model, window)
    assert outs == [plain.turn(p, max_tokens) for p in turns]
    plain.assert_same(engine)
