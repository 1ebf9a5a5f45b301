"""Grammar-constrained decoding (structured outputs, forced tool calls) through llguidance.

Two halves:

- the tokenizer bridge, :func:`ll_tokenizer`: llguidance's view of a tandem Tokenizer (each
  token's bytes; the added tokens, ``<|im_end|>``, ``<think>``, ``<tool_call>``, as special
  tokens that no text can spell, written ``<[id]>`` in a grammar), built once per tokenizer
  (about 0.7 s for the 248k Qwen vocabulary) and shared by every matcher;
- :class:`TokenGrammar`: one generation's matcher, the ``grammar`` option of
  ``Engine.generate_steps``. It is asked for the token at each position with the output before
  it (``so_far``, of which ``committed`` tokens are the generation's: the rest are a verify
  block's drafts), as the logits processors are, so that a position's mask depends only on the
  tokens before it and speculation gives the tokens plain decoding gives.

Why llguidance and not xgrammar: its wheel is abi3 with no torch dependency (xgrammar's pins
torch versions), it computes a 248k-vocabulary mask in tens of microseconds without a
precomputed per-token cache, it checks a draft (``validate_tokens``) and rolls back
(``rollback``) as speculation needs, and its Lark dialect embeds JSON schemas (``%json``) and
special tokens, which a tool call in the model's own format needs.

All of it runs on the engine thread (the matcher) or a worker thread (compiling a grammar to
check it); nothing here touches the event loop.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tandem.models.base import ModelError

try:
    import llguidance as llg
except ImportError:  # a tree installed without it: structured outputs are refused, not a crash
    llg = None


# Up to this many candidate ids (32 a mask word that allows any) greedy takes the masked argmax
# over the allowed ids alone, not over a masked copy of every logit.
FEW_ALLOWED = 16384


class GrammarError(ValueError):
    """A grammar the library cannot compile (a bad JSON schema); the API's 400."""


