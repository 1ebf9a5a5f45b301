"""What opencode sends back after a tool call: the assistant's message with its reasoning as
``reasoning_content`` and the call's arguments re-serialised compactly, then the tool's result."""

from __future__ import annotations

import json


def opencode_copy(msg, result: str) -> list[dict]:
    """The two messages opencode appends after ``msg`` (an SDK message with one tool call)."""
    call = msg.tool_calls[0]
    args = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    return [{"role": "assistant", "content": msg.content or "",
             "reasoning_content": msg.model_extra["reasoning_content"],
             "tool_calls": [{"id": call.id, "type": "function",
                             "function": {"name": call.function.name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}]
