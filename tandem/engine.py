"""The engine: one sequence's buffers, prefill on the absolute grid, greedy and sampled decode.

The rows in place are ``token_ids[:length]``. A prefill forwards what follows them in chunks whose
ends are multiples of ``prefix_chunk`` counted from token 0 (the last chunk partial), so a prefill
resumed at a grid line runs exactly the shapes a cold one ran and writes the same bits (gate 1).
Rows written by decoding, or by a prefill resumed off the grid, are marked by ``taint``: state
above it is held to the greedy gate.

Only the engine actor calls an Engine; it is synchronous and owns every buffer it allocates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

import torch

from tandem.cache.vocabulary import FinishReason
from tandem.logprobs import PromptScorer, TokenLogprob, score
from tandem.models.base import CacheState, Chosen, Cost, HeadRow, Model, ModelError
from tandem.models.image_keys import KEY_BASE, rope_delta
from tandem.models.rows import rows_written
from tandem.tokens import common_prefix

if TYPE_CHECKING:
    from tandem.grammar import TokenGrammar


class ContextOverflow(ModelError):
    """A prompt longer than the window; carries both counts for the API's 400."""

    def __init__(self, num_tokens: int, window: int):
        super().__init__(f"the prompt has {num_tokens} tokens and the window holds {window}")
        self.num_tokens = num_tokens
        self.window = window


# The shortest draft a verify block asks for, and where the draft length starts and falls back
# to after a rejection: a block of up to 5 positions streams the head once, as a step does (on
# torch's decode path it cost one step; against the native step it costs more, DRAFT_REST_MAX).
DRAFT_FLOOR = 4
# A prefill of at most this many tokens over rows that already hold the greedy gate only runs
# as decode runs its tokens (Engine.prefill_steps, HybridModel.forward_tail): on tiny, 4 tokens
# 2.0 against 5.9 ms through the chunk's layer path, 16 4.3 against 7.0, 32 even, 64 18.3
# against 12.9 (one process, alternated).
TAIL_ROWS = 16
# A block whose every draft was rejected costs more than the decode step it stands for (its
# rows' arithmetic, and until the native step took verify blocks, the model's layer path where
# decode was one native call): after one, drafting rests for 1, 2, 4, ... tokens (up to
# DRAFT_REST_MAX) while such blocks follow each other, and comes back at once after a block that
# accepted a draft. On the 0.8B-like checkpoint, whose random text drafts often and is accepted
# little, speculation decoded 14.4 tok/s against 16.3 with it off before the rest.
DRAFT_REST_MAX = 32

# Under this temperature sampling is greedy (the argmax, no draw from the generator): logits / T
# overflows float32 from about T = 1e-38, and long before that the distribution is the argmax's
# but for logits closer than T (vLLM's floor is the same).
TEMPERATURE_FLOOR = 1e-5


class _Keep:
    """``resume_at``'s default taint: the rows in place keep theirs."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # under TEMPERATURE_FLOOR (0 included) is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # OpenAI's penalties (-2..2) and logit_bias ((token id, -100..100) pairs), on the logits
    # before sampling, greedy too; all zero: off (the logits are not touched).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Logprobs (tandem.logprobs: the raw model's, before the processors and the sampler):
    # None off, else how many top tokens each emitted token's entry lists; prompt_logprobs the
    # same for the prompt's tokens, which makes the prefill start at token 0.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not 0 <= self.temperature < math.inf:
            raise ValueError("temperature must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:
                raise ValueError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be None or >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1


@dataclass
class PendingCommit:
    """A verify block's rows past the last landed state (spec: "pending commit").

    ``steps`` holds every section's value after each of the block's positions; ``index`` is the
    last accepted one. The sections in place are still the state before the block, so cutting
    the commit back (trim_pending) is choosing another index, or dropping the block's rows."""

    start: int  # the block's first row
    steps: dict[str, torch.Tensor]
    index: int
    taint_before: int | None


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    reused_tokens: int  # rows in place the prefill resumed at
    prefill_ms: float
    decode_ms: float
    stop_token: int | None = None
    timings: dict = field(default_factory=dict)
    drafted: int = 0  # tokens the drafter proposed
    accepted: int = 0  # of them, those the target agreed with
    # With SamplingParams.logprobs: one entry a token of token_ids; with prompt_logprobs: one a
    # prompt token after the first.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def decode_tok_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)
        return n / (self.decode_ms / 1000) if self.decode_ms > 0 and n else 0.0


