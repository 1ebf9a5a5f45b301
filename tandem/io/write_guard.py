"""The day's write budget of the NVMe (spec: "The day's write budget").

The disk tier and the session spill add every byte they put on the disk to the local day's
count, kept in ``writes.json`` beside the tier across restarts. The level the count has reached
decides what may still be written:

- ``ok`` (under ``budget``): everything;
- ``over`` (from ``budget``): the tier plans nothing; the spill writes a planned stop's drain
  and the evictions of conversations of ``SPILL_OVER_MIN_TOKENS`` or more;
- ``hard`` (from ``HARD_FACTOR`` times ``budget``): only the drain.

A budget is spent once the count reaches it, so a budget of 0 writes only what the rules keep
at every level. A skip is a cache not written, never an answer changed: each one is logged
(``disk_guard_skip``), held for the journal (``drain_events``) and counted by day, writer and
reason.

The count is saved atomically (a ``.tmp`` written 0600 without following a symlink, fsynced,
renamed over the file, the folder fsynced) at most once a second, at once on a new day, and
whenever ``save`` is called (a drain, a close); a crash loses at most the last second's count.
A file that cannot be read or does not decode starts the day at 0 and is logged: the guard
errs towards writing, and the next save replaces the file. No save error ever raises.

Thread-safe: every method may be called from any thread (the loop plans, the writers add).
The guard reads no clock of its own: ``clock`` (wall seconds) dates the count in local time and
paces the saves.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections import deque
from datetime import date, timedelta
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import msgspec
import structlog
from msgspec import Meta

from tandem.io.admission import read_small, write_atomic

log = structlog.get_logger("tandem.disk")

GB = 10 ** 9
BUDGET_GB = 200.0
HARD_FACTOR = 1.5
SPILL_OVER_MIN_TOKENS = 32_768  # over the budget, an eviction this long is still spilled
DAYS_KEPT = 14
SAVE_EVERY_S = 1.0
FILE_NAME = "writes.json"
FILE_VERSION = 1
FILE_MAX_NBYTES = 1 << 20  # a larger file is not one of ours
UNJOURNALED = 1024  # skips held for drain_events between two calls, at most (oldest go first)

Who = Literal["tier", "spill"]
Level = Literal["ok", "over", "hard"]
SpillKind = Literal["drain", "eviction"]
WHO: tuple[Who, ...] = ("tier", "spill")

_Count = Annotated[int, Meta(ge=0)]


class _Day(msgspec.Struct, forbid_unknown_fields=True):
    tier: _Count = 0
    spill: _Count = 0
    # who -> why -> skips
    skips: dict[Who, dict[Annotated[str, Meta(max_length=64)], _Count]] = {}


class _File(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    days: dict[str, _Day]


class WriteGuard:
    def __init__(self, path: str | os.PathLike, budget_gb: float = BUDGET_GB, *,
                 clock: Callable[[], float] = time.time):
        if not budget_gb >= 0 or math.isinf(budget_gb):
            raise ValueError("budget_gb must be a finite number, 0 or more")
        self.path = Path(path)
        self.budget_nbytes = int(budget_gb * GB)
        self._clock = clock
        self._lock = threading.Lock()  # the counts; held briefly, never across I/O
        self._save_lock = threading.Lock()  # one save at a time, in the order of their copies
        self._days: dict[date, _Day] = {}
        self._dirty = False
        self._saved_at = -math.inf  # the clock at the last save
        self._saved_day: date | None = None
        self._unjournaled: deque[dict[str, Any]] = deque(maxlen=UNJOURNALED)
        self.unsaved_errors = 0
        self._load()

    # -- the count ---------------------------------------------------------------------------

    def add(self, nbytes: int, who: Who) -> None:
        """``nbytes`` put on the disk by ``who`` today; saved when a second has passed since the
        last save or the day changed."""
        if who not in WHO:
            raise ValueError(f"who must be one of {WHO}")
        if nbytes < 0:
            raise ValueError("nbytes must not be negative")
        now = self._clock()
        today = _local_date(now)
        with self._lock:
            day = self._days.setdefault(today, _Day())
            if who == "tier":
                day.tier += nbytes
            else:
                day.spill += nbytes
            self._dirty = True
            due = today != self._saved_day or abs(now - self._saved_at) >= SAVE_EVERY_S
        # A save under way holds this add's bytes or leaves them dirty for the next one; a
        # writer never waits on another's fsync.
        if due and self._save_lock.acquire(blocking=False):
            try:
                self._save_locked(now)
            finally:
                self._save_lock.release()

    def today_nbytes(self) -> int:
        with self._lock:
            day = self._days.get(_local_date(self._clock()))
            return day.tier + day.spill if day is not None else 0

    def level(self) -> Level:
        return self._level(self.today_nbytes())

    def may_tier(self) -> bool:
        """Whether the disk tier may plan writes now."""
        return self.level() == "ok"

    def may_spill(self, kind: SpillKind, tokens: int) -> bool:
        """Whether the spill may write an entry of ``tokens`` tokens for ``kind`` now: a drain
        always; an eviction under the budget, or over it (not hard) from
        ``SPILL_OVER_MIN_TOKENS``."""
        if kind not in ("drain", "eviction"):
            raise ValueError("kind must be drain or eviction")
        if kind == "drain":
            return True
        level = self.level()
        return level == "ok" or (level == "over" and tokens >= SPILL_OVER_MIN_TOKENS)

    def skipped(self, who: Who, why: str, *, tokens: int | None = None) -> None:
        """A write ``who`` did not make because of the guard. ``why`` is a short reason of the
        caller's vocabulary (``over``, ``hard``, ...), never user text."""
        if who not in WHO:
            raise ValueError(f"who must be one of {WHO}")
        if not why or len(why) > 64:
            raise ValueError("why must be a short reason")
        now = self._clock()
        today = _local_date(now)
        with self._lock:
            day = self._days.setdefault(today, _Day())
            reasons = day.skips.setdefault(who, {})
            reasons[why] = reasons.get(why, 0) + 1
            self._dirty = True
            spent = day.tier + day.spill
            level = self._level(spent)
            event = {"t": now, "event": "skip", "who": who, "why": why, "level": level}
            if tokens is not None:
                event["tokens"] = int(tokens)
            self._unjournaled.append(event)
        log.info("disk_guard_skip", who=who, why=why, guard_level=level,
                 today_gb=round(spent / GB, 3), budget_gb=self.budget_nbytes / GB,
                 **({} if tokens is None else {"tokens": int(tokens)}))

    # -- the file ----------------------------------------------------------------------------

    def save(self) -> bool:
        """Write the count now when it changed since the last save; False when the write failed
        (logged, counted; the count stays in memory and the next save tries again)."""
        with self._save_lock:
            return self._save_locked(self._clock())

    def _save_locked(self, now: float) -> bool:
        today = _local_date(now)
        with self._lock:
            self._prune(today)
            if not self._dirty:
                return True
            data = msgspec.json.encode(_File(FILE_VERSION, {
                d.isoformat(): self._days[d] for d in sorted(self._days)}))
            self._dirty = False
            self._saved_at = now
            self._saved_day = today
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(self.path, data)
        except OSError as exc:
            with self._lock:
                self._dirty = True
                self.unsaved_errors += 1
            log.warning("disk_writes_unsaved", errno=exc.errno, error=type(exc).__name__)
            return False
        return True

    def _load(self) -> None:
        try:
            data = read_small(self.path, FILE_MAX_NBYTES)
        except OSError as exc:  # a symlink, a FIFO, a folder, a file too large
            self._unreadable(errno.errorcode.get(exc.errno or 0, "oserror").lower())
            return
        if data is None:
            return
        try:
            doc = msgspec.json.decode(data, type=_File)
            if doc.version != FILE_VERSION:
                raise ValueError("version")
            days = {date.fromisoformat(k): v for k, v in doc.days.items()}
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self._unreadable("corrupt")
            return
        self._days = days
        self._prune(_local_date(self._clock()))

    def _unreadable(self, reason: str) -> None:
        # The day starts at 0: the guard errs towards writing, never against answers.
        self._days = {}
        self._dirty = True
        log.warning("disk_writes_unreadable", reason=reason, path=str(self.path.name))

    def _prune(self, today: date) -> None:
        first = today - timedelta(days=DAYS_KEPT - 1)
        for d in [d for d in self._days if d < first]:
            del self._days[d]
            self._dirty = True

    # -- the reports -------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """``/health``'s ``cache.disk_writes``: today's bytes by writer, the budget, the level,
        today's skips by writer and reason, and the last ``DAYS_KEPT`` local days (oldest first,
        days without writes as zeros)."""
        today = _local_date(self._clock())
        with self._lock:
            days = {d: self._days.get(d) or _Day()
                    for d in (today - timedelta(days=i) for i in range(DAYS_KEPT - 1, -1, -1))}
            t = days[today]
            spent = t.tier + t.spill
            return {
                "date": today.isoformat(),
                "today_gb": spent / GB, "today_nbytes": spent,
                "tier_nbytes": t.tier, "spill_nbytes": t.spill,
                "budget_gb": self.budget_nbytes / GB,
                "hard_gb": self.budget_nbytes * HARD_FACTOR / GB,
                "level": self._level(spent),
                "skips": {who: sum(t.skips.get(who, {}).values()) for who in WHO},
                "skip_reasons": {who: dict(t.skips.get(who, {})) for who in WHO},
                "days": {d.isoformat(): {"gb": (v.tier + v.spill) / GB,
                                         "tier_nbytes": v.tier, "spill_nbytes": v.spill,
                                         "skips": sum(sum(r.values()) for r in v.skips.values())}
                         for d, v in days.items()},
                "unsaved_errors": self.unsaved_errors,
            }

    def drain_events(self) -> list[dict[str, Any]]:
        """The skips since the last call, oldest first, for the server to journal on the loop:
        t, event ("skip"), who, why, level, and tokens where the caller gave them; no text."""
        with self._lock:
            events = list(self._unjournaled)
            self._unjournaled.clear()
        return events

    def check_invariants(self) -> None:
        with self._lock:
            for d, v in self._days.items():
                assert v.tier >= 0 and v.spill >= 0, d
                assert set(v.skips) <= set(WHO), d

    def _level(self, spent: int) -> Level:
        if spent >= self.budget_nbytes * HARD_FACTOR:
            return "hard"
        return "over" if spent >= self.budget_nbytes else "ok"


def _local_date(t: float) -> date:
    return date.fromtimestamp(t)


def make_write_guard(config: Any) -> WriteGuard:
    """The server's guard: ``writes.json`` in the disk tier's folder, ``disk_write_budget_gb``
    (one guard a server: the tier and the spill share it)."""
    return WriteGuard(config.disk_cache_path() / FILE_NAME, config.disk.disk_write_budget_gb)
