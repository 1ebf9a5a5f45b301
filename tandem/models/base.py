"""The model adapter interface: the only way cache code reads a sequence.

A model names its recurrent *sections* (tensors whose whole content is the state after the last
token, e.g. ``gdn.S`` and ``gdn.conv``) and its position-indexed *views* (tensors with a token
axis, e.g. ``K`` and ``V``). A cache copies sections whole and views by rows along their token
axis; it never knows which model it holds (spec: "The caches know no model").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


class ModelError(ValueError):
    """A checkpoint or a request the model cannot take; the message names the problem."""


@dataclass(frozen=True)
class View:
    """A position-indexed buffer: ``tensor.select(token_axis, i)`` is row i of the sequence."""

    tensor: torch.Tensor
    token_axis: int

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor.narrow(self.token_axis, start, stop - start)


@dataclass(frozen=True)
class CacheState:
    """The live buffers of one sequence, in the state's order. Owned by the engine."""

    sections: dict[str, torch.Tensor]
    views: dict[str, View]

    def section_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sections.values())

    def row_nbytes(self) -> int:
        """Bytes of one token's rows over every view."""
        total = 0
        for view in self.views.values():
            t = view.tensor
            total += t.numel() // t.shape[view.token_axis] * t.element_size()
        return total


@dataclass(frozen=True)
class Cost:
    """What the budgets count, in bytes (spec: eng.cost())."""

    state_nbytes: int  # every section, whatever the length
    row_nbytes: int  # every view, one token
    workspace_floor_nbytes: int  # a prefill's transient memory: floor + per token, capped
    workspace_per_token_nbytes: int
    workspace_cap_nbytes: int
    # What grows with the context a chunk attends over, uncapped (the attention mask of a chunk
    # against every row so far): num_tokens is the prefill's context length.
    workspace_per_context_token_nbytes: int = 0

    def workspace_nbytes(self, num_tokens: int) -> int:
        return (min(self.workspace_cap_nbytes,
                    self.workspace_floor_nbytes + self.workspace_per_token_nbytes * num_tokens)
                + self.workspace_per_context_token_nbytes * num_tokens)

    def snapshot_nbytes(self, num_tokens: int) -> int:
        return self.state_nbytes + self.row_nbytes * num_tokens


@dataclass(frozen=True)
class Chosen:
    """A decode position's greedy token, found without its logits (``forward_batch``'s
    ``choose``): the first index of the largest logit, as the argmax of its logits gives it."""

    token: int


class HeadRow:
    """A prefill's last position before the head (``forward(logits="row")``): its normed hidden
    row [1, K]. Its logits (``logits()``: ``head(row)``, the very bits the prefill's head gives
    that row) are computed when first read; its greedy token (``choose()``) comes from the
    model's screen of the head where it has one (``screen(row)``: a `Chosen`, or None), without
    them. The prompt-end anchor keeps the row, K floats, rather than vocab of logits.

    A row and its copies (``with_row``, ``clone``: the anchor's, each resume's) share what the
    screen answered, kept with a copy of the row it answered for: a copy whose row holds
    those very bits takes the token without screening the head again (a prompt sent again
    resumes at its prompt-end anchor, and its first token cost a read of the screen, 3 to 4
    ms of a warm 16k-token repeat on tiny); a row that differs (a buffer written since)
    screens its own."""

    __slots__ = ("row", "_head", "_screen", "_logits", "_chosen")

    def __init__(self, row: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                 screen: Callable[[torch.Tensor], "Chosen | None"] | None = None,
                 chosen: list | None = None) -> None:
        self.row, self._head, self._screen = row, head, screen
        self._logits: torch.Tensor | None = None
        # [(the row's bits it answered for, the Chosen)], one box for a row and its copies
        self._chosen: list = chosen if chosen is not None else []

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._head(self.row)
        return self._logits

    def choose(self) -> "Chosen | torch.Tensor":
        """The greedy token as a `Chosen`, or the logits where the screen does not take the
        row (or the model has none)."""
        if self._logits is None and self._screen is not None:
            box = self._chosen
            if box and _same_bits(box[0][0], self.row):
                return box[0][1]
            chosen = self._screen(self.row)
            if chosen is not None:
                box[:] = [(self.row.clone(), chosen)]
                return chosen
        return self.logits()

    def with_row(self, row: torch.Tensor) -> "HeadRow":
        """The same head over another row tensor (a copy of this one's, in a cache's buffer),
        sharing what the screen answered (choose checks the bits)."""
        return HeadRow(row, self._head, self._screen, self._chosen)

    def clone(self) -> "HeadRow":
        return self.with_row(self.row.clone())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the very same bits (-0.0 is not 0.0, a NaN is itself)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def prompt_logits(x: "torch.Tensor | HeadRow") -> torch.Tensor:
    """A prefill's last logits, read: as they are, or a `HeadRow`'s, computed."""
    return x.logits() if isinstance(x, HeadRow) else x


@dataclass
class ModelState:
    """Buffers a model forwards into: sections and views, allocated once for ``window`` rows."""

    sections: dict[str, torch.Tensor]
    views: dict[str, View]
    extra: dict[str, object] = field(default_factory=dict)

    def zero_(self) -> None:
        for t in self.sections.values():
            t.zero_()


class Model(Protocol):
    """What the engine needs of a model. The hybrid adapter and the test-only third architecture
    both implement it; the engine and every cache are written against it alone."""

    model_type: str
    vocab_size: int
    dtype: torch.dtype

    def new_state(self, window: int) -> ModelState: ...

    def forward(self, state: ModelState, token_ids: torch.Tensor, start: int,
                decode: bool = False,
                on_logits: Callable[[int, torch.Tensor], None] | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """Forward ``token_ids`` at positions ``start..start+len`` over rows ``0..start`` already
        in ``state``; write their rows and advance the sections. Returns the last position's
        logits in fp32 ``[vocab]``. ``on_logits(i, rows)`` (prompt logprobs) gets the fp32
        logits of every other position, in order and in slices (``rows[j]`` is position
        ``start + i + j``); the last position's logits are computed as without it.
        ``logits=False`` without ``on_logits`` (a prefill chunk before the last) may skip the
        head and return None; the rows and sections are written as with it."""
        ...

    def forward_batch(self, states: list[ModelState], token_ids: list[int],
                      positions: list[int]) -> torch.Tensor:
        """One decode step for each of B independent sequences: ``token_ids[b]`` at position
        ``positions[b]`` of ``states[b]``, its row written and its sections advanced as
        ``forward(decode=True)`` would. Returns the fp32 logits ``[B, vocab]``; a sequence's
        row is the same bits as decoding it alone, at any place of any batch."""
        ...

    def forward_verify(self, state: ModelState, token_ids: torch.Tensor,
                       start: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A speculative verify block: write the rows of every position, leave the sections as
        they were, and return every position's logits ``[n, vocab]`` fp32 and, for each section,
        its value after every position ``[n, *section.shape]`` (the engine lands one).

        A model may also have ``forward_ragged`` (HybridModel's): decodes and verify blocks of
        several sequences in one forward; without it the engine batches the decodes and runs
        each block here, alone."""
        ...

    def cost(self, window: int) -> Cost: ...

    def manifest(self) -> dict[str, str]:
        """What computes the stored rows: names to digests (weights, config, code)."""
        ...


def digest_tensors(named: dict[str, torch.Tensor]) -> str:
    """A sha256 over names, shapes, dtypes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
