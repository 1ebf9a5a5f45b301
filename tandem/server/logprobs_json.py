"""Logprobs in the responses' shapes, as OpenAI and vLLM write them.

Chat: ``choices[0].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}], "refusal": null}``, one entry a generated token (reasoning included, as
vLLM reports every output token), streamed with the chunk that follows the token.

Completions (the legacy shape): ``choices[0].logprobs = {tokens, token_logprobs, top_logprobs,
text_offset}``; ``top_logprobs`` maps token text to logprob, the chosen token always among them
(OpenAI: up to logprobs + 1 entries); with ``echo`` the prompt's tokens come first, the first
with null logprobs. ``text_offset`` counts characters of the tokens' texts from the start of
the returned text, as vLLM counts them.

A token's text is its own decode (bytes that are not whole UTF-8 become U+FFFD); ``bytes`` are
the bytes it stands for, so a client can join split characters back.
"""

from __future__ import annotations

from typing import Any

from tandem.logprobs import TokenLogprob
from tandem.models.tokenizer import Tokenizer


class LogprobsWriter:
    """Turns entries into response JSON for one request, with the text offset it has reached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text_offset = 0
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _bytes(self, token_id: int) -> list[int]:
        data = self.tokenizer.token_bytes(token_id)
        return list(data if data is not None else self.text(token_id).encode())

    # -- chat ------------------------------------------------------------------------------

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        return {"token": self.text(e.token_id), "logprob": e.logprob,
                "bytes": self._bytes(e.token_id),
                "top_logprobs": [{"token": self.text(t), "logprob": lp, "bytes": self._bytes(t)}
                                 for t, lp in e.top]}

    # -- completions -----------------------------------------------------------------------

    def completion(self, token_ids: list[int],
                   entries: list[TokenLogprob | None]) -> dict[str, Any]:
        """The legacy object of ``token_ids`` (each with its entry, None for the prompt's
        first token), its offsets continuing from the tokens written before."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, e in zip(token_ids, entries, strict=True):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            if e is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(e.logprob)
            top: dict[str, float] = {}
            for t, lp in e.top:
                top.setdefault(self.text(t), lp)
            top.setdefault(text, e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
