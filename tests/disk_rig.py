"""The disk tier as the engine will drive it, on a real engine: a plan, a cold prefill that stages
the plan's anchors as it passes their lines, the writes, and a restore into a fresh engine that
must equal the cold one bit for bit (logits of the continued prefill, sections, rows)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import SHARED, Namespace
from tandem.engine import Engine
from tandem.io.admission import Admission, DiskPlan
from tandem.io.fingerprint import Identity
from tandem.io.tier import DiskOffer, DiskTier, HostRows, host_rows

GRID = 64
FP = "0f" * 32
WINDOW = 512
GB = 10 ** 9


class Clock:
    """Wall and monotonic time that move only when told (usage, rates)."""

    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def wall(self) -> float:
        return self.now

    def monotonic(self) -> float:
        self.now += 0.001  # every read takes a millisecond: the rates stay finite
        return self.now


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, window: int = WINDOW) -> Engine:
    return Engine(model, window=window, prefix_chunk=GRID)


def make_tier(root: Path, fingerprint: str = FP, *, admit_after: int = 2, head_anchors: int = 4,
              min_tokens: int = 0, budget_nbytes: int = 1 << 40, floor_nbytes: int = 0,
              free_nbytes: int | None = None, clock: Clock | None = None,
              adopted: frozenset[str] = frozenset()) -> DiskTier:
    clock = clock or Clock()
    admission = Admission(root / "admission.counts", grid=GRID, admit_after=admit_after,
                          head_anchors=head_anchors, min_tokens=min_tokens)
    return DiskTier(root, Identity(fingerprint, adopted), GRID, admission=admission,
                    budget_nbytes=budget_nbytes, floor_nbytes=floor_nbytes,
                    wall=clock.wall, monotonic=clock.monotonic,
                    free_nbytes=None if free_nbytes is None else (lambda _root: free_nbytes))


def head_plan(tier: DiskTier, prompt: list[int], namespace: Namespace = SHARED,
              start: int = 0) -> DiskPlan:
    """A session's first request: anchors at the last lines below its end."""
    return tier.plan(prompt, namespace, start=start, taint=None, first_of_session=True,
                     last_user_start=len(prompt))


def cold_prefill(model, prompt: list[int], lines=()) -> tuple[Engine, torch.Tensor,
                                                             dict[int, SectionsCopy]]:
    """A cold prefill of ``prompt``, its sections staged at each of ``lines`` as it passes."""
    cold = engine(model)
    staged: dict[int, SectionsCopy] = {}

    def on_chunk(end: int) -> None:
        if end in lines:
            staged[end] = SectionsCopy.take(cold.cache_state())

    logits = cold.prefill(prompt, on_chunk=on_chunk)
    return cold, logits, staged


def chunk_rows(eng: Engine, plan: DiskPlan) -> dict[int, HostRows]:
    views = eng.cache_state().views
    return {line: host_rows(views, line - GRID, line) for line in plan.chunk_lines}


def write_plan(tier: DiskTier, model, prompt: list[int], plan: DiskPlan):
    """The cold prefill of a planned request and every file of its plan; (engine, logits,
    report)."""
    cold, logits, staged = cold_prefill(model, prompt, plan.anchor_lines)
    report = tier.write_entries(plan, prompt, staged, chunk_rows(cold, plan))
    return cold, logits, report


def restore_fresh(tier: DiskTier, model, prompt: list[int], offer: DiskOffer,
                  eng: Engine | None = None) -> Engine:
    """``offer`` restored into ``eng`` (a fresh engine by default), resumed at its line."""
    eng = eng or engine(model)
    tier.restore(offer, prompt, eng.cache_state())
    eng.resume_at(offer.line, prompt, taint=None)
    return eng


def assert_same_as_cold(eng: Engine, cold: Engine, prompt: list[int], want: torch.Tensor):
    """The gate: the continued prefill's logits, every section and every row of the prompt
    equal the cold prefill's, bit for bit."""
    got = eng.prefill(prompt)
    assert torch.equal(got, want)
    a, b = eng.cache_state(), cold.cache_state()
    for name, t in b.sections.items():
        assert torch.equal(a.sections[name], t), name
    n = len(prompt)
    for name, v in b.views.items():
        assert torch.equal(a.views[name].rows(0, n), v.rows(0, n)), name
