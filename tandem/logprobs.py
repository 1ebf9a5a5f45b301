"""Log probabilities of tokens, as OpenAI's ``logprobs`` / ``top_logprobs`` and vLLM report them.

A position's logprobs are ``log_softmax`` of the model's raw logits in float32: before the
logits processors (penalties, logit_bias), temperature, top-k and top-p, as vLLM's default
(``logprobs_mode`` raw_logprobs) reports them. They describe the model, not the sampler: a
sampled token may be one the top list does not hold, and a greedy request's token is the
first of its top list.

Entries are computed on the engine thread from logits the engine already has and hold only
what the response shows (the chosen token's logprob and the top few), never a vocabulary-wide
tensor: a prompt's logprobs (``echo``) are reduced one slice of positions at a time.
"""

from __future__ import annotations

import msgspec
import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs (vLLM's default max_logprobs)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the legacy completions' logprobs


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token at one position: its logprob and the ``top`` most probable tokens there
    ((token id, logprob) pairs, most probable first; ties in torch.topk's order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """``token_id``'s entry at the position whose logits ``[vocab]`` are given."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return TokenLogprob(token_id, float(logprobs[token_id]), _top(logprobs, num_top))


def score_rows(logits: torch.Tensor, token_ids: torch.Tensor,
               num_top: int) -> list[TokenLogprob]:
    """Entries of several positions at once: row i of ``logits`` ``[n, vocab]`` scores
    ``token_ids[i]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # the ids are the host's, the logits the device's (to() is the ids themselves on a CPU)
    index = token_ids.view(-1, 1).long().to(logprobs.device)
    chosen = logprobs.gather(1, index).view(-1).tolist()
    if num_top:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(t), lp, top)
            for t, lp, top in zip(token_ids.tolist(), chosen, tops)]


def _top(logprobs: torch.Tensor, num_top: int) -> tuple[tuple[int, float], ...]:
    if not num_top:
        return ()
    values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), values.tolist()))


class PromptScorer:
    """The logprobs of a prompt's tokens, gathered while the engine prefills it from token 0.

    Entry i scores prompt token i + 1 (token 0 has nothing before it: OpenAI's null). Each
    chunk's positions but the last reach ``rows`` in slices (the model's ``on_logits``), the
    chunk's last position through ``last`` (the logits the prefill returns), so the logits the
    first generated token is sampled from are computed exactly as without a scorer."""

    def __init__(self, token_ids: torch.Tensor, num_top: int) -> None:
        self.token_ids = token_ids
        self.num_top = num_top
        self.entries: list[TokenLogprob] = []

    def rows(self, first: int, logits: torch.Tensor) -> None:
        """Positions ``first..first + len(logits)``, which must follow the ones before."""
        assert first == len(self.entries), "prompt positions scored out of order"
        self.entries.extend(score_rows(logits, self.token_ids[first + 1:first + 1
                                                              + logits.shape[0]],
                                       self.num_top))

    def last(self, position: int, logits: torch.Tensor) -> None:
        """A chunk's last position; the prompt's own last one predicts no prompt token."""
        if position + 1 < len(self.token_ids):
            self.rows(position, logits.view(1, -1))
