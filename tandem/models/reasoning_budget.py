"""A reasoning budget: when a generation thinks past ``max_reasoning_tokens`` the server closes
its reasoning with a hidden phrase and ``</think>``, and the answer goes on.

:class:`ReasoningBudget` is the ``force`` callable of ``Engine.generate``: ``force(out)`` is
asked before every token with the tokens generated so far (forced ones included) and returns
the token to write instead of sampling, or None. The prompt ends with ``<think>\\n``, so every
generated token before the first ``</think>`` is reasoning. Once ``max_reasoning_tokens`` of
them are written and no ``</think>`` is among them, it forces, one a call, the close phrase
(``close_ids``: hidden, never shown to the client), ``</think>`` and the tokens of ``"\\n\\n"``
(both structural, visible as the boundary between reasoning and answer), then returns None for
good and sampling resumes. A ``<tool_call>`` the model writes before any ``</think>`` ends the
reasoning as its ``</think>`` would (Qwen3.5 calls from inside an unclosed think block): the
budget then never forces, so no phrase lands inside the call. :attr:`hidden_positions` are the phrase's positions in ``out``, what
the end anchor records as a hidden span (:mod:`tandem.cache.endalign`).

Pure: no torch, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

CLOSE_PHRASE = "\n\nThe reasoning budget is spent; answering now.\n"
"""The hidden phrase; it ends in its own newline right before the visible ``</think>``."""

THINK_CLOSE_ID = 248069
"""``</think>`` in the Qwen3.5/3.6 vocabulary."""

CALL_OPEN_ID = 248058
"""``<tool_call>`` in the Qwen3.5/3.6 vocabulary."""

NEWLINES_IDS = (271,)
"""``"\\n\\n"`` in the Qwen3.5/3.6 vocabulary: what follows ``</think>`` before the answer."""


class _Encoder(Protocol):
    special_ids: dict[str, int]

    def encode(self, text: str, allow_special: bool = True) -> list[int]: ...


def default_close_ids(tokenizer: _Encoder, phrase: str = CLOSE_PHRASE) -> list[int]:
    """The hidden close phrase's token ids (ordinary text: no special token is made of it)."""
    return list(tokenizer.encode(phrase, allow_special=False))


class ReasoningBudget:
    """``force`` for ``Engine.generate``: closes the reasoning after ``max_reasoning_tokens``
    reasoning tokens (0: off, never forces). One instance serves one generation."""

    def __init__(self, max_reasoning_tokens: int, close_ids: Sequence[int],
                 think_close_id: int = THINK_CLOSE_ID,
                 after_close_ids: Sequence[int] = NEWLINES_IDS,
                 call_open_id: int | None = CALL_OPEN_ID) -> None:
        if max_reasoning_tokens < 0:
            raise ValueError("max_reasoning_tokens must be at least 0")
        self.max_reasoning_tokens = int(max_reasoning_tokens)
        self.close_ids = [int(t) for t in close_ids]
        self.think_close_id = int(think_close_id)
        self.after_close_ids = [int(t) for t in after_close_ids]
        self._ends = {self.think_close_id} | ({int(call_open_id)} if call_open_id is not None
                                              else set())
        self._sequence = self.close_ids + [self.think_close_id] + self.after_close_ids
        self._start: int | None = None   # where in out the forcing began
        self._scanned = 0                 # out[:_scanned] holds no </think>
        self._closed = False              # the model closed its reasoning itself
        self._done = False

    @classmethod
    def for_tokenizer(cls, tokenizer: _Encoder, max_reasoning_tokens: int,
                      phrase: str = CLOSE_PHRASE) -> ReasoningBudget:
        """A budget with the phrase, ``</think>`` and ``"\\n\\n"`` of ``tokenizer``."""
        close = tokenizer.special_ids.get("</think>", THINK_CLOSE_ID)
        return cls(max_reasoning_tokens, default_close_ids(tokenizer, phrase), close,
                   tokenizer.encode("\n\n", allow_special=False),
                   tokenizer.special_ids.get("<tool_call>"))

    @property
    def enabled(self) -> bool:
        return self.max_reasoning_tokens > 0

    @property
    def closed_by_budget(self) -> bool:
        """The budget closed this generation's reasoning (its forcing has begun)."""
        return self._start is not None

    @property
    def hidden_positions(self) -> list[int]:
        """Positions in ``out`` of the hidden phrase's tokens (those forced so far)."""
        if self._start is None:
            return []
        return list(range(self._start, self._start + len(self.close_ids)))

    @property
    def forced_positions(self) -> list[int]:
        """Every position the budget forced: the phrase, ``</think>`` and the newlines."""
        if self._start is None:
            return []
        return list(range(self._start, self._start + len(self._sequence)))

    def __call__(self, out: list[int]) -> int | None:
        return self.force(out)

    def force(self, out: list[int]) -> int | None:
        """The next token to write instead of sampling, or None."""
        if self._done or self.max_reasoning_tokens <= 0:
            return None
        if self._start is None:
            # a </think> (or a <tool_call>) the model wrote itself: never force
            if not self._ends.isdisjoint(out[self._scanned:]):
                self._closed = self._done = True
                return None
            self._scanned = len(out)
            if len(out) < self.max_reasoning_tokens:
                return None
            self._start = len(out)
        k = len(out) - self._start
        if k >= len(self._sequence):
            self._done = True
            return None
        return self._sequence[k]

    def visible(self, out: Sequence[int]) -> list[int]:
        """``out`` without the hidden phrase (what the client is shown)."""
        hidden = set(self.hidden_positions)
        if not hidden:
            return list(out)
        return [t for i, t in enumerate(out) if i not in hidden]
