"""The ends: the end anchor (the state at the last row forwarded, spec: "The end anchor") and
the prompt-end anchor (the state a prompt's prefill left, with its last position's logits, or
where the model gives one its `HeadRow`: the normed row the logits come from, K floats rather
than vocab, its logits computed when a resume reads them, the same bits).

Each keeps one buffer that is refilled turn after turn, reserved once at its level. The
prompt-end anchor's rows are not copied: they are the rows in place [0, length), which decoding
only appends past; it is valid while no row under its length was written since (every path that
writes below a line calls ``drop_above``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.keep import End
from tandem.cache.memory import MemoryAccountant
from tandem.models.base import CacheState, HeadRow


@dataclass
class PromptEnd:
    token_ids: list[int]
    copy: SectionsCopy
    logits: torch.Tensor | HeadRow

    @property
    def length(self) -> int:
        return len(self.token_ids)


def _logits_nbytes(logits: torch.Tensor) -> int:
    return logits.numel() * logits.element_size()


def _tensor(logits: torch.Tensor | HeadRow) -> torch.Tensor:
    """What the buffer holds of a prompt's last position: its logits, or its HeadRow's row."""
    return logits.row if isinstance(logits, HeadRow) else logits


class Ends:
    def __init__(self, memory: MemoryAccountant, *, end_anchor: bool = True,
                 prompt_end_anchor: bool = True) -> None:
        self.memory = memory
        self.end_anchor = end_anchor
        self.prompt_end_anchor = prompt_end_anchor
        self.end: End | None = None
        self.buffer: SectionsCopy | None = None  # the end's, the same turn after turn
        self.prompt_end: PromptEnd | None = None
        self.prompt_buffer: tuple[SectionsCopy, torch.Tensor] | None = None
        self.kept = 0
        self.absorbed = 0
        self.prompt_kept = 0

    # -- the end anchor --------------------------------------------------------------------

    def at(self, n: int) -> bool:
        return self.end is not None and self.end.length == n

    def keep(self, length: int, state: CacheState) -> bool:
        """The state in place as the end at ``length``, in the end's buffer."""
        if self.end is not None:
            self.end.copy.copy_from(state)
        elif self.buffer is None:
            if not self.memory.reserve("end", SectionsCopy.nbytes_of(state)):
                return False
            self.buffer = SectionsCopy.take(state)
        else:
            self.buffer.copy_from(state)
        self.end = End(length, self.buffer)
        self.kept += 1
        return True

    def adopt_buffer(self, length: int, copy: SectionsCopy, state: CacheState) -> None:
        """A park's end comes back as the end at ``length``: its copy becomes the end's
        buffer when the end has none, else the state in place is copied into the buffer."""
        if self.buffer is None and self.memory.reserve("end", copy.nbytes):
            self.buffer = copy
        elif self.buffer is not None:
            self.buffer.copy_from(state)
        if self.buffer is not None:
            self.end = End(length, self.buffer)

    def drop_end(self) -> None:
        """The end goes, its buffer stays for the next turn."""
        self.end = None

    def release_end(self) -> None:
        self.end = None
        if self.buffer is not None:
            self.memory.release("end", self.buffer.nbytes)
            self.buffer = None

    # -- the prompt-end anchor -------------------------------------------------------------

    def keep_prompt_end(self, token_ids: list[int], state: CacheState,
                        logits: torch.Tensor | HeadRow) -> None:
        self.prompt_end = None  # a copy cut short is not the state at any prompt's end
        held = _tensor(logits)
        buffer = self.prompt_buffer
        if buffer is not None and (buffer[1].shape != held.shape
                                   or buffer[1].dtype != held.dtype):
            self.release_prompt_end()  # logits where a row was, or the other way round
            buffer = None
        if buffer is None:
            nbytes = SectionsCopy.nbytes_of(state) + _logits_nbytes(held)
            if not self.memory.reserve("prompt_end", nbytes):
                return
            buffer = self.prompt_buffer = (SectionsCopy.take(state), held.clone())
        else:
            buffer[0].copy_from(state)
            buffer[1].copy_(held)
        kept = logits.with_row(buffer[1]) if isinstance(logits, HeadRow) else buffer[1]
        self.prompt_end = PromptEnd(list(token_ids), buffer[0], kept)
        self.prompt_kept += 1

    def release_prompt_end(self) -> None:
        self.prompt_end = None
        if self.prompt_buffer is not None:
            copy, logits = self.prompt_buffer
            self.memory.release("prompt_end", copy.nbytes + _logits_nbytes(logits))
            self.prompt_buffer = None

    def check_invariants(self, token_ids: list[int], guest_active: bool) -> None:
        if self.end is not None and not guest_active:
            assert self.end.length <= len(token_ids), (self.end.length, len(token_ids))
            assert self.end.copy is self.buffer, "end outside its buffer"
        held = self.memory.held
        assert held["end"] == (self.buffer.nbytes if self.buffer else 0), "end bytes"
        buffer = self.prompt_buffer
        assert held["prompt_end"] == (0 if buffer is None else buffer[0].nbytes
                                      + _logits_nbytes(buffer[1])), "prompt_end bytes"
        pe = self.prompt_end
        if pe is not None:
            assert buffer is not None and pe.copy is buffer[0], "prompt_end outside its buffer"
            if not guest_active:
                assert token_ids[:pe.length] == pe.token_ids, "prompt_end rows moved"
