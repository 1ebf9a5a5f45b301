"""Several choices of one prompt (OpenAI's ``n``): the prompt read once, the choices decoded as a
batch.

Choice 0 runs as any generation on its slot's engine: the plan's resume, its prefill on the grid,
its anchors, the prompt-end anchor. Once its prompt is forwarded (its ``on_prefill``, or at once
when a cache restored the whole prompt with its logits), ``Choices.fork`` copies the engine's
rows and sections into a sequence of its own for every other choice (side rows: never another
slot, so no conversation in place loses its rows to a choice), and each choice samples its
first token from the same prompt logits and decodes on. ``Choices.run`` drives the choices in
lockstep: their decode steps go to the scheduler as one `DecodeBatch`, forwarded in one batched
step (``decode_batch``: a sequence's logits are the bits it gets alone), so choice i writes the
tokens an n = 1 request with choice i's seed writes.

Seeds: choice i samples with ``seed + i`` (``choice_seed``); with no seed every choice draws its
own. Choice 0's rows stay in the slot: its end is the conversation's end anchor for the next
turn (a client usually goes on from the first choice); the forks' rows are released when the
request ends, finished, failed or cancelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine import CHUNK, DecodeStep, Engine, GenerationResult, SamplingParams, Step, \
    VerifyStep, decode_batch, forward_step
from tandem.models.base import HeadRow, prompt_logits
from tandem.models.rows import release_rows


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: the request's seed + index (None: every choice its own draw)."""
    return None if seed is None else seed + index


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: its own seed; the prompt's logprobs are choice 0's alone (a
    fork never forwards the prompt)."""
    if index == 0:
        return params
    return dataclasses.replace(params, seed=choice_seed(params.seed, index),
                               prompt_logprobs=None)


@dataclass(frozen=True)
class DecodeBatch:
    """Several choices' decode steps of one request, forwarded together in one batched step:
    sent back their logits in order (``decode_batch``)."""

    steps: tuple[DecodeStep | VerifyStep, ...]


def fork(engine: Engine, window: int) -> Engine:
    """A sequence of its own over ``engine``'s model holding a copy of its rows and sections at
    its length (nothing pending), with room for ``window`` rows (the prompt and the answer)."""
    twin = Engine(engine.model, window=window, prefix_chunk=engine.prefix_chunk)
    src, dst = engine.cache_state(), twin.cache_state()
    n = engine.length
    for name, t in src.sections.items():
        dst.sections[name].copy_(t)
    for name, view in src.views.items():
        dst.views[name].rows(0, n).copy_(view.rows(0, n))
    twin.resume_at(n, engine.token_ids, taint=engine.taint)
    return twin


class Choices:
    """The n choices of one request, on the engine thread. ``make(i, engine, logits)`` is
    choice i's generation over its fork, its first token sampled from ``logits``."""

    def __init__(self, n: int, make: Callable[[int, Engine, torch.Tensor], Generator]) -> None:
        self.n = n
        self.make = make
        self.forks: list[Engine] = []
        self.steps: list[Generator] = []

    def fork(self, engine: Engine, logits: "torch.Tensor | HeadRow", max_tokens: int) -> None:
        """At the prompt's end: the other choices' sequences, copies of ``engine``'s state,
        each as long as the prompt and its answer can be (as the slot's, within the window)."""
        if self.forks:
            return
        window = min(engine.window, engine.length + max_tokens)
        # read by every choice; the slot's next forward may reuse it
        logits = prompt_logits(logits).clone()
        for i in range(1, self.n):
            twin = fork(engine, window)
            self.forks.append(twin)
            self.steps.append(self.make(i, twin, logits))

    def run(self, first: Generator[Step, Any, GenerationResult]
            ) -> Generator[Step | DecodeBatch, Any, list[GenerationResult]]:
        """Choice 0's steps (``first``: its prefill's chunks pass through alone), then every
        choice's decode steps together; each choice's result, in order. A choice that never
        ran (choice 0's prefill was stopped before its end) is an empty cancelled one."""
        gens: dict[int, Generator] = {0: first}
        results: dict[int, GenerationResult] = {}
        sends: dict[int, Any] = {0: None}
        joined = False
        try:
            while gens:
                steps: dict[int, Any] = {}
                for i, value in sends.items():
                    try:
                        steps[i] = gens[i].send(value)
                    except StopIteration as done:
                        results[i] = done.value
                        del gens[i]
                if not joined and self.steps:
                    joined = True
                    for i, gen in enumerate(self.steps, 1):
                        gens[i] = gen
                        try:
                            steps[i] = next(gen)
                        except StopIteration as done:
                            results[i] = done.value
                            del gens[i]
                if not steps:
                    break
                if any(step is CHUNK for step in steps.values()):
                    # Only choice 0 prefills, and before the forks exist.
                    assert list(steps) == [0], "a choice prefills beside another"
                    yield CHUNK
                    sends = {0: None}
                    continue
                order = sorted(steps)
                if len(order) == 1:
                    sends = {order[0]: (yield steps[order[0]])}
                else:
                    rows = yield DecodeBatch(tuple(steps[i] for i in order))
                    sends = dict(zip(order, rows))
        finally:
            for gen in gens.values():
                gen.close()
        first_result = results[0]
        return [results.get(i) or _never_ran(first_result) for i in range(self.n)]

    def release(self) -> None:
        """The forks' rows go back (their pages to the OS on a CPU); the sequences are dropped."""
        for gen in self.steps:
            gen.close()
        for twin in self.forks:
            release_rows(twin.state, 0)
        self.forks.clear()
        self.steps.clear()


def _never_ran(first: GenerationResult) -> GenerationResult:
    return GenerationResult(token_ids=[], finish_reason="cancelled",
                            prompt_tokens=first.prompt_tokens, reused_tokens=first.reused_tokens,
                            prefill_ms=first.prefill_ms, decode_ms=0.0)


def decode_steps(need: DecodeStep | VerifyStep | DecodeBatch
                 ) -> Sequence[DecodeStep | VerifyStep]:
    """A run's decode steps (a verify block among them): one, or a request's choices'."""
    return need.steps if isinstance(need, DecodeBatch) else (need,)


def sent(need: DecodeStep | VerifyStep | DecodeBatch, rows: Sequence[torch.Tensor]) -> Any:
    """What a run waiting on ``need`` is sent back: its logits, or its choices' in order."""
    return list(rows) if isinstance(need, DecodeBatch) else rows[0]


def drive(steps: Generator[Any, Any, Any]) -> Any:
    """Run a generator of steps alone (``tandem.engine.run_steps`` with choices): a batch of
    choices forwarded in one batched step."""
    value = None
    try:
        while True:
            step = steps.send(value)
            value = (decode_batch(step.steps) if isinstance(step, DecodeBatch)
                     else forward_step(step))
    except StopIteration as done:
        return done.value
