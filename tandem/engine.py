"""The engine: one sequence's buffers, prefill on the absolute grid, greedy and sampled decode.

The rows in place are ``token_ids[:length]``. A prefill forwards what follows them in chunks whose
ends are multiples of ``prefix_chunk`` counted from token 0 (the last chunk partial), so a prefill
resumed at a grid line runs exactly the shapes a cold one ran and writes the same bits (gate 1).
Rows written by decoding are marked by ``taint``: state above it is held to the greedy gate.

Only the engine actor calls an Engine; it is synchronous and owns every buffer it allocates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tandem.models.base import CacheState, Cost, Model, ModelError
from tandem.tokens import common_prefix


class ContextOverflow(ModelError):
    """A prompt longer than the window; carries both counts for the API's 400."""

    def __init__(self, num_tokens: int, window: int):
        super().__init__(f"the prompt has {num_tokens} tokens and the window holds {window}")
        self.num_tokens = num_tokens
        self.window = window


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    reused_tokens: int  # rows in place the prefill resumed at
    prefill_ms: float
    decode_ms: float
    stop_token: int | None = None
    timings: dict = field(default_factory=dict)

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


class Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


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
        self.taint: int | None = None  # lowest row written by decoding, None when none was

    # -- the adapter interface (DESIGN.md) -------------------------------------------------

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def cache_state(self) -> CacheState:
        return CacheState(sections=self.state.sections, views=self.state.views)

    def settle(self) -> None:
        """Land a pending commit before a copy. Without speculation nothing is ever pending."""

    def resume_at(self, n: int, token_ids: Sequence[int] | None = None) -> None:
        """Put the engine at length ``n`` after a copy of the state at ``n`` was written back.

        ``token_ids`` names the rows when they came from elsewhere; without it the rows in place
        are cut back to ``n`` (their recurrent state must have been restored by the caller).
        """
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
        if self.taint is not None and self.taint >= n:
            self.taint = None
        if n == 0:
            self.state.zero_()

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
                on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward ``token_ids`` past the rows in place, on the grid; the last position's logits.

        The rows in place must be a prefix of ``token_ids`` (a cache resumed the engine there);
        at least one token must be new, since the logits come from forwarding it.
        ``on_chunk(end)`` runs after each chunk, with the engine at length ``end``.
        """
        n = self.length
        if len(token_ids) > self.window:
            raise ContextOverflow(len(token_ids), self.window)
        if n >= len(token_ids):
            raise ValueError(f"prefill needs a new token: {n} rows in place, "
                             f"{len(token_ids)} in the prompt")
        if list(token_ids[:n]) != self.token_ids:
            raise ValueError("the rows in place are not a prefix of the prompt; resume_at first")
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        logits = None
        with torch.inference_mode():
            for start, end in grid_chunks(n, len(token_ids), self.prefix_chunk):
                logits = self.model.forward(self.state, ids[start:end], start)
                self.token_ids.extend(int(t) for t in ids[start:end])
                if on_chunk is not None:
                    on_chunk(end)
        return logits

    def decode(self, token_id: int) -> torch.Tensor:
        """Forward one generated token with the recurrent step; its row is tainted."""
        pos = self.length
        if pos >= self.window:
            raise ContextOverflow(pos + 1, self.window)
        with torch.inference_mode():
            logits = self.model.forward(self.state, torch.tensor([token_id]), pos, decode=True)
        self.token_ids.append(int(token_id))
        if self.taint is None:
            self.taint = pos
        return logits

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_token: Callable[[int], bool] | None = None,
                 should_cancel: Callable[[], bool] | None = None,
                 on_chunk: Callable[[int], None] | None = None,
                 force: Callable[[list[int]], int | None] | None = None) -> GenerationResult:
        """Prefill the prompt (resuming over the rows in place it shares), then decode.

        ``on_token(id)`` sees every generated token and returns True to stop there (a stop
        string); ``should_cancel()`` is polled between tokens; ``on_chunk`` as for prefill;
        ``force(out)`` may return the next token instead of the sampler (a reasoning budget's
        hidden close, a replay's recorded answer); a forced token still counts for stops.
        The last sampled token is never forwarded: the rows end one short of prompt + output,
        as every engine's do.
        """
        if len(prompt_ids) == 0:
            raise ModelError("the prompt is empty")
        if len(prompt_ids) > self.window:
            raise ContextOverflow(len(prompt_ids), self.window)
        reuse = min(self.common_prefix(prompt_ids), len(prompt_ids) - 1)
        if reuse < self.length:
            # Only the grid-aligned state of the rows in place is known; without a cache
            # holding a copy at ``reuse`` the engine starts again from token 0.
            reuse = 0
        self.resume_at(reuse)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, on_chunk=on_chunk)
        t1 = time.perf_counter()
        sampler = Sampler(params)
        out: list[int] = []
        finish, stop_token = "length", None
        stops = set(params.stop_token_ids)
        while len(out) < params.max_tokens:
            forced = force(out) if force is not None else None
            token = sampler(logits) if forced is None else forced
            if token in stops:
                finish, stop_token = "stop", token
                break
            out.append(token)
            if on_token is not None and on_token(token):
                finish = "stop"
                break
            if len(out) >= params.max_tokens:
                break
            if should_cancel is not None and should_cancel():
                finish = "cancelled"
                break
            if self.length >= self.window:
                break
            logits = self.decode(token)
        t2 = time.perf_counter()
        return GenerationResult(token_ids=out, finish_reason=finish, prompt_tokens=len(prompt_ids),
                                reused_tokens=reuse, prefill_ms=(t1 - t0) * 1000,
                                decode_ms=(t2 - t1) * 1000, stop_token=stop_token)
