"""The text forced mode makes the engine write: a recorded answer as the model wrote it.

The chat template renders an answer as ``<think>\\nREASONING\\n</think>\\n\\nCONTENT`` then its
tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks; the
generation prompt already holds what comes before the reasoning. So the forced text is the
template's rendering of the answer less the generation prompt, computed with the template
itself rather than copied here: a conversation followed by this answer renders, token for token,
as what the engine holds after writing it.
"""

from __future__ import annotations

from typing import Any

from tandem.models.chat import render_chat

_PROBE = [{"role": "user", "content": "."}]
_END = "<|im_end|>"


def answer_message(response: dict[str, Any]) -> dict[str, Any] | None:
    """The assistant message of a recorded response (reasoning, content, tool calls), or None
    when the row recorded no answer."""
    if not isinstance(response, dict):
        return None
    reasoning = response.get("reasoning")
    content = response.get("content")
    calls = response.get("tool_calls") or []
    if reasoning is None and content is None and not calls:
        return None
    msg: dict[str, Any] = {"role": "assistant", "content": content or "",
                           "reasoning_content": reasoning or ""}
    if calls:
        msg["tool_calls"] = calls
    return msg


def forced_text(message: dict[str, Any], *, enable_thinking: bool = True,
                template: str | None = None) -> str:
    """The text that, written after the generation prompt, makes the rows hold ``message`` (an
    assistant message) as the template renders it. ``<|im_end|>`` is not included: the server
    appends it to a forced output."""
    prompt = render_chat(_PROBE, add_generation_prompt=True, enable_thinking=enable_thinking,
                         template=template)
    msg = dict(message)
    if not enable_thinking:
        msg["reasoning_content"] = ""  # the prompt closed an empty think block already
    full = render_chat(_PROBE + [msg], add_generation_prompt=False, template=template)
    if not full.startswith(prompt):
        raise ValueError("the template does not render an answer after its generation prompt")
    text = full[len(prompt):]
    cut = text.rfind(_END)
    return text[:cut] if cut >= 0 else text


def next_answer(rows: list[dict[str, Any]], index: int) -> dict[str, Any] | None:
    """The answer to request ``rows[index]`` as a later request of the same conversation
    carries it: the assistant message that follows this request's messages in the first later
    request that extends them (for rows captured without a response)."""
    body = rows[index].get("body") or {}
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    n = len(messages)
    for row in rows[index + 1:]:
        later = (row.get("body") or {}).get("messages")
        if (isinstance(later, list) and len(later) > n and later[:n] == messages
                and isinstance(later[n], dict) and later[n].get("role") == "assistant"):
            return later[n]
    return None
