"""A client's compaction request served as the continuation of its conversation (spec:
"Compaction as a continuation").

opencode's ``/compact`` (and its automatic compaction) sends its compaction agent's system text
and ONE user message holding the whole history as text ("Here is the conversation so far:
<conversation> [User]: ... [Tool result]: ... </conversation>" and the summary instructions).
That text shares no token with the rows the engine read, so served as sent it prefills cold:
tens of thousands of tokens while the conversation sits resident.

Served as a continuation, the prompt is the session's rows up to the end anchor of its last
generation (the engine's record, tandem/actors/engine_compaction.py: in a slot, in the park or
in its spill entry), then ONE user turn holding the client's system text and its instructions,
rendered by the model's own template with thinking off. The plan resumes at the end anchor (in
place, the park's swap or the spill's read) and forwards only that turn.

The parts, each a pure function here:

- :func:`compaction_request`: the request's shape, not one client's words: no tools; system
  text that asks for a summary (:data:`SUMMARY_WORDS`); then exactly one user message holding
  the conversation as text, a ``<conversation>``-like block or role-marked lines (``user:``,
  ``[User]:``, ``assistant:``, ``[Tool result]:``); the instructions are the text after the
  history (when the history is not a block, the last paragraph if it is not a role's line; else
  the text before it);
- :func:`turn_after_answer`: the separator between an answer's end and a new user turn, read off
  the template itself (a short conversation rendered with an answer and then a user turn: what
  follows the answer), never a model's markers written here;
- :func:`guard`: the record is this conversation: the first and the last user lines of the
  client's history are in the record's text (whitespace normalised); any miss serves the request
  as sent;
- :func:`build_continuation`: the record's tokens and the turn, joined where the record's end
  already holds the start of the answer's close.

Usage: ``prompt_tokens`` is the client's prompt (its own rendering, tokenised), ``cached_tokens``
that less what was forwarded, and the source ``continuation`` when the prefill resumed at the
record's end (tandem.server.generation.Run).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.actors.compaction_messages import FindSessionRecord, RecordWhere, SessionRecord
from tandem.actors.runtime import ActorStopped
from tandem.actors.engine_messages import PromptMarks
from tandem.models.chat import ChatError, render_prompt, turn_starts

CompactionMode = Literal["continue", "client"]
# Why a compaction request was served as the client sent it.
MissWhy = Literal["no_session", "no_record", "guard", "images", "window", "template"]

SUMMARY_WORDS = re.compile(
    r"\b(summar(?:y|ies|i[sz](?:e|es|ed|ing|ation))|recap\w*|condens\w*|compact\w*)\b", re.I)
"""What a compaction agent's system text asks for (English; a small vocabulary, not a client's
exact words)."""

_ROLES = (r"user|human|assistant|ai|model|system|developer|tool(?:[ \t]+(?:result|call|output"
          r"|response)s?)?|function(?:[ \t]+result)?")
ROLE_LINE = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]*)?(?:\*\*)?\[?(?P<role>" + _ROLES + r")\]?(?:\*\*)?[ \t]*:"
    r"(?:\*\*)?[ \t]*(?P<text>.*)$", re.I | re.M)
"""A role-marked line of a history written as text: ``user: ...``, ``[User]: ...``,
``USER: ...``, ``### Assistant: ...``, ``[Tool result]: ...``."""
BLOCK = re.compile(r"<(?P<tag>conversation|chat_history|history|transcript)>(?P<body>.*?)"
                   r"</(?P=tag)>", re.I | re.S)
_USER = ("user", "human")
_ELLIPSIS = ("...", "\u2026")
SENTINEL = "tandemanswerendsherexq"  # ASCII letters: no template filter changes them


@dataclass(frozen=True)
class CompactionAsk:
    """A compaction request's parts: ``system`` the client's system text, ``history`` the
    conversation as the client wrote it, ``instructions`` the text after it (or, failing that,
    before it), ``user_lines`` the first line of each user message of the history, whitespace
    normalised; ``images``: the user message holds a part that is not text."""

    system: str
    history: str
    instructions: str
    user_lines: tuple[str, ...]
    images: bool = False

    def turn_text(self) -> str:
        """The new user turn: the system text, then the instructions."""
        parts = [p for p in (self.system.strip(), self.instructions.strip()) if p]
        return "\n\n".join(parts)


