"""The day's write budget (spec: "The day's write budget"): the levels at the budget and 1.5
times it, what the tier and the spill may write at each, the local day's rollover, the count kept
across a reopen (atomically, 0600, never through a symlink), a corrupt file starting the day at
0, the last 14 days, and adds from many threads losing no byte."""

import json
import os
import threading
from datetime import date, datetime, timedelta

import pytest
import structlog

from tandem.io.write_guard import (DAYS_KEPT, GB, SPILL_OVER_MIN_TOKENS, WriteGuard)

BUDGET = 1000 / GB  # 1,000 bytes: over from 1,000, hard from 1,500


class Clock:
    """Wall seconds that move only when told; ``at`` a local date and time."""

    def __init__(self, when: datetime = datetime(2026, 10, 3, 12, 0, 0)):
        self.now = when.timestamp()

    def __call__(self) -> float:
        return self.now

    def at(self, when: datetime) -> None:
        self.now = when.timestamp()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "disk" / "writes.json"


def _file(path) -> dict:
    return json.loads(path.read_bytes())


def test_the_level_is_ok_under_the_budget_over_from_it_and_hard_from_one_and_a_half_times(
        path, clock):
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(999, "tier")
    assert guard.level() == "ok" and guard.may_tier()
    guard.add(1, "spill")  # 1,000: the budget is spent
    assert guard.level() == "over" and not guard.may_tier()
    guard.add(499, "tier")
    assert guard.level() == "over"
    guard.add(1, "spill")  # 1,500
    assert guard.level() == "hard" and not guard.may_tier()
    assert guard.report()["today_nbytes"] == 1500
    guard.check_invariants()


@pytest.mark.parametrize("spent,kind,tokens,may", [
    (0, "drain", 10, True), (0, "eviction", 10, True),
    (1000, "drain", 10, True),
    (1000, "eviction", SPILL_OVER_MIN_TOKENS - 1, False),
    (1000, "eviction", SPILL_OVER_MIN_TOKENS, True),
    (1500, "drain", 10, True),
    (1500, "eviction", SPILL_OVER_MIN_TOKENS * 4, False),
])
def test_the_spill_writes_evictions_of_long_conversations_over_the_budget_and_only_the_drain_when_hard(
        path, clock, spent, kind, tokens, may):
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(spent, "spill")
    assert guard.may_spill(kind, tokens) is may


def test_a_budget_of_zero_writes_only_the_drain(path, clock):
    guard = WriteGuard(path, 0.0, clock=clock)
    assert guard.level() == "hard" and not guard.may_tier()
    assert guard.may_spill("drain", 1) and not guard.may_spill("eviction", 10 ** 6)


def test_bad_arguments_are_refused(path, clock):
    guard = WriteGuard(path, BUDGET, clock=clock)
    with pytest.raises(ValueError):
        guard.add(-1, "tier")
    with pytest.raises(ValueError):
        guard.add(1, "park")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        guard.may_spill("restore", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WriteGuard(path, -1.0, clock=clock)


def test_the_local_day_rolls_over_at_midnight_and_the_new_day_is_saved_at_once(path, clock):
    clock.at(datetime(2026, 10, 3, 23, 59, 59))
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(1200, "tier")
    assert guard.level() == "over"
    clock.now += 0.5  # 23:59:59.5: within the second, not saved
    guard.add(10, "tier")
    assert _file(path)["days"]["2026-10-03"]["tier"] == 1200
    clock.at(datetime(2026, 10, 4, 0, 0, 0))  # half a second later, a new local day
    assert guard.level() == "ok" and guard.may_tier() and guard.today_nbytes() == 0
    guard.add(7, "spill")  # the day changed: saved at once
    days = _file(path)["days"]
    assert days["2026-10-03"]["tier"] == 1210 and days["2026-10-04"]["spill"] == 7
    report = guard.report()
    assert report["date"] == "2026-10-04" and report["today_nbytes"] == 7
    assert report["days"]["2026-10-03"]["tier_nbytes"] == 1210


def test_the_count_is_saved_at_most_once_a_second_and_save_forces_it(path, clock):
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(1, "tier")
    assert _file(path)["days"]["2026-10-03"]["tier"] == 1  # the first add saves
    clock.now += 0.9
    guard.add(2, "tier")
    assert _file(path)["days"]["2026-10-03"]["tier"] == 1
    clock.now += 0.1
    guard.add(3, "tier")
    assert _file(path)["days"]["2026-10-03"]["tier"] == 6
    guard.add(4, "spill")
    assert _file(path)["days"]["2026-10-03"]["spill"] == 0
    assert guard.save()
    assert _file(path)["days"]["2026-10-03"]["spill"] == 4


def test_the_count_survives_a_reopen_written_0600_and_atomically(path, clock):
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(800, "tier")
    guard.add(300, "spill")
    guard.skipped("tier", "over", tokens=4096)
    guard.save()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert not list(path.parent.glob("*.tmp"))
    again = WriteGuard(path, BUDGET, clock=clock)
    r = again.report()
    assert (r["tier_nbytes"], r["spill_nbytes"], r["level"]) == (800, 300, "over")
    assert r["skips"] == {"tier": 1, "spill": 0}
    assert r["skip_reasons"]["tier"] == {"over": 1}
    assert not again.may_tier()


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 1, "days": {"2026-10-03": '
                                     b'{"tier": -5}}}', b'{"version": 9, "days": {}}',
                                     b'{"version": 1, "days": {"yesterday": {}}}', b"\xff" * 64])
