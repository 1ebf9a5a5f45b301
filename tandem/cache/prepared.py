"""Prepared compaction answers: the summaries the compaction preparer wrote ahead, and what it
needs to know to write them (issue 17, part 3; spec: "Compaction as a continuation").

Pure, no asyncio, no clock reads: the chat route and the preparer's actor share one
``PreparedAnswers`` on the loop.

- The route tells it which sessions are an agent's (``note_session``: a session key that sent
  tools) and, for each compaction request it sees, that client's summarisation system text and
  instructions (``remember_instructions``); the preparer uses the last ones a client sent,
  else ours (``DEFAULT_SYSTEM_TEXT``, ``DEFAULT_INSTRUCTIONS``).
- The preparer stores each finished summary under (session, the digest of the record's rows up
  to its end anchor, the system text, the chat template's sha256) (``put``). A compaction
  request of that session at that end anchor, with the same system text and template, is then
  answered from it (``lookup``); any other key misses, so a summary is never served for rows,
  a prompt or a template it was not written from.

Session keys are the hashed ones the engine sees; no user text is logged from here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Ours, for a client that sent no compaction request yet: the shape of an agent's compaction
# prompt (what was done, where things stand, what comes next), not any one client's words.
DEFAULT_SYSTEM_TEXT = (
    "You are a helpful assistant that summarizes conversations between a user and a coding "
    "agent, so that the work can go on in a new session from the summary alone.")
DEFAULT_INSTRUCTIONS = (
    "Provide a detailed summary of the conversation above for continuing it. Focus on what "
    "was done, which files were read and changed and how, what is being worked on now, the "
    "decisions made and the user's requests and constraints that still hold, and what should "
    "be done next. Be precise and concise; keep file paths, names and commands exact.")

MAX_ENTRIES = 16  # prepared answers kept, oldest out first (one a session's end, mostly)
MAX_CLIENTS = 64
MAX_SESSIONS = 256


def rows_digest(rows: Sequence[int]) -> str:
    """The key of a record's rows up to its end anchor: sha256 of the ids as int64, as every
    other key of rows is made (an image's key ids are past 2**62)."""
    return hashlib.sha256(array("q", rows).tobytes()).hexdigest()


@dataclass(frozen=True)
class PreparedKey:
    session: str
    rows_digest: str
    system_text: str
    template_sha: str


@dataclass(frozen=True)
class PreparedAnswer:
    """A summary written ahead: its tokens and text, and the usage of the continuation that
    wrote it (``prompt_tokens``: the continuation's prompt; ``end_tokens``: the record's rows,
    which a continuation request resumes at)."""

    key: PreparedKey
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    end_tokens: int
    completion_tokens: int
    instructions: str = field(default="", repr=False)


class PreparedAnswers:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._answers: OrderedDict[PreparedKey, PreparedAnswer] = OrderedDict()
        # client -> (system text, instructions) of its last compaction request
        self._instructions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # agent sessions (hashed key) -> their client, newest last
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self.served = 0
        self.missed = 0

    # -- what the route tells ------------------------------------------------------------

    def note_session(self, session: str, client: str) -> None:
        """A request of ``session`` (hashed key) that sent tools: an agent's conversation,
        one the preparer may write a summary of, with ``client``'s instructions."""
        self._sessions[session] = client
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def remember_instructions(self, client: str, system_text: str, instructions: str) -> None:
        """The system text and instructions of ``client``'s last compaction request."""
        self._instructions[client] = (system_text, instructions)
        self._instructions.move_to_end(client)
        while len(self._instructions) > MAX_CLIENTS:
            self._instructions.popitem(last=False)

    def lookup(self, session: str | None, end_rows_digest: str, system_text: str,
               template_sha: str) -> PreparedAnswer | None:
        """The summary written for exactly this key, counted as served; None otherwise."""
        if session is None:
            return None
        answer = self._answers.get(PreparedKey(session, end_rows_digest, system_text,
                                               template_sha))
        if answer is None:
            self.missed += 1
            return None
        self.served += 1
        return answer

    # -- what the preparer reads and writes -------------------------------------------------

    def agent_client(self, session: str | None) -> str | None:
        """The client of an agent session (None: not one)."""
        return None if session is None else self._sessions.get(session)

    def instructions_for(self, client: str | None) -> tuple[str, str]:
        """(system text, instructions) the preparer writes with for ``client``."""
        got = self._instructions.get(client) if client is not None else None
        return got if got is not None else (DEFAULT_SYSTEM_TEXT, DEFAULT_INSTRUCTIONS)

    def has(self, key: PreparedKey) -> bool:
        return key in self._answers

    def put(self, answer: PreparedAnswer) -> None:
        self._answers[answer.key] = answer
        self._answers.move_to_end(answer.key)
        while len(self._answers) > self.max_entries:
            self._answers.popitem(last=False)

    def clear(self) -> None:
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)

    def check_invariants(self) -> None:
        assert len(self._answers) <= self.max_entries
        for key, answer in self._answers.items():
            assert answer.key == key, "an answer under another key"
            assert answer.completion_tokens == len(answer.token_ids)