_LOCK = threading.Lock()
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def available() -> bool:
    return llg is not None


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for a tandem Tokenizer, built once (under a lock: worker threads
    and the engine thread ask for it) and kept as long as the tokenizer lives."""
    if llg is None:
        raise GrammarError("structured outputs need the llguidance package")
    with _LOCK:
        found = _TOKENIZERS.get(tokenizer)
        if found is None:
            found = _build(tokenizer)
            _TOKENIZERS[tokenizer] = found
        return found


def _build(tokenizer: Any) -> Any:
    tokens = []
    for i in range(tokenizer.vocab_size):
        data = tokenizer.token_bytes(i)
        if data is None:  # not byte-level: the piece's UTF-8, as Tokenizer.max_token_bytes
            try:
                data = tokenizer.id_to_piece(i).encode()
            except ModelError:
                data = b""
        tokens.append(data)

    class _Wrapper:
        # What llguidance.TokenizerWrapper reads. Every added token is special: the grammar
        # names it by id, and text (a JSON string, the reasoning) can never become one.
        eos_token_id = tokenizer.eos_ids[0]
        bos_token_id = None
        special_token_ids = sorted(set(tokenizer.special_ids.values()))

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes | str) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode(text, allow_special=False)

    # No slices (llguidance's precomputed token classes for the lexer's common patterns): at
    # Qwen's 248k tokens they took half the build, which holds the GIL throughout (the event
    # loop stood still 1.2 s under the first structured request, 0.6 s without them), and 47
    # of its 84 MiB; a mask inside a JSON string then costs some 150 us instead of 20, against
    # a decode step of 15 ms on tiny.
    return llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper()), n_vocab=tokenizer.vocab_size,
                           eos_token=list(tokenizer.eos_ids), slices=[])


def from_lark(lark: str) -> str:
    """The grammar (llguidance's serialised form, what GenerationParams carries) of a Lark
    text; not checked yet (:func:`check`)."""
    if llg is None:
        raise GrammarError("structured outputs need the llguidance package")
    return llg.LLMatcher.grammar_from_lark(lark)


def check(grammar: str, tokenizer: Any) -> None:
    """Raise GrammarError when the grammar does not compile for this tokenizer (its JSON
    schemas included). Milliseconds for a schema; call it off the event loop."""
    message = llg.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if message:
        raise GrammarError(message)


class TokenGrammar:
    """One generation's grammar: which tokens may come next, given the output so far.

    The matcher holds ``_fed``, the tokens it consumed; a call for ``so_far`` rolls it back to
    their common prefix and consumes the rest. Only the tail past ``_sure`` (the tokens known
    to be committed output) is compared, so a call costs the length of a verify block, not of
    the output. A token the grammar refuses (a forced one: a reasoning budget's phrase, which
    the grammars built here allow) breaks the matcher; the generation then ends (``complete``).
    """

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        lt = ll_tokenizer(tokenizer)
        self._matcher = llg.LLMatcher(lt, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self.vocab_size = lt.vocab_size
        self._words = np.full((self.vocab_size + 31) // 32, -1, dtype=np.int32)
        self._fed: list[int] = []
        self._sure = 0
        self.broken = False
        self.masks = 0  # full masks computed (a greedy position whose argmax passes needs none)

    def _sync(self, so_far: Sequence[int], committed: int) -> None:
        fed, n = self._fed, self._sure
        limit = min(len(fed), len(so_far))
        while n < limit and fed[n] == so_far[n]:
            n += 1
        if n < len(fed):
            self._matcher.rollback(len(fed) - n)
            del fed[n:]
        if len(so_far) > n and not self.broken:
            rest = [int(t) for t in so_far[n:]]
            if self._matcher.consume_tokens(rest):
                fed.extend(rest)
            else:
                self.broken = True
        self._sure = min(committed, len(fed))

    def allows(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and self._matcher.validate_tokens([token]) == 1

    def _fill(self) -> np.ndarray:
        """The next position's mask words (bit i of word w: token 32 w + i allowed)."""
        self.masks += 1
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return words

    def refused(self, size: int, device: torch.device,
                words: np.ndarray | None = None) -> torch.Tensor:
        """The tokens the next position may not take, over ``size`` logits (ids past the
        tokenizer's vocabulary, a model's padding rows, always refused). About 50 us on a CPU
        for the 248k vocabulary, the matcher's mask a few of them."""
        words = self._fill() if words is None else words
        n = min(size, self.vocab_size)
        bits = np.unpackbits((~words).view(np.uint8), bitorder="little")[:n]
        mask = torch.ones(size, dtype=torch.bool)
        mask[:n] = torch.from_numpy(bits.view(np.bool_))
        return mask.to(device)

    def choose(self, logits: torch.Tensor, so_far: Sequence[int], committed: int,
               greedy: bool, argmax: Callable[[torch.Tensor], int],
               sample: Callable[[torch.Tensor], int]) -> int:
        """The token at the position after ``so_far``: the sampler's over the allowed tokens.
        Greedy asks the grammar about the raw argmax first: allowed, it is the masked argmax
        too (the first largest logit among the allowed), and no mask is computed; refused, the
        argmax is taken over the allowed ids alone when they are few."""
        self._sync(so_far, committed)
        if self.broken:
            return sample(logits)
        if greedy:
            token = argmax(logits)
            if self.allows(token):
                return token
            words = self._fill()
            few = self._few_allowed(words, logits.shape[-1])
            if few is not None and len(few):
                # The masked argmax over the allowed ids alone, ascending: the first largest
                # among them is the first largest of the masked logits (a NaN the largest).
                return int(few[argmax(logits[torch.from_numpy(few).to(logits.device)])])
        else:
            words = self._fill()
        masked = logits.masked_fill(self.refused(logits.shape[-1], logits.device, words),
                                    float("-inf"))
        return sample(masked)

    def _few_allowed(self, words: np.ndarray, size: int) -> np.ndarray | None:
        """The allowed ids, ascending, when they lie in few mask words (a JSON position allows
        a few hundred tokens of 248k): reading those words costs microseconds where a masked
        copy of every logit costs a hundred. None when they are many (free text)."""
        at = np.flatnonzero(words)
        if len(at) * 32 > FEW_ALLOWED:
            return None
        bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(-1, 32)
        ids = (at[:, None] * 32 + np.arange(32)[None, :])[bits.astype(bool)]
        return ids[ids < min(size, self.vocab_size)]

    def valid_prefix(self, so_far: Sequence[int], committed: int,
                     drafts: Sequence[int]) -> int:
        """How many of the drafts after ``so_far`` the grammar takes, in order: a verify block
        never carries a draft the grammar refuses (it could not be accepted)."""
        self._sync(so_far, committed)
        if self.broken or not drafts:
            return 0 if self.broken else len(drafts)
        return self._matcher.validate_tokens([int(t) for t in drafts])

    def complete(self, so_far: Sequence[int], committed: int) -> bool:
        """Whether the output so far ends the grammar: nothing but an end token may follow
        (or the grammar broke), so the generation stops there."""
        self._sync(so_far, committed)
        return self.broken or self._matcher.is_stopped()