def normalise(text: str) -> str:
    return " ".join(text.split())


def compaction_request(messages: Sequence[Any], tools: Sequence[Any] | None
                       ) -> CompactionAsk | None:
    """The parts of a compaction request, or None when the request is not one."""
    if tools or not isinstance(messages, Sequence) or len(messages) < 2:
        return None
    if not all(isinstance(m, Mapping) for m in messages):
        return None
    *systems, user = messages
    if user.get("role") != "user" or not all(
            m.get("role") in ("system", "developer") for m in systems):
        return None
    system = "\n\n".join(_text(m.get("content"))[0] for m in systems)
    if not SUMMARY_WORDS.search(system):
        return None
    text, images = _text(user.get("content"))
    block = BLOCK.search(text)
    if block is not None:
        history = block.group("body")
        before, after = text[:block.start()], text[block.end():]
    else:
        lines = list(ROLE_LINE.finditer(text))
        if len(lines) < 2:
            return None
        before, history, after = text[:lines[0].start()], text[lines[0].start():], ""
        # Without a block the history's end is a guess: a last paragraph that is not a role's
        # line reads as the instructions.
        paragraphs = re.split(r"\n[ \t]*\n", history.rstrip())
        if len(paragraphs) > 1 and not ROLE_LINE.match(paragraphs[-1].lstrip("\n")):
            after = paragraphs[-1]
            history = history.rstrip()[:-len(paragraphs[-1])]
    users = tuple(line for line in _user_lines(history) if line)
    if not users:
        return None
    instructions = after.strip() or before.strip()
    return CompactionAsk(system, history, instructions, users, images)


def _user_lines(history: str) -> list[str]:
    """The first line of each user message of a history written as text (the line after the
    marker when the marker stands alone), normalised, a trailing ellipsis cut."""
    out = []
    for m in ROLE_LINE.finditer(history):
        if m.group("role").lower() not in _USER:
            continue
        line = m.group("text")
        if not line.strip():
            rest = history[m.end():].lstrip("\n")
            line = rest.split("\n", 1)[0]
            if ROLE_LINE.match(line):
                continue  # an empty message
        line = normalise(line)
        for e in _ELLIPSIS:
            if line.endswith(e):
                line = line[:-len(e)].rstrip()
        out.append(line)
    return out


def _text(content: Any) -> tuple[str, bool]:
    """A message's text and whether it holds a part that is not text (an image)."""
    if isinstance(content, str):
        return content, False
    if not isinstance(content, list):
        return "", False
    texts, other = [], False
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            other = True
    return "".join(texts), other


def guard(ask: CompactionAsk, record_text: str) -> bool:
    """Whether the record is this conversation: its first and last user lines are in it."""
    text = normalise(record_text)
    return ask.user_lines[0] in text and ask.user_lines[-1] in text


def turn_after_answer(content: str, tokenizer: Any, template: str | None
                      ) -> tuple[list[int], int]:
    """The ids that follow an answer's last token when a user turn holding ``content`` comes
    next, with the generation prompt, thinking off: the template's own, read off a short
    conversation rendered with an answer and then that turn. Also how many of them close the
    answer (the same conversation without the turn, after the answer). Raises ChatError."""
    base = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}]
    controls = tokenizer.control_tokens
    closed = render_prompt(base, None, add_generation_prompt=False, enable_thinking=False,
                           template=template, preserve_thinking=None,
                           control_tokens=controls).after(SENTINEL)
    turn = render_prompt(base + [{"role": "user", "content": content}], None,
                         add_generation_prompt=True, enable_thinking=False, template=template,
                         preserve_thinking=None, control_tokens=controls).after(SENTINEL)
    if closed is None or turn is None or not turn.text.startswith(closed.text):
        raise ChatError("the chat template renders no turn after an answer")
    return turn.encode(tokenizer), len(closed.encode(tokenizer))


def join_turn(record: Sequence[int], turn: Sequence[int], closing: int) -> list[int]:
    """The record's tokens, then the turn's, less the start of the answer's close that the
    record's end already holds (the rows end one short of a generation's last sampled token,
    so a stop token is never in them; a forced one may be)."""
    record, turn = list(record), list(turn)
    for k in range(min(closing, len(record)), 0, -1):
        if record[-k:] == turn[:k]:
            return record + turn[k:]
    return record + turn


