"""Write the session library, sessions/*.jsonl: requests shaped as real clients send them.

    .venv/bin/python scripts/make_sessions.py            # rewrites sessions/, prints lengths

Every row is a replay row (``{"t", "route", "headers", "body", "response"}``); ``response``
holds the answer the session was written with (reasoning, content, tool calls), which forced
replay makes the engine write, so the next request continues what the engine holds. The text is
our own, generated from a fixed seed: the shapes follow what opencode 1.18 and Open WebUI 0.12
were seen to send (../shared/NOTES.md, "Real clients"):

- opencode: a system text of about 9,500 characters holding the working folder and the date, 10
  tools of about 21,000 characters of JSON schema, ``x-session-id`` on every request, streams with
  ``include_usage``, ``max_tokens`` 32000 and no temperature; a tool loop's request is the one
  before plus the answer (reasoning echoed as ``reasoning_content``, arguments re-serialised
  compactly) and the tool result; a title request (own system text, no tools) on the first turn;
  a compaction request (its agent's prompt, one user message holding the history as text) after
  many turns, then the conversation restarts from the summary.
- Open WebUI: ``{model, stream, messages}`` only, earlier answers with their reasoning stripped;
  a title and a tags request after the first answer, a follow-up-suggestions request after every
  answer, each one user message holding the chat as text.

The long session (past 32k tokens on tiny's tokenizer) is gzipped to keep the library small;
`tandem replay` reads either.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "tiny"
OPENCODE_UA = "opencode/1.18.33 ai-sdk/provider-utils/3.0.10 runtime/bun/1.3.2"
T0 = 1795939200.0  # 2026-11-29

WORDS = ("account balance ledger entry parser config retry cache window buffer token stream "
         "handler route schema record batch queue worker timeout limit offset cursor page "
         "report total amount currency export import import_rows validate normalise merge "
         "split filter index lookup status summary invoice client server request response "
         "session header payload checksum snapshot journal metric counter gauge sample").split()
VERBS = ("read write check update rename move split merge fix test run build parse load save "
         "compare print count sort group render").split()


# -- text ------------------------------------------------------------------------------------


def sentence(rng: random.Random, n: int = 14) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


GUIDELINES = [
    "Keep answers short: the reader is at a terminal and reads every line you print.",
    "Before you change a file, read it; never edit code you have not seen in this session.",
    "Prefer the dedicated tools over shell commands for reading, searching and editing files.",
    "When a command may change the user's machine, say what it does in one sentence first.",
    "Follow the conventions of the code around you: naming, formatting, imports and tests.",
    "Never add a dependency without checking that the project already uses it or needs it.",
    "After a change, run the project's own checks (tests, type checks, linters) if it has them.",
    "Do not commit unless the user asks you to; never push, never rewrite published history.",
    "Refer to code as path:line so that the user can jump to it.",
    "If a task is ambiguous, do the most reasonable thing and say which reading you chose.",
    "Use the todo tool for work of three steps or more, and keep exactly one item in progress.",
    "Search widely before concluding that something does not exist in the repository.",
    "Quote error messages exactly; paraphrase nothing the user will search for.",
    "A tool result may be truncated; read the rest with an offset rather than guessing.",
    "Write comments that say why, not what; do not narrate the change in comments.",
    "Batch independent tool calls in one message; run dependent ones one after another.",
    "Never print secrets, tokens or keys you come across; refer to them by name.",
    "When tests fail, read the failure before changing code, and change one thing at a time.",
    "Keep the user's unrelated changes intact; work around them, never revert them.",
    "Stop and ask only when you cannot proceed safely without an answer.",
]


def opencode_system(folder: str, date: str, rng: random.Random) -> str:
    parts = ["You are a coding agent working in the user's terminal. You help with software "
             "engineering tasks: fixing bugs, adding features, refactoring, explaining code. "
             "Use the tools described below to act on the repository.", ""]
    for title in ("Tone and style", "Doing tasks", "Tool usage policy", "Code references",
                  "Proactiveness", "Following conventions"):
        parts.append(f"# {title}")
        picks = rng.sample(GUIDELINES, 8)
        parts.extend(f"- {g}" for g in picks)
        parts.append(" ".join(sentence(rng) for _ in range(4)))
        parts.append("")
    body = "\n".join(parts)
    while len(body) < 8900:
        body += "\n- " + rng.choice(GUIDELINES) + " " + sentence(rng)
    env = (f"\n\nHere is useful information about the environment you are running in:\n<env>\n"
           f"  Working directory: {folder}\n  Is directory a git repo: yes\n"
           f"  Platform: linux\n  Today's date: {date}\n</env>\n<project>\n  {folder}/\n"
           "    src/\n    tests/\n    pyproject.toml\n    README.md\n</project>")
    return body + env


TOOL_NAMES = ("bash", "read", "write", "edit", "glob", "grep", "list", "webfetch", "todowrite",
              "task")


def tools(rng: random.Random) -> list[dict]:
    out = []
    for name in TOOL_NAMES:
        desc = f"The {name} tool. " + " ".join(
            rng.choice(GUIDELINES) + " " + sentence(rng, 10) for _ in range(8))
        props = {
            "filePath": {"type": "string", "description": "The absolute path of the file to "
                         "work on; relative paths are resolved against the working folder."},
            "description": {"type": "string", "description": "A short, clear description of "
                            "what this call does, in five to ten words, shown to the user."},
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds; "
                        "the call is stopped when it runs longer (default 120000)."},
            "offset": {"type": "number", "description": "The line number to start reading "
                       "from; use it for files too long to read at once."},
            "limit": {"type": "number", "description": "The number of lines or results to "
                      "return (default 2000)."},
            "pattern": {"type": "string", "description": "A glob or regular expression pattern "
                        "to match file names or lines against."},
        }
        keys = rng.sample(sorted(props), 4)
        out.append({"type": "function", "function": {
            "name": name, "description": desc,
            "parameters": {"type": "object", "properties": {k: props[k] for k in keys},
                           "required": keys[:1], "additionalProperties": False,
                           "$schema": "http://json-schema.org/draft-07/schema#"}}})
    return out


def source_file(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        if i % 9 == 0:
            out.append(f"def {rng.choice(VERBS)}_{rng.choice(WORDS)}({rng.choice(WORDS)}, "
                       f"{rng.choice(WORDS)}):")
        elif i % 9 == 8:
            out.append(f"    return {rng.choice(WORDS)}")
        else:
            out.append(f"    {rng.choice(WORDS)} = {rng.choice(WORDS)}.{rng.choice(VERBS)}("
                       f"{rng.choice(WORDS)}, {rng.randint(0, 999)})")
    return "\n".join(f"{n + 1:5d}\t{line}" for n, line in enumerate(out))


# -- opencode --------------------------------------------------------------------------------


class Opencode:
    """One opencode session: its messages grow by appending; every request is recorded."""

    def __init__(self, rows: list, sid: str, folder: str, rng: random.Random) -> None:
        self.rows = rows
        self.sid = sid
        self.folder = folder
        self.rng = rng
        self.tools = tools(rng)
        self.messages: list[dict] = [
            {"role": "system", "content": opencode_system(folder, "Sun Nov 29 2026", rng)}]
        self.calls = 0
        self.first = True

    def _row(self, body: dict, response: dict) -> None:
        self.rows.append({"t": T0 + len(self.rows), "route": "/v1/chat/completions",
                          "headers": {"x-session-id": self.sid, "user-agent": OPENCODE_UA},
                          "body": body, "response": response})

    def _body(self, messages: list[dict], with_tools: bool = True) -> dict:
        body = {"model": MODEL, "max_tokens": 32000, "messages": json.loads(json.dumps(messages))}
        if with_tools:
            body["tools"] = self.tools
            body["tool_choice"] = "auto"
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return body

    def turn(self, task: str, steps: int, result_lines: int = 40) -> None:
        """One user turn: ``steps`` tool calls, each answered by a tool result, then text."""
        rng = self.rng
        self.messages.append({"role": "user", "content": task})
        for step in range(steps + 1):
            body = self._body(self.messages)
            reasoning = " ".join(sentence(rng, 12) for _ in range(rng.randint(1, 3)))
            if step < steps:
                self.calls += 1
                name = rng.choice(("read", "grep", "bash", "edit", "glob"))
                args = {"filePath": f"{self.folder}/src/{rng.choice(WORDS)}.py",
                        "description": f"{rng.choice(VERBS)} the {rng.choice(WORDS)} module"}
                call_id = f"call_{self.sid[-6:]}_{self.calls:03d}"
                # The model writes ", " and ": "; opencode sends the arguments back compact.
                response = {"reasoning": reasoning, "content": "", "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args)}}]}
                self._row(body, response)
                self.messages.append({
                    "role": "assistant", "content": "", "reasoning_content": reasoning,
                    "tool_calls": [{"id": call_id, "type": "function", "function": {
                        "name": name, "arguments": json.dumps(args, separators=(",", ":"))}}]})
                self.messages.append({"role": "tool", "tool_call_id": call_id,
                                      "content": source_file(rng, result_lines)})
            else:
                content = " ".join(sentence(rng, 16) for _ in range(rng.randint(2, 4)))
                self._row(body, {"reasoning": reasoning, "content": content, "tool_calls": []})
                self.messages.append({"role": "assistant", "content": content,
                                      "reasoning_content": reasoning})
            if self.first:
                self.first = False
                self.title(task)

    def title(self, task: str) -> None:
        system = ("You are a title generator. You output only a thread title: a brief phrase "
                  "of at most fifty characters that says what the user wants, in the user's "
                  "language, with no quotes, no trailing punctuation and no explanation.")
        body = self._body([{"role": "system", "content": system},
                           {"role": "user", "content": f"Generate a title for this "
                            f"conversation:\n{task}"}], with_tools=False)
        words = task.split()[:5]
        self._row(body, {"reasoning": "A short title.", "content": " ".join(words).rstrip("."),
                         "tool_calls": []})

    def compact(self) -> None:
        """The compaction request, then the conversation restarts from its summary."""
        history = []
        for m in self.messages[1:]:
            text = m.get("content") or ""
            if m.get("tool_calls"):
                text += " " + json.dumps(m["tool_calls"][0]["function"])
            history.append(f"{m['role']}: {text}")
        prompt = ("You summarise coding sessions so that work can continue in a fresh context. "
                  "Write what was asked, what was done, which files changed, what is left and "
                  "what the next step is. Be specific: name files, functions and commands.")
        body = self._body([{"role": "system", "content": prompt},
                           {"role": "user", "content": "Summarise this conversation:\n\n"
                            + "\n\n".join(history)}], with_tools=False)
        summary = " ".join(sentence(self.rng, 18) for _ in range(8))
        self._row(body, {"reasoning": "Summarise the work.", "content": summary,
                         "tool_calls": []})
        self.messages = [self.messages[0],
                         {"role": "user", "content": "What did we do so far?"},
                         {"role": "assistant", "content": summary, "reasoning_content": ""}]


TASKS = [
    "The ledger export drops the last row when the batch size divides the row count; find out "
    "why and fix it.",
    "Add a --currency flag to the report command and thread it through to the totals.",
    "The retry handler sleeps before the first attempt; make the first attempt immediate.",
    "Write tests for the cursor pagination in src/page.py, covering an empty page.",
    "Rename the journal module's record function to append_row and update the callers.",
    "The checksum in the snapshot header is computed over the wrong slice; fix it.",
    "Explain how the session cache decides what to evict, with file references.",
    "Make the importer skip blank lines and report how many it skipped.",
    "Split the invoice renderer into a template and a formatter.",
    "Run the tests and fix whatever fails.",
]


def opencode_session(name: str, seed: int, turns: list[tuple[int, int]], *,
                     compact_after: int | None = None, restart_after: int | None = None,
                     folder: str = "/home/dev/projects/ledger") -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    oc = Opencode(rows, f"ses_{name}_{seed:04d}", folder, rng)
    for i, (steps, lines) in enumerate(turns):
        oc.turn(TASKS[i % len(TASKS)], steps, lines)
        if restart_after is not None and i == restart_after:
            rows.append({"restart": True})
        if compact_after is not None and i == compact_after:
            oc.compact()
    return rows


def two_folders(seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    a = Opencode(rows, "ses_folder_a", "/home/dev/projects/ledger", rng)
    b = Opencode(rows, "ses_folder_b", "/home/dev/projects/weather", rng)
    for i in range(3):
        a.turn(TASKS[i], 1, 20)
        b.turn(TASKS[-1 - i], 1, 20)
    return rows


def three_conversations(seed: int) -> list[dict]:
    """Three agent sessions in three folders, then the first again: with one slot the first
    leaves for the park, the park gives it up to the second, and its next turn reads it back
    from the session spill."""
    rng = random.Random(seed)
    rows: list[dict] = []
    names = ("ledger", "weather", "invoices")
    a, b, c = (Opencode(rows, f"ses_three_{n}", f"/home/dev/projects/{n}", rng) for n in names)
    a.turn(TASKS[0], 1, 30)
    b.turn(TASKS[1], 1, 30)
    c.turn(TASKS[2], 1, 30)
    a.turn(TASKS[3], 1, 30)
    return rows


# -- Open WebUI ------------------------------------------------------------------------------


def openwebui_session(seed: int, answers: int) -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    ua = "Python/3.11 aiohttp/3.12.15"

    def row(messages: list[dict], response: dict) -> None:
        rows.append({"t": T0 + len(rows), "route": "/v1/chat/completions",
                     "headers": {"user-agent": ua},
                     "body": {"model": MODEL, "stream": True,
                              "messages": json.loads(json.dumps(messages))},
                     "response": response})

    def chat_text(messages: list[dict]) -> str:
        return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages)

    def task(kind: str, messages: list[dict], instruction: str, answer: str) -> None:
        text = (f"### Task:\n{instruction}\n### Guidelines:\n- Answer in JSON.\n- Use the "
                f"chat's language.\n### Chat History:\n<chat_history>\n{chat_text(messages)}\n"
                "</chat_history>")
        row([{"role": "user", "content": text}],
            {"reasoning": f"The {kind} request.", "content": answer, "tool_calls": []})

    messages: list[dict] = []
    questions = ["I am planning a small vegetable garden on a balcony that gets morning sun. "
                 "What should I grow first, and how deep do the pots need to be? "
                 + " ".join(sentence(rng) for _ in range(6))]
    questions += [f"Thanks. Follow-up {i}: " + sentence(rng, 18) for i in range(1, answers)]
    for i in range(answers):
        messages.append({"role": "user", "content": questions[i]})
        reasoning = " ".join(sentence(rng, 14) for _ in range(3))
        content = "\n\n".join(" ".join(sentence(rng, 14) for _ in range(2)) for _ in range(2))
        row(messages, {"reasoning": reasoning, "content": content, "tool_calls": []})
        messages.append({"role": "assistant", "content": content})  # reasoning stripped
        if i == 0:
            task("title", messages, "Generate a concise title of three to five words with an "
                 "emoji for the chat.", '{"title": "Balcony garden start"}')
            task("tags", messages, "Generate one to three broad tags and one to three specific "
                 "tags that categorise the chat.", '{"tags": ["Gardening", "Home"]}')
        task("follow-up", messages, "Suggest three to five follow-up questions the user might "
             "ask next, from the user's point of view.",
             '{"follow_ups": ["Which soil?", "How often to water?", "What about herbs?"]}')
    return rows


# -- the library -----------------------------------------------------------------------------


def library() -> dict[str, list[dict]]:
    return {
        "opencode_short.jsonl": opencode_session("short", 1, [(2, 30)]),
        "openwebui_short.jsonl": openwebui_session(2, 3),
        "two_folders.jsonl": two_folders(3),
        "restart.jsonl": opencode_session("restart", 4, [(1, 30), (1, 30)], restart_after=0),
        "three_conversations.jsonl": three_conversations(6),
        "opencode_long.jsonl.gz": opencode_session(
            "long", 5, [(3, 120)] * 7 + [(2, 60)] * 2, compact_after=6),
    }


def prompt_tokens(tokenizer, row: dict) -> int:
    from tandem.models.chat import render_chat

    body = row["body"]
    return len(tokenizer.encode(render_chat(body["messages"], body.get("tools"))))


def main() -> int:
    from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

    out = ROOT / "sessions"
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(write_qwen_tokenizer(Path(tmp)))
    for name, rows in library().items():
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        path = out / name
        if name.endswith(".gz"):
            path.write_bytes(gzip.compress(data, mtime=0))
        else:
            path.write_bytes(data)
        requests = [r for r in rows if not r.get("restart")]
        longest = max(prompt_tokens(tokenizer, r) for r in requests)
        print(f"{name}: {len(requests)} requests, longest prompt {longest} tokens, "
              f"{path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