def grid_chunks(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """The prefill chunks from ``start`` to ``stop``: each ends on a multiple of ``chunk``."""
    out = []
    pos = start
    while pos < stop:
        end = min(stop, (pos // chunk + 1) * chunk)
        out.append((pos, end))
        pos = end
    return out


def argmax(logits: torch.Tensor) -> int:
    """The greedy token: the first index of the largest logit (a NaN counts as the largest,
    as torch.argmax has it). On a CPU through numpy, whose vectorised argmax reads a 248k
    vocabulary in about 12 us where torch.argmax took 330 (0.3 to 0.7 ms a decoded token);
    the same index, ties and NaNs included."""
    if logits.device.type == "cpu" and logits.dim() == 1 and logits.is_contiguous() \
            and logits.dtype in (torch.float32, torch.float64):
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


class Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator.

    Safe for every SamplingParams: a temperature under the floor is greedy; the distribution is
    computed in float64 (logits / T stays finite down to the floor); top-p keeps the most
    probable token whatever top_p is; a distribution that is still not one (NaN logits from a
    broken model) falls back to the argmax. A sampled position always takes exactly one draw
    from the generator, the fallback too, so one odd position never shifts the seeded tokens
    after it, with speculation on or off."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return argmax(logits)
        # the draw on the host, from the CPU generator, wherever the logits are: the seed's
        # tokens are the same on every device (cpu() is the tensor itself on a CPU)
        return int(torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled token is drawn from (temperature, top-k, top-p): finite,
        non-negative, with a positive sum (what multinomial requires)."""
        p = self.params
        scores = logits.double() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest head whose mass reaches top_p; the first token always stays
            # (a top_p under float precision would otherwise drop it too).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        # float32 for the draw, as before: the tail under its range becomes 0, the head stays.
        probs = probs.float()
        if not (bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0):
            probs = torch.zeros_like(probs)
            probs[int(torch.argmax(torch.nan_to_num(logits.float(), nan=-math.inf)))] = 1.0
        return probs


class LogitsProcessors:
    """OpenAI's presence and frequency penalties and logit_bias, on one position's logits
    before the sampler (greedy or sampled). The penalties count the generated tokens only, as
    OpenAI and vLLM define them: presence subtracts once for each token that appeared in the
    output, frequency times the number of times it did; the prompt is never counted.

    ``so_far`` is the output before the position, ``committed`` how many of its first tokens
    are the generation's output (append-only, counted once, incrementally); the rest are a
    verify block's drafts before the position, counted for that position only."""

    def __init__(self, params: SamplingParams):
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.bias_pairs = params.logit_bias
        self._bias: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._counted = 0

    @classmethod
    def for_params(cls, params: SamplingParams) -> "LogitsProcessors | None":
        """None when every processor is off: the logits are then never touched."""
        if params.presence_penalty == 0 and params.frequency_penalty == 0 \
                and not any(b for _, b in params.logit_bias):
            return None
        return cls(params)

    def __call__(self, logits: torch.Tensor, so_far: Sequence[int],
                 committed: int) -> torch.Tensor:
        scores = logits.float().clone()
        vocab = scores.shape[-1]
        if self.bias_pairs:
            if self._bias is None:
                bad = [t for t, _ in self.bias_pairs if t >= vocab]
                if bad:
                    raise ModelError(f"logit_bias names token id {bad[0]}, outside the "
                                     f"model's {vocab} logits")
                bias = torch.zeros(vocab, dtype=torch.float32, device=scores.device)
                for token_id, value in self.bias_pairs:
                    bias[token_id] = value
                self._bias = bias
            scores += self._bias
        if self.presence or self.frequency:
            if self._counts is None:
                self._counts = torch.zeros(vocab, dtype=torch.float32, device=scores.device)
            if committed > self._counted:
                self._add(self._counts, so_far[self._counted:committed])
                self._counted = committed
            counts = self._counts
            if len(so_far) > committed:
                counts = self._add(counts.clone(), so_far[committed:])
            scores -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores

    @staticmethod
    def _add(counts: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(tokens), dtype=torch.long, device=counts.device)
        return counts.index_add_(0, idx, torch.ones(len(idx), device=counts.device))


class Chunk:
    """A prefill between two chunks: a scheduler may run other sequences' steps here."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CHUNK"


CHUNK = Chunk()


@dataclass(frozen=True)
class DecodeStep:
    """A generation asks for ``token_id`` to be forwarded by the recurrent step on ``engine``
    and is sent the logits of that position (``decode_batch``). ``greedy``: it wants that
    position's greedy token alone, and may be sent a `Chosen` instead (the same token: a model
    whose native step screens its head finds it without computing the logits)."""

    engine: "Engine"
    token_id: int
    greedy: bool = False


@dataclass(frozen=True)
class VerifyStep:
    """A generation asks for a verify block (the last sampled token and its drafts) to be
    forwarded on ``engine`` and is sent every position's logits ``[n, vocab]``, the block left
    pending (``Engine.verify``; ``decode_batch`` runs it beside other sequences' steps)."""

    engine: "Engine"
    token_ids: tuple[int, ...]
    greedy: bool = False  # as DecodeStep's: may be sent a list of Chosen, one a position


@dataclass(frozen=True)
class TailStep:
    """A prefill's short tail (``Engine.prefill_steps`` with ``batch_tail``) asks for
    ``token_ids`` to be forwarded on ``engine`` past its rows as decode forwards them, and is
    sent the last position's `HeadRow` (``decode_batch`` runs it beside other sequences'
    decode steps: the weights read once for them all, and its last row's greedy token
    screened with theirs where ``greedy``)."""

    engine: "Engine"
    token_ids: tuple[int, ...]
    greedy: bool = False


Step = Chunk | DecodeStep | VerifyStep | TailStep


def run_steps(steps: Generator[Step, torch.Tensor | None, "GenerationResult"]):
    """Drive a generator of steps alone: each decode step and verify block forwarded on its
    own engine."""
    value = None
    try:
        while True:
            value = forward_step(steps.send(value))
    except StopIteration as done:
        return done.value


def forward_step(step: Any) -> torch.Tensor | None:
    """One step forwarded alone on its own engine: a decode step's logits, a verify block's,
    None for a prefill chunk (which ran as the generator yielded it)."""
    if isinstance(step, DecodeStep):
        return step.engine.decode(step.token_id, greedy=step.greedy)
    if isinstance(step, VerifyStep):
        return step.engine.verify(step.token_ids, greedy=step.greedy)
    if isinstance(step, TailStep):
        return step.engine.tail(step.token_ids)
    return None


def _stoppable(steps: Generator[Step, Any, torch.Tensor], stop: Callable[[], bool]
               ) -> Generator[Step, Any, torch.Tensor | None]:
    """A prefill's steps that end after a chunk when ``stop()`` says so (None: stopped). It is
    polled when the scheduler comes back to the prefill, so a stop costs at most the chunk
    that was running."""
    try:
        step = next(steps)
        while True:
            value = yield step
            if step is CHUNK and stop():
                steps.close()
                return None
            step = steps.send(value)
    except StopIteration as done:
        return done.value


def decode_batch(steps: Sequence[DecodeStep | VerifyStep | TailStep]) -> list[Any]:
    """Forward the decode steps, verify blocks and prefill tails of several sequences over one
    model as one batched step (``Model.forward_batch``, with a verify block or a tail among
    them ``forward_ragged``: the weights read once; a sequence's logits are the bits it gets
    alone). Each step's logits in order: ``[vocab]`` for a decode, ``[n, vocab]`` for a
    verify block (left pending, as ``Engine.verify`` leaves it), a tail's last position's
    `HeadRow`; a `Chosen` (a list of them for a verify block) where a step marked ``greedy``
    got its token through the model's screen. A step whose engine cannot take its tokens (its
    window is full) raises before any row is written."""
    if len(steps) == 1:
        return [forward_step(steps[0])]
    model = steps[0].engine.model
    if any(s.engine.model is not model for s in steps):
        raise ValueError("a batched decode step runs over one model")
    if len({id(s.engine) for s in steps}) != len(steps):
        raise ValueError("one sequence twice in a batched decode step")
    tails = [i for i, s in enumerate(steps) if isinstance(s, TailStep)]
    takes = getattr(model, "takes_tail", None)
    if tails and (takes is None or not takes([s.engine.state for s in steps])):
        # a batch the native step does not take: each tail alone, the rest batched
        out: list[Any] = [None] * len(steps)
        for i in tails:
            out[i] = forward_step(steps[i])
        rest = [i for i in range(len(steps)) if i not in tails]
        for i, got in zip(rest, decode_batch([steps[i] for i in rest]) if rest else []):
            out[i] = got
        return out
    if tails or any(isinstance(s, VerifyStep) for s in steps):
        return _ragged_batch(model, steps)
    positions = [s.engine._decode_position() for s in steps]
    offsets = [s.engine.rope_delta for s in steps]
    with torch.inference_mode():
        logits = model.forward_batch([s.engine.state for s in steps],
                                     [int(s.token_id) for s in steps], positions,
                                     **({"rope_offsets": offsets} if any(offsets) else {}),
                                     **_choose(model, steps))
    for s, pos in zip(steps, positions):
        s.engine._decoded(s.token_id, pos)
    return list(logits)


def _choose(model: Model, steps: Sequence[DecodeStep | VerifyStep]) -> dict[str, list[bool]]:
    """The batched forward's ``choose`` keyword where a step wants its greedy token alone and the
    model takes it (``chooses``); none otherwise."""
    choose = [s.greedy for s in steps]
    return {"choose": choose} if any(choose) and getattr(model, "chooses", False) else {}


def _ragged_batch(model: Model, steps: Sequence[DecodeStep | VerifyStep | TailStep]
                  ) -> list[Any]:
    """decode_batch with a verify block or a tail in it: one forward_ragged, or, for a model
    without one, its decodes as one forward_batch and each block's forward_verify alone (a
    tail never reaches a model without one: decode_batch runs it alone there)."""
    blocks = [list(s.token_ids) if isinstance(s, (VerifyStep, TailStep)) else [int(s.token_id)]
              for s in steps]
    positions = [s.engine._verify_position(len(b)) if isinstance(s, (VerifyStep, TailStep))
                 else s.engine._decode_position() for s, b in zip(steps, blocks)]
    tail = [isinstance(s, TailStep) for s in steps]
    offsets = [s.engine.rope_delta for s in steps]
    ragged = getattr(model, "forward_ragged", None)
    with torch.inference_mode():
        if ragged is not None:
            logits, sections = ragged([s.engine.state for s in steps], blocks, positions,
                                      verify=[isinstance(s, VerifyStep) for s in steps],
                                      **({"rope_offsets": offsets} if any(offsets) else {}),
                                      **({"tail": tail} if any(tail) else {}),
                                      **_choose(model, steps))
        else:
            logits, sections = [None] * len(steps), [None] * len(steps)
            decodes = [i for i, s in enumerate(steps) if isinstance(s, DecodeStep)]
            if decodes:
                rows = model.forward_batch([steps[i].engine.state for i in decodes],
                                           [blocks[i][0] for i in decodes],
                                           [positions[i] for i in decodes],
                                           **({"rope_offsets": [offsets[i] for i in decodes]}
                                              if any(offsets) else {}))
                for i, row in zip(decodes, rows):
                    logits[i] = row[None]
            for i, s in enumerate(steps):
                if isinstance(s, VerifyStep):
                    logits[i], sections[i] = model.forward_verify(
                        s.engine.state, torch.tensor(blocks[i], dtype=torch.long),
                        positions[i], **({"rope_offset": offsets[i]} if offsets[i] else {}))
    out = []
    for s, b, pos, rows, kept in zip(steps, blocks, positions, logits, sections):
        if isinstance(s, VerifyStep):
            s.engine._verified(b, pos, kept)
            out.append(rows)
        elif isinstance(s, TailStep):
            s.engine._tailed(b)
            out.append(rows)  # its HeadRow
        else:
            s.engine._decoded(b[0], pos)
            out.append(rows[0])
    return out


class Engine:
    def __init__(self, model: Model, *, window: int, prefix_chunk: int = 1024,
                 num_threads: int = 0):
        if window <= 0 or prefix_chunk <= 0:
            raise ValueError("window and prefix_chunk must be positive")
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        # Recorded: the same inputs on the same grid give the same bits only at one thread count.
        self.num_threads = torch.get_num_threads()
        self.model = model
        self.window = window
        self.prefix_chunk = prefix_chunk
        self.state = model.new_state(window)
        self.token_ids: list[int] = []
        # The lowest row written by decoding or by a prefill resumed off the grid (state from
        # it on is not a cold grid prefill's); None when none was.
        self.taint: int | None = None
        self.pending: PendingCommit | None = None
        # The rotary offset of a row forwarded past the rows in place as text: the images'
        # delta, a function of the rows' key ids (tandem.models.image_keys), so every copy of
        # the rows carries it. Set after each prefill and resume; decode keeps it.
        self.rope_delta = 0

    # -- the adapter interface (DESIGN.md) -------------------------------------------------

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def cache_state(self) -> CacheState:
        """The live buffers, with any pending commit landed first: a copy never sees the state
        from before a verify block."""
        self.settle()
        return CacheState(sections=self.state.sections, views=self.state.views)

    def settle(self) -> None:
        """Land a pending commit: the accepted position's sections become the state in place."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        with torch.inference_mode():
            for name, steps in pending.steps.items():
                self.state.sections[name].copy_(steps[pending.index])

    def trim_pending(self, n: int) -> bool:
        """Cut the rows back to ``n`` inside a pending commit (a generation that stopped part
        way through an accepted block). False when the state already absorbed rows past ``n``
        (settled, or a block before this one), which only a cache can undo."""
        if n == self.length:
            return True
        pending = self.pending
        if pending is None or not pending.start <= n < self.length:
            return False
        if n == pending.start:
            self.pending = None  # the sections in place are the state before the block
            self.taint = pending.taint_before
        else:
            pending.index = n - pending.start - 1
        rows_written(self.state.views, n)
        del self.token_ids[n:]
        return True

    def resume_at(self, n: int, token_ids: Sequence[int] | None = None, *,
                  taint: int | None | _Keep = KEEP) -> None:
        """Put the engine at length ``n`` after a copy of the state at ``n`` was written back.

        ``token_ids`` names the rows when they came from elsewhere; without it the rows in place
        are cut back to ``n`` (their recurrent state must have been restored by the caller).
        ``taint``: the lowest row of the restored rows that is not a cold grid prefill's (None:
        none is); left out, the taint of the rows in place is kept below ``n``. Outside this
        class, taint changes only here.
        """
        rows_written(self.state.views, n)  # a forward writes from n: borrowers above copy now
        if token_ids is None and n == self.length:
            self.settle()
        else:
            self.pending = None  # the caller wrote the sections of the rows at n
        if token_ids is not None:
            if len(token_ids) < n:
                raise ValueError(f"resume_at({n}) with only {len(token_ids)} token ids")
            self.token_ids = list(token_ids[:n])
        elif n > self.length:
            raise ValueError(f"resume_at({n}) past the {self.length} rows in place")
        else:
            del self.token_ids[n:]
        if n > self.window:
            raise ContextOverflow(n, self.window)
        if not isinstance(taint, _Keep):
            self.taint = taint
        if self.taint is not None and self.taint >= n:
            self.taint = None
        if n == 0:
            self.state.zero_()
        self.rope_delta = rope_delta(self.token_ids)

    def cost(self) -> Cost:
        return self.model.cost(self.window, self.prefix_chunk)

    def manifest(self) -> dict[str, str]:
        out = dict(self.model.manifest())
        out["prefix_chunk"] = str(self.prefix_chunk)
        out["num_threads"] = str(self.num_threads)
        return out

    def reset(self) -> None:
        self.resume_at(0)

    # -- forwarding ------------------------------------------------------------------------

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        return common_prefix(list(token_ids), self.token_ids)

    def prefill(self, token_ids: Sequence[int],
                on_chunk: Callable[[int], None] | None = None,
                scorer: PromptScorer | None = None) -> torch.Tensor:
        """``prefill_steps`` run to its end: the last position's logits."""
        return run_steps(self.prefill_steps(token_ids, on_chunk, scorer))

    def prefill_steps(self, token_ids: Sequence[int],
                      on_chunk: Callable[[int], None] | None = None,
                      scorer: PromptScorer | None = None, images: Any = None,
                      row: bool = False, batch_tail: bool | None = None
                      ) -> Generator["Step", torch.Tensor | None, "torch.Tensor | HeadRow"]:
        """Forward ``token_ids`` past the rows in place, on the grid; the last position's logits,
        or with ``row`` (and no scorer) where the model gives one, its `HeadRow`: the logits
        computed only when read, the greedy token through the head's screen without them.
        A generator: it yields `CHUNK` between chunks, where a scheduler may run other
        sequences' steps (tandem.actors.engine_actor) before it goes on.

        The rows in place must be a prefix of ``token_ids`` (a cache resumed the engine there);
        at least one token must be new, since the logits come from forwarding it.
        ``on_chunk(end)`` runs after each chunk, with the engine at length ``end``.
        ``scorer`` gets every forwarded position's logits (it needs the prefill from token 0).
        ``images`` (models/vision.py PromptImages of ``token_ids``, key ids: image_keys) gives
        each chunk its image rows and 3-D positions; without it, rows forwarded past the rows in
        place turn at their index plus ``rope_delta`` and none may be an image row.

        A tail of at most TAIL_ROWS tokens inside one grid cell, over rows already held to the
        greedy gate only (``taint`` at or below them), runs as decode runs those tokens
        (``forward_tail``, where the model has it): the bits decoding them one by one writes.
        With ``batch_tail`` (a bool: whether its greedy token is wanted alone) that tail is a
        `TailStep` yielded to the scheduler, which forwards it beside other sequences' decode
        steps (decode_batch), sent back the `HeadRow`: the same bits.
        """
        n = self.length
        if len(token_ids) > self.window:
            raise ContextOverflow(len(token_ids), self.window)
        if n >= len(token_ids):
            raise ValueError(f"prefill needs a new token: {n} rows in place, "
                             f"{len(token_ids)} in the prompt")
        if list(token_ids[:n]) != self.token_ids:
            raise ValueError("the rows in place are not a prefix of the prompt; resume_at first")
        self.settle()
        if n % self.prefix_chunk and (self.taint is None or self.taint > n):
            # Resumed off the grid (a prompt's end no token was decoded after, a copy at a
            # prompt's end): the chunk to the next line starts at n where a cold prefill's
            # starts at the line below, so every row, anchor and snapshot from n on holds the
            # greedy gate only. The one place for every resume path, since all prefill here.
            self.taint = n
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        fwd, extra = self._forwarded(ids, n, images)
        chunks = list(grid_chunks(n, len(token_ids), self.prefix_chunk))
        if (row and scorer is None and images is None and len(chunks) == 1
                and len(token_ids) - n <= TAIL_ROWS and self.taint is not None
                and self.taint <= n and hasattr(self.model, "forward_tail")):
            # A short tail where the rows already hold the greedy gate only (resumed at an end
            # anchor, or off the grid): forwarded as decode forwards its tokens, one native
            # step, the bits decoding them writes (a resumed turn's 4 new tokens: 2.0 ms on
            # tiny where the chunk's layer path took 5.9).
            if batch_tail is not None and self.model.takes_tail([self.state]):
                head = yield TailStep(self, tuple(fwd[n:].tolist()), greedy=batch_tail)
                if on_chunk is not None:
                    on_chunk(len(token_ids))
                return head
            with torch.inference_mode():
                logits = self.model.forward_tail(self.state, fwd[n:].tolist(), n,
                                                 rope_offset=self.rope_delta)
                if logits is not None:
                    self.token_ids.extend(ids[n:].tolist())
                    if on_chunk is not None:
                        on_chunk(len(token_ids))
                    return logits
        logits = None
        for start, end in chunks:
            if images is not None:
                extra = images.chunk(start, end)
            # Inference mode is a thread's setting: it is entered for each chunk and left
            # before the yield, so that what the scheduler runs between two chunks (another
            # sequence's end anchor, its copies) never runs in it.
            with torch.inference_mode():
                if scorer is None:
                    # Only the last chunk's logits are read: the others skip the head.
                    last = end == len(token_ids)
                    logits = self.model.forward(self.state, fwd[start:end], start,
                                                logits=("row" if row else True) if last
                                                else False, **extra)
                else:
                    logits = self.model.forward(
                        self.state, fwd[start:end], start,
                        on_logits=lambda first, rows, at=start: scorer.rows(at + first, rows),
                        **extra)
                    scorer.last(end - 1, logits)
                self.token_ids.extend(ids[start:end].tolist())
                if on_chunk is not None:
                    on_chunk(end)
            if end < len(token_ids):
                yield CHUNK
        if images is not None:
            self.rope_delta = images.delta
        return logits

    def tail(self, token_ids: Sequence[int]) -> HeadRow:
        """A `TailStep` forwarded alone: ``token_ids`` past the rows in place as decode runs
        them (``forward_tail``), the last position's `HeadRow`."""
        pos = self._verify_position(len(token_ids))
        with torch.inference_mode():
            head = self.model.forward_tail(self.state, list(token_ids), pos,
                                           rope_offset=self.rope_delta)
        if head is None:
            raise ModelError("this model's step does not run a prefill's tail")
        self._tailed(token_ids)
        return head

    def _tailed(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(int(t) for t in token_ids)

    def _forwarded(self, ids: torch.Tensor, n: int, images: Any) -> tuple[torch.Tensor, dict]:
        """The ids the model embeds (key ids back to the placeholder, whose rows the images
        replace) and the forward's rotary arguments, for a prefill from row ``n``."""
        if images is None:
            if bool((ids[n:] >= KEY_BASE).any()):
                raise ModelError("the prompt holds image rows without their images")
            return ids, ({"rope_offset": self.rope_delta} if self.rope_delta else {})
        support = getattr(self.model, "images", None)
        if support is None:
            raise ModelError("this model reads no images: it has no vision tower")
        return ids.masked_fill(ids >= KEY_BASE, support.image_token_id), {}

    def decode(self, token_id: int, greedy: bool = False) -> "torch.Tensor | Chosen":
        """Forward one generated token with the recurrent step; its row is tainted. Its
        position's logits, or with ``greedy`` where the model can (``chooses``), its greedy
        token alone (a `Chosen`, the token the logits' argmax gives)."""
        pos = self._decode_position()
        with torch.inference_mode():
            if greedy and getattr(self.model, "chooses", False):
                logits = self.model.forward_batch(
                    [self.state], [int(token_id)], [pos],
                    rope_offsets=[self.rope_delta] if self.rope_delta else None,
                    choose=[True])[0]
            else:
                logits = self.model.forward(self.state, torch.tensor([token_id]), pos,
                                            decode=True, **({"rope_offset": self.rope_delta}
                                                            if self.rope_delta else {}))
        self._decoded(token_id, pos)
        return logits

    def _decode_position(self) -> int:
        """Before a decode step: the pending commit landed, the row it writes."""
        self.settle()
        pos = self.length
        if pos >= self.window:
            raise ContextOverflow(pos + 1, self.window)
        return pos

    def _decoded(self, token_id: int, pos: int) -> None:
        self.token_ids.append(int(token_id))
        if self.taint is None:
            self.taint = pos

    def verify(self, token_ids: Sequence[int], greedy: bool = False) -> "torch.Tensor | list":
        """Forward a verify block (the last sampled token and the drafts) in one forward; every
        position's logits ``[n, vocab]``, or with ``greedy`` where the model can, a `Chosen`
        for each. The rows of the whole block are written and the commit is left pending at
        its last position until ``accept``, the next forward or ``settle``."""
        # the path a block takes in a batch, at B = 1: its bits alone are those in any batch
        return _ragged_batch(self.model, [VerifyStep(self, tuple(token_ids), greedy)])[0]

    def _verify_position(self, n: int) -> int:
        """Before a block of ``n`` tokens (a verify block, a prefill's tail): the pending
        commit landed, its first row."""
        self.settle()
        pos = self.length
        if pos + n > self.window:
            raise ContextOverflow(pos + n, self.window)
        return pos

    def _verified(self, token_ids: Sequence[int], pos: int,
                  steps: dict[str, torch.Tensor]) -> None:
        self.pending = PendingCommit(pos, steps, len(token_ids) - 1, self.taint)
        self.token_ids.extend(int(t) for t in token_ids)
        if self.taint is None:
            self.taint = pos

    def accept(self, count: int) -> None:
        """Keep the pending block's first ``count + 1`` positions (its first token and
        ``count`` drafts); the rows above are invalid and never read."""
        pending = self.pending
        if pending is None or not 0 <= count <= pending.index:
            raise ValueError(f"accept({count}) without a pending block that long")
        pending.index = count
        del self.token_ids[pending.start + count + 1:]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 **options: Any) -> GenerationResult:
        """``generate_steps`` run to its end, every decode step alone (its keyword options)."""
        return run_steps(self.generate_steps(prompt_ids, params, **options))

    def generate_steps(self, prompt_ids: Sequence[int], params: SamplingParams,
                       on_token: Callable[[int], bool] | None = None,
                       should_cancel: Callable[[], bool] | None = None,
                       on_chunk: Callable[[int], None] | None = None,
                       force: Callable[[list[int]], int | None] | None = None,
                       draft: Callable[[list[int], int], list[int]] | None = None,
                       draft_max: int = 0,
                       images: Any = None,
                       on_logprobs: Callable[[TokenLogprob], None] | None = None,
                       on_prompt_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
                       on_prefill: Callable[[torch.Tensor], None] | None = None,
                       logits: torch.Tensor | None = None,
                       stop_prefill: Callable[[], bool] | None = None,
                       grammar: "TokenGrammar | None" = None,
                       batch_tail: bool = False
                       ) -> Generator["Step", torch.Tensor | None, GenerationResult]:
        """Prefill the prompt (resuming over the rows in place it shares), then decode. A
        generator of `Step`s: `CHUNK` between prefill chunks, and a `DecodeStep` for each
        token to forward, which is sent back its logits (``run_steps`` forwards it alone,
        the engine actor's scheduler in a batch with other sequences' steps: the same bits).

        ``on_token(id)`` sees every generated token and returns True to stop there (a stop
        string); ``should_cancel()`` is polled between tokens; ``on_chunk`` as for prefill;
        ``force(out)`` may return the next token instead of the sampler (a reasoning budget's
        hidden close, a replay's recorded answer); a forced token still counts for stops.
        The last sampled token is never forwarded: the rows end one short of prompt + output,
        as every engine's do.

        ``draft(context, k)`` (speculation) proposes up to ``draft_max`` tokens to follow the
        context; they are checked in one verify block and the longest prefix the target agrees
        with is kept (greedy: the argmax; sampled: the speculative sampling rule, drawn so that
        a seed gives the tokens it gives without speculation), so the output is the target's.
        A generation that stops inside an accepted block leaves the rows ahead of its output in
        a pending commit (``trim_pending`` cuts them back).

        With ``params.logprobs``, ``on_logprobs(entry)`` sees each emitted token's entry just
        before ``on_token`` sees the token; the entry comes from the logits of the position
        that produced the token (a verify block's row for a draft it accepted), so speculation
        reports plain decoding's logprobs up to the verify forward's rounding (the hybrid's
        block runs decode's arithmetic but for the head's matmul: about 1e-6 apart on the test
        models; the third architecture's about 1e-5). A verify block is a `VerifyStep`, sent
        back its logits as a decode step is (batched beside other sequences' steps: the same
        bits as alone). With ``params.prompt_logprobs``,
        ``on_prompt_logprobs(entries)`` runs once after the prefill, before the first token.
        ``params.max_tokens`` 0 (echo without generation: a prompt's log-likelihood) forwards
        the prompt and samples nothing: no token, no draw, no forced token asked for, nothing
        pending; the rows end at the prompt's end as after max_tokens 1.

        ``on_prefill(logits)`` runs once the prompt is forwarded, before its first token is
        sampled, with the engine at the prompt's end and nothing pending (a cache keeps that
        state). ``logits``: the prompt's last position's logits when the rows in place already
        are the whole prompt (a cache restored its state there): nothing is forwarded and the
        first token is sampled from them (read, never written).

        ``images`` (tandem.cache.tower.ImagePlacer): the prompt's images, ``prompt_ids`` being
        its key ids (tandem.models.image_keys); placed once the resume is known, so the tower
        runs only for an image whose rows are forwarded. Decode turns at ``rope_delta``.

        ``stop_prefill()`` is polled between two prefill chunks (idle work that yields): True
        ends the generation there, "cancelled" with no token, the rows in place ending at the
        last chunk forwarded (its caller puts back whatever it stashed).

        ``grammar`` (tandem.grammar.TokenGrammar: structured outputs, a forced tool call) masks
        every sampled position after the logits processors, greedy and sampled, asked with the
        tokens before the position as the processors are; a verify block carries only the
        drafts it allows, and the generation stops ("stop") once the output completes it.

        ``batch_tail``: a short tail the prefill runs as decode is a `TailStep` for the
        scheduler to batch (``prefill_steps``); its greedy token screened in the step when
        nothing but the greedy token is read.
        """
        if len(prompt_ids) == 0:
            raise ModelError("the prompt is empty")
        if len(prompt_ids) > self.window:
            raise ContextOverflow(len(prompt_ids), self.window)
        if logits is not None and self.token_ids != list(prompt_ids):
            raise ValueError("initial logits need the whole prompt in place; resume_at first")
        # At least one token is forwarded, since the logits come from it, unless they are given.
        reuse = min(self.common_prefix(prompt_ids), len(prompt_ids) - (logits is None))
        if reuse < self.length:
            # Only the grid-aligned state of the rows in place is known; without a cache
            # holding a copy at ``reuse`` the engine starts again from token 0.
            reuse = 0
        scorer = None
        if params.prompt_logprobs is not None:
            # Every prompt position's logits are wanted, and the rows a cache resumed the
            # engine over were never forwarded here: the prompt runs cold, on the grid, over
            # rows of the same tokens (the anchors it passes are taken again, cold).
            reuse, logits = 0, None
            scorer = PromptScorer(torch.as_tensor(list(prompt_ids), dtype=torch.long),
                                  params.prompt_logprobs)
        self.resume_at(reuse)
        processors = LogitsProcessors.for_params(params)
        num_top = params.logprobs
        # A decode step that wants its greedy token alone: nothing reads its logits then.
        greedy_only = (params.greedy and processors is None and grammar is None
                       and num_top is None)
        t0 = time.perf_counter()
        if logits is None:
            placed = images.place(prompt_ids, reuse) if images is not None else None
            prefill = self.prefill_steps(prompt_ids, on_chunk=on_chunk, scorer=scorer,
                                         images=placed,
                                         row=getattr(self.model, "chooses", False),
                                         batch_tail=greedy_only if batch_tail else None)
            if stop_prefill is not None:
                prefill = _stoppable(prefill, stop_prefill)
            logits = yield from prefill
            if logits is None:  # stopped between two chunks
                return GenerationResult(token_ids=[], finish_reason="cancelled",
                                        prompt_tokens=len(prompt_ids), reused_tokens=reuse,
                                        prefill_ms=(time.perf_counter() - t0) * 1000,
                                        decode_ms=0.0, stop_token=None)
            if scorer is not None and on_prompt_logprobs is not None:
                on_prompt_logprobs(scorer.entries)
            if on_prefill is not None:
                on_prefill(logits)
        t1 = time.perf_counter()
        sampler = Sampler(params)
        out: list[int] = []
        context = list(prompt_ids)
        finish, stop_token = "length", None
        stops = set(params.stop_token_ids)
        drafted = accepted = 0
        logprobs: list[TokenLogprob] | None = None if num_top is None else []

        def scored(logits: torch.Tensor, token: int) -> TokenLogprob | None:
            return None if num_top is None else score(logits, token, num_top)

        def take(token: int, entry: TokenLogprob | None = None) -> bool:
            """Emit one token (``entry``: its logprobs); True when the generation ends with it."""
            nonlocal finish, stop_token
            if token in stops:
                finish, stop_token = "stop", token
                return True
            out.append(token)
            context.append(token)
            if entry is not None:
                logprobs.append(entry)
                if on_logprobs is not None:
                    on_logprobs(entry)
            if on_token is not None and on_token(token):
                finish = "stop"
                return True
            if grammar is not None and grammar.complete(out, len(out)):
                finish = "stop"
                return True
            return len(out) >= params.max_tokens

        def target(logits: torch.Tensor, so_far: list[int]) -> int:
            """The model's token at a position: forced, or drawn as without speculation.

            A draft is accepted when it is the token drawn here. For a drafter that proposes
            one token with certainty this is the speculative sampling rule (accepted with
            probability p(draft), otherwise a token from p without the draft, renormalised),
            drawn with one sample a position from the request's generator, in order: a seeded
            request writes the same tokens with speculation on as off. The logits processors
            see what precedes the position (the output, then the block's drafts before it),
            as they would without speculation."""
            forced = force(so_far) if force is not None else None
            if forced is not None:
                return forced
            if isinstance(logits, Chosen):  # a greedy-only step's token (DecodeStep.greedy)
                return logits.token
            if processors is not None:
                logits = processors(logits, so_far, len(out))
            if grammar is not None:
                return grammar.choose(logits, so_far, len(out), params.greedy, argmax, sampler)
            return sampler(logits)

        if isinstance(logits, HeadRow):  # the prompt's last position: its logits when read
            logits = logits.choose() if greedy_only else logits.logits()
        token = target(logits, out) if params.max_tokens > 0 else None
        entry = scored(logits, token) if token is not None else None
        k_floor = min(DRAFT_FLOOR, draft_max)
        k = k_floor
        rest = rest_len = 0  # tokens left to decode without drafting; the rest's next length
        while token is not None:
            if take(token, entry):
                break
            if should_cancel is not None and should_cancel():
                finish = "cancelled"
                break
            if self.length >= self.window:
                break
            # Drafts for the tokens still wanted after this one: the last token wanted is
            # sampled from the block's logits, never forwarded.
            room = min(self.window - self.length - 1, params.max_tokens - len(out) - 1, k)
            if rest > 0:
                rest -= 1
                drafts = []
            else:
                drafts = (list(draft(context, room))[:room] if draft is not None and room > 0
                          else [])
            if drafts and grammar is not None:
                drafts = drafts[:grammar.valid_prefix(out, len(out), drafts)]
            if not drafts:
                logits = yield DecodeStep(self, token, greedy_only)
                token = target(logits, out)
                entry = scored(logits, token)
                continue
            block = yield VerifyStep(self, tuple([token] + drafts), greedy_only)
            drafted += len(drafts)
            count, token = 0, None
            for i, proposal in enumerate(drafts):
                chosen = target(block[i], out + drafts[:i])
                if chosen != proposal:
                    token = chosen
                    break
                count += 1
            if token is None:  # every draft accepted: the block's last logits give one more
                token = target(block[len(drafts)], out + drafts)
            # Row i of the block produced the token after its i-th input: drafts[i] when
            # accepted, and the block's next token at row ``count``.
            draft_entries = [scored(block[i], d) for i, d in enumerate(drafts[:count])]
            entry = scored(block[count], token)
            self.accept(count)
            accepted += count
            # The draft length adapts: doubled after a block accepted whole, back to the
            # floor after a rejection, so a run of wrong drafts costs short blocks only.
            k = min(draft_max, 2 * k) if count == len(drafts) else k_floor
            if count == 0:
                rest_len = min(DRAFT_REST_MAX, max(1, 2 * rest_len))
                rest = rest_len
            else:
                rest_len = 0
            if any(take(d, e) for d, e in zip(drafts[:count], draft_entries)):
                break
        t2 = time.perf_counter()
        return GenerationResult(token_ids=out, finish_reason=finish, prompt_tokens=len(prompt_ids),
                                reused_tokens=reuse, prefill_ms=(t1 - t0) * 1000,
                                decode_ms=(t2 - t1) * 1000, stop_token=stop_token,
                                drafted=drafted, accepted=accepted, logprobs=logprobs,
                                prompt_logprobs=None if scorer is None else scorer.entries)
