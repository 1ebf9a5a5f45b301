"""The journal: one JSON row per request, appended to a JSONL file under ``home``.

A row holds counts, timings, a hashed session and a status, never user text: the row type
below is the whole list of what may be written. The last rows are also kept in memory for the
console (``tail``). Later issues append cache events to the same file (``kind`` tells them
apart). The file is 0600 (an older, wider one is narrowed on open), its folder 0700 when the
journal makes it.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import BinaryIO

import msgspec

from tandem.cache.vocabulary import Source, Tier


class RequestRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=False):
    """One request. ``t``: wall-clock seconds when it ended; ``session``: the hash or None;
    ``status``: the HTTP status answered (a stream that started is 200 whatever its end)."""

    kind: str = "request"
    request_id: str
    t: float
    session: str | None
    route: str
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    reread_tokens: int = 0
    cache_source: Source | None = None  # cold, resident, end, prompt_end, pin, park; None: none ran
    # The tier the rows came from, in the spec's names (tandem.cache.vocabulary.tier_of, as
    # usage.tandem.cache.tier); None: none ran.
    cache_tier: Tier | None = None
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    finish_reason: str | None = None
    status: int
    error: str | None = None  # the error code (never its message: it may quote the input)
    drafted: int = 0  # tokens the lookup drafter proposed
    accepted: int = 0  # of them, those the verify blocks accepted
    slot: int | None = None  # the engine slot it ran in (None: none ran)
    # extra.end_replayed: hidden or reasoning rows the end alignment put back; extra.aligned:
    # how the client's copy met the end anchor; extra.guest: the request ran as a guest;
    # extra.side: a side request (tandem/server/side.py), which kept nothing.
    extra: dict | None = None


class EventRow(msgspec.Struct, frozen=True):
    """A row of a cache event that is no request's (``kind`` "memory"): ``task`` names the
    cache (``disk_cache``), ``event`` what happened (``clear``), ``detail`` its counts."""

    kind: str
    task: str
    event: str
    t: float
    detail: dict = {}


class Journal:
    def __init__(self, path: Path, *, keep: int = 1000) -> None:
        """``path``: the JSONL file (created with its folder on the first row); ``keep``: rows
        held for ``tail``."""
        self.path = Path(path)
        self._rows: deque[dict] = deque(maxlen=keep)
        self._file = None
        self._encoder = msgspec.json.Encoder()
        self.rows_written = 0

    def append(self, row: RequestRow | EventRow) -> None:
        # A row is a few hundred bytes: one buffered write and a flush, on the loop, is cheaper
        # than a hop to a thread. No fsync: a lost last row on a crash is acceptable.
        line = self._encoder.encode(row) + b"\n"
        if self._file is None:
            self._file = open_append(self.path)
        self._file.write(line)
        self._file.flush()
        self._rows.append(msgspec.to_builtins(row))
        self.rows_written += 1

    def tail(self, n: int) -> list[dict]:
        """The last ``n`` rows this process wrote, newest last."""
        if n <= 0:
            return []
        rows = list(self._rows)
        return rows[-n:]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_append(path: Path) -> BinaryIO:
    """``path`` opened to append rows: made 0600 (with its folder 0700) when missing, narrowed to
    0600 when it exists, and ending on a newline, so that a row torn by a crash (kill -9 mid
    write) is never glued to the next one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
        file = os.fdopen(fd, "ab+")
    except BaseException:
        os.close(fd)
        raise
    end_newline(file)
    return file


def end_newline(file: BinaryIO) -> None:
    """Write a newline when the file's last byte is not one (O_APPEND writes at the end)."""
    size = os.fstat(file.fileno()).st_size
    if size == 0:
        return
    file.seek(size - 1)
    if file.read(1) != b"\n":
        file.write(b"\n")
        file.flush()
