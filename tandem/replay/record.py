"""Recording: one JSONL row per request a server answered, the input of `tandem replay`.

A row is ``{"t", "route", "headers", "body", "response"}``: the wall-clock time the request
arrived, its path, the two headers that shape a session (``x-session-id``, ``user-agent``), the
body as the client sent it and what tandem answered (text, reasoning, content, tool calls, the
token ids sent, usage, cache source). A row with route, headers and body alone is a valid input
to replay (a session captured elsewhere); so is ``{"restart": true}``, which makes an in-process
replay restart its server between two requests.

A recording holds user text, so its folder is mode 0700 and its files 0600, and nothing of it
goes to a log: the log line says only that recording is on and where.
"""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

log = structlog.get_logger("tandem.replay")

HEADERS = ("x-session-id", "x-openwebui-chat-id", "user-agent")
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_encoder = msgspec.json.Encoder()


class Recorder:
    """Appends rows to ``DIR/<UTC time>-<pid>.jsonl``, one file a server start."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        # mkdir's mode holds only for a folder it makes: one that was there keeps its own.
        os.chmod(self.folder, 0o700)
        for old in self.folder.glob("*.jsonl"):
            if old.is_file() and not old.is_symlink():
                os.chmod(old, 0o600)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.path = self.folder / f"{stamp}-{os.getpid()}.jsonl"
        self.rows_written = 0
        log.info("recording_on", path=str(self.path))

    def append(self, row: dict[str, Any]) -> None:
        # One open a row: a row is one request (at most a few hundred KB of body), and a file
        # that is never held open needs no closing at shutdown. O_APPEND keeps rows whole.
        line = _encoder.encode(row) + b"\n"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # A row torn by a kill mid write (or a file left by a killed server of the same pid
            # and second) is never glued to the next: that one starts on a fresh line.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
        finally:
            os.close(fd)
        self.rows_written += 1


def request_row(*, t: float, route: str, headers: Any, body: dict[str, Any] | None,
                response: dict[str, Any]) -> dict[str, Any]:
    """The row of one request; ``headers`` is any mapping (aiohttp's CIMultiDict)."""
    kept = {name: headers[name] for name in HEADERS if name in headers}
    return {"t": round(t, 3), "route": ROUTES.get(route, route), "headers": kept,
            "body": body, "response": response}


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a recording or a library session (gzipped when it ends .gz), in order; blank lines are skipped. A row
    that is not an object, or a request row without a body, is a ValueError naming its line."""
    rows = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a row must be a JSON object")
            if not row.get("restart") and not isinstance(row.get("body"), dict):
                raise ValueError(f"{path}:{n}: a request row needs a body object")
            rows.append(row)
    return rows