def test_a_corrupt_file_starts_the_day_at_zero_is_logged_and_replaced(path, clock, content):
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with structlog.testing.capture_logs() as logs:
        guard = WriteGuard(path, BUDGET, clock=clock)
    assert [e["reason"] for e in logs if e["event"] == "disk_writes_unreadable"] == ["corrupt"]
    assert guard.today_nbytes() == 0 and guard.level() == "ok"
    guard.add(5, "tier")
    assert _file(path)["days"]["2026-10-03"]["tier"] == 5


def test_a_symlink_is_never_read_nor_written_through(path, clock, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text('{"version": 1, "days": {"2026-10-03": {"tier": 999999}}}')
    path.parent.mkdir(parents=True)
    path.symlink_to(target)
    with structlog.testing.capture_logs() as logs:
        guard = WriteGuard(path, BUDGET, clock=clock)
    assert any(e["event"] == "disk_writes_unreadable" for e in logs)
    assert guard.today_nbytes() == 0
    guard.add(5, "tier")
    assert not path.is_symlink() and _file(path)["days"]["2026-10-03"]["tier"] == 5
    assert "999999" in target.read_text()


def test_the_report_holds_the_last_14_days_oldest_first_and_older_ones_go(path, clock):
    start = datetime(2026, 10, 1, 12)
    for i in range(20):
        clock.at(start + timedelta(days=i))
        guard = WriteGuard(path, BUDGET, clock=clock)  # a restart a day
        guard.add(100 + i, "tier")
        guard.save()
    days = guard.report()["days"]
    today = date(2026, 10, 20)
    assert list(days) == [(today - timedelta(days=DAYS_KEPT - 1 - i)).isoformat()
                          for i in range(DAYS_KEPT)]
    assert days["2026-10-20"]["tier_nbytes"] == 119 and days["2026-10-07"]["tier_nbytes"] == 106
    assert set(_file(path)["days"]) == set(days)  # the file keeps no older day
    # a day without writes is a zero in the report
    clock.at(datetime(2026, 10, 22, 9))
    days = WriteGuard(path, BUDGET, clock=clock).report()["days"]
    assert days["2026-10-21"]["gb"] == 0 and days["2026-10-22"]["tier_nbytes"] == 0
    assert "2026-10-08" not in days and days["2026-10-09"]["tier_nbytes"] == 108


def test_a_skip_is_counted_by_writer_and_reason_logged_and_held_for_the_journal(path, clock):
    guard = WriteGuard(path, BUDGET, clock=clock)
    guard.add(1600, "spill")
    with structlog.testing.capture_logs() as logs:
        guard.skipped("tier", "hard", tokens=8192)
        guard.skipped("spill", "hard", tokens=40_000)
        guard.skipped("spill", "short")
    r = guard.report()
    assert r["skips"] == {"tier": 1, "spill": 2}
    assert r["skip_reasons"]["spill"] == {"hard": 1, "short": 1}
    assert r["days"]["2026-10-03"]["skips"] == 3
    lines = [e for e in logs if e["event"] == "disk_guard_skip"]
    assert [(e["who"], e["why"], e["guard_level"]) for e in lines] == [
        ("tier", "hard", "hard"), ("spill", "hard", "hard"), ("spill", "short", "hard")]
    events = guard.drain_events()
    assert [(e["who"], e["why"], e.get("tokens")) for e in events] == [
        ("tier", "hard", 8192), ("spill", "hard", 40_000), ("spill", "short", None)]
    assert guard.drain_events() == []


def test_adds_from_many_threads_lose_no_byte(path, clock):
    guard = WriteGuard(path, 1.0, clock=clock)
    go = threading.Barrier(8)

    def writer(i: int) -> None:
        go.wait(timeout=10)
        for n in range(2000):
            clock.now += 0.001  # racy on purpose: saves come and go while others add
            guard.add(1 + n % 3, "tier" if i % 2 else "spill")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    per_thread = sum(1 + n % 3 for n in range(2000))
    r = guard.report()
    assert r["tier_nbytes"] == r["spill_nbytes"] == 4 * per_thread
    guard.save()
    day = _file(path)["days"][r["date"]]
    assert day["tier"] + day["spill"] == 8 * per_thread
    guard.check_invariants()
