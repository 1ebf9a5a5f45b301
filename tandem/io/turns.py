"""The drive's turns between the session spill's saves and the disk writer's files (spec: "Its
own I/O path"; issue 16, part 6).

A spill save is a conversation leaving its slot before a prefill overwrites it, or the drain:
a request (or the stop) waits for it. The disk tier's files are written while a request decodes,
and nothing waits for them. So a save goes first: while one runs, the disk writer waits between
two of its files (at most ``max_wait_s``, so a long save delays the tier, never stops it), and a
save that starts while a file is under way waits for that one file only.

Both sides run on their writers' I/O threads, never on the loop nor on a request's path: the
tier's plan, offer and restore never touch this. Thread-safe; reads no clock but
``time.perf_counter`` for the waits it reports.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple

MAX_WAIT_S = 30.0  # the longest either side waits for the other


class FileTurn(NamedTuple):
    waited: bool  # a save was running when the file came
    ms: float
    capped: bool  # the save outlasted the wait's cap: the file went anyway


class IoTurns:
    def __init__(self, max_wait_s: float = MAX_WAIT_S):
        if not max_wait_s >= 0:
            raise ValueError("max_wait_s must be 0 or more")
        self.max_wait_s = float(max_wait_s)
        self._cond = threading.Condition()
        self._saves = 0  # spill saves running
        self._files = 0  # disk writer files under way
        self.file_waiting = threading.Event()  # set while a file waits for a save (tests)

    @property
    def saving(self) -> bool:
        with self._cond:
            return self._saves > 0

    @contextmanager
    def save(self) -> Iterator[float]:
        """The spill's side, around one save: waits for the file under way (at most
        ``max_wait_s``) and yields the ms it waited; the disk writer waits until it exits."""
        t = time.perf_counter()
        with self._cond:
            self._saves += 1
            self._cond.wait_for(lambda: self._files == 0, self.max_wait_s)
        waited_ms = (time.perf_counter() - t) * 1000.0
        try:
            yield waited_ms
        finally:
            with self._cond:
                self._saves -= 1
                self._cond.notify_all()

    @contextmanager
    def file(self, max_wait_s: float | None = None) -> Iterator[FileTurn]:
        """The disk writer's side, around one file: waits while a save runs (at most
        ``max_wait_s``, default the turns') and yields how it went."""
        cap = self.max_wait_s if max_wait_s is None else max_wait_s
        t = time.perf_counter()
        with self._cond:
            capped = False
            waited = self._saves > 0
            if waited:
                self.file_waiting.set()
                try:
                    capped = not self._cond.wait_for(lambda: self._saves == 0, cap)
                finally:
                    self.file_waiting.clear()
            self._files += 1
        waited_ms = (time.perf_counter() - t) * 1000.0
        try:
            yield FileTurn(waited, waited_ms, capped)
        finally:
            with self._cond:
                self._files -= 1
                self._cond.notify_all()
