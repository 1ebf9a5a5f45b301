"""Side requests: a chat client's requests about a chat that are not its turns (Open WebUI's
title, tags, follow-up suggestions, search queries, autocompletion).

Open WebUI sends each as one user message that holds the chat as text, its template opening
with ``### Task:``, so it is often longer than the chat itself and shares no row with it. Placed
as a turn, such a request would take the chat's slot (parallel = 1: too long to be a guest) or,
with every slot taken, displace the chat to the park; its snapshots would fill the state store.
Marked, it runs keeping nothing (tandem/cache/slots.py): the chat's rows, anchors and end anchor
stay, and its next turn resumes at its end. Its answer is the same tokens either way: it runs
cold or from a grid anchor on the same grid.

Only the last user message marks a request: a chat that quotes a task template in an earlier
message is still a chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TASK_MARK = "### Task:"


def is_side_request(messages: Sequence[Any]) -> bool:
    """Whether a chat request's last user message starts with Open WebUI's task mark (leading
    white space aside); its content a string or a list of text parts."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return _text_of(message.get("content")).lstrip().startswith(TASK_MARK)
    return False


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:  # the first text part: the template is the message's opening
            if isinstance(part, dict) and part.get("type") == "text" \
                    and isinstance(part.get("text"), str):
                return part["text"]
            if isinstance(part, str):
                return part
    return ""