@dataclass(frozen=True)
class Continuation:
    """A compaction request's prompt as a continuation: ``prompt_ids`` the record's tokens and
    the new turn's; ``record_tokens`` where the plan resumes (the record's end);
    ``turn_tokens`` what it forwards there; ``where`` the copy that held the record."""

    prompt_ids: list[int]
    record_tokens: int
    turn_tokens: int
    where: RecordWhere
    marks: PromptMarks


def build_continuation(ask: CompactionAsk, record: Sequence[int], where: RecordWhere,
                       tokenizer: Any, template: str | None) -> Continuation:
    """The continuation's prompt over the record (raises ChatError when the template renders
    no turn after an answer)."""
    turn, closing = turn_after_answer(ask.turn_text(), tokenizer, template)
    ids = join_turn(record, turn, closing)
    users = turn_starts(ids, tokenizer, "user")
    answers = turn_starts(ids, tokenizer, "assistant")
    last_user = users[-1] if users else None
    first_answer = next((i for i in answers if last_user is not None and i < last_user), None)
    return Continuation(ids, len(record), len(ids) - len(record), where,
                        PromptMarks(first_of_session=False, last_user_start=last_user,
                                    head_stop=first_answer))


def continuation_ids(tokenizer: Any, template: str | None, rows: Sequence[int],
                     system_text: str, instructions: str) -> list[int]:
    """The continuation's prompt ids over ``rows`` (a conversation up to its end anchor) with
    this system text and these instructions: the route's own build, which the compaction
    preparer writes its summary ahead with, so that a later request's prompt is the very one
    the summary was written for."""
    ask = CompactionAsk(system_text, "", instructions, ())
    return build_continuation(ask, rows, "slot", tokenizer, template).prompt_ids


@dataclass
class CompactionCounts:
    """The ``compaction`` section of /v1/cache/stats: requests recognised as compactions, those
    sent as continuations and those of them the engine resumed at the record's end, those served
    as sent by the knob (``client``) or by a miss of the guard (by why), and the tokens the
    continuations did not forward against the client's prompts."""

    mode: CompactionMode = "continue"
    recognised: int = 0
    continuations: int = 0
    resumed: int = 0
    client: int = 0
    guard_misses: dict[str, int] = field(default_factory=dict)
    client_prompt_tokens: int = 0
    forwarded_tokens: int = 0

    def missed(self, why: MissWhy) -> None:
        self.guard_misses[why] = self.guard_misses.get(why, 0) + 1

    def ran(self, resumed: bool, client_prompt_tokens: int, forwarded: int) -> None:
        self.resumed += resumed
        self.client_prompt_tokens += client_prompt_tokens
        self.forwarded_tokens += forwarded

    def statistics(self) -> dict:
        return {"mode": self.mode, "recognised": self.recognised,
                "continuations": self.continuations, "resumed": self.resumed,
                "client": self.client, "guard_misses": dict(self.guard_misses),
                "guard_missed": sum(self.guard_misses.values()),
                "client_prompt_tokens": self.client_prompt_tokens,
                "forwarded_tokens": self.forwarded_tokens}


async def continuation_of(state: Any, ask: CompactionAsk, session: str, namespace: str
                          ) -> Continuation | MissWhy:
    """The request as a continuation of the session's record, or why it is served as sent:
    the engine holds no record of the session (no_record), the record is another conversation
    (guard), the request has images, or the template renders no turn after an answer."""
    if ask.images:
        return "images"  # an image's rows cannot be matched against the record's text
    try:
        reply = await state.engine.ask(FindSessionRecord(session, namespace),
                                       state.ask_timeout_s, sender="server")
    except (TimeoutError, ActorStopped):
        return "no_record"
    if not isinstance(reply, SessionRecord) or not reply.token_ids or reply.where is None:
        return "no_record"

    def build() -> Continuation | MissWhy:  # a worker thread: a record is 100k tokens
        if not guard(ask, state.tokenizer.decode(reply.token_ids)):
            return "guard"
        try:
            return build_continuation(ask, reply.token_ids, reply.where, state.tokenizer,
                                      state.chat_template)
        except ChatError:
            return "template"

    return await asyncio.to_thread(build)
