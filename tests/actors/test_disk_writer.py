"""The disk writer actor: it copies a job's chunk rows only while it holds the engine's capture
lock (one chunk a grant, released after the copy), a fence closes the window of rows not copied
yet (dropped, logged, admitted again by the next plan), a write error fails nothing, and what it
wrote restores through a reopened tier bit for bit a cold prefill."""

import asyncio
import errno
import os
import threading

import pytest
from structlog.testing import capture_logs

from tandem.actors import disk_writer
from tandem.actors.disk_messages import (ClearDisk, DiskCleared, DiskDrained, DiskJob,
                                         DiskStats, DrainDisk, Fence, Fenced, GetDiskStats)
from tandem.actors.disk_writer import DiskWriterActor
from tandem.actors.engine_messages import (CaptureLockGranted, ReleaseCaptureLock,
                                           RequestCaptureLock)
from tandem.actors.harness import Harness
from tandem.cache.namespace import SHARED
from tandem.models.third import ThirdModel

from disk_rig import (GRID, assert_same_as_cold, cold_prefill, head_plan, make_tier,
                      restore_fresh, tokens)

TIMEOUT_S = 30.0


@pytest.fixture
def model():
    return ThirdModel()


@pytest.fixture
def copies(monkeypatch):
    """Every chunk copy the writer takes, in order (its start row)."""
    seen: list[int] = []
    real = disk_writer.host_rows

    def recording(views, start, stop):
        rows = real(views, start, stop)
        seen.append(start)
        return rows

    monkeypatch.setattr(disk_writer, "host_rows", recording)
    return seen


def _job(model, tier, prompt, slot=0):
    plan = head_plan(tier, prompt)
    cold, want, staged = cold_prefill(model, prompt, plan.anchor_lines)
    return plan, cold, want, DiskJob("job-1", slot, plan, staged, cold.cache_state().views,
                                     prompt)


async def _grant(engine, copies, grant_id: int) -> None:
    """The fake engine's turn: the writer asked, has copied nothing since its last release, gets
    the lock, copies one chunk, and releases it."""
    request = await engine.expect(RequestCaptureLock, TIMEOUT_S)
    assert request.holder == "disk_writer"
    before = len(copies)
    request.reply_to.put_nowait(CaptureLockGranted("disk_writer", grant_id))  # as _emit does
    release = await engine.expect(ReleaseCaptureLock, TIMEOUT_S)
    assert release.grant_id == grant_id and len(copies) == before + 1


async def test_the_writer_copies_each_chunk_under_a_grant_and_releases_after_the_copy(
        tmp_path, model, copies):
    tier = make_tier(tmp_path / "disk")
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 1)
    plan, cold, want, job = _job(model, tier, prompt)
    harness = Harness()
    engine = harness.probe("engine")
    writer = harness.add(DiskWriterActor(tier=tier, engine=engine))
    async with harness:
        await harness.inject("disk_writer", job)
        request = await engine.expect(RequestCaptureLock, TIMEOUT_S)
        assert copies == []  # it waits for the grant
        stats = await harness.ask("disk_writer", GetDiskStats(), TIMEOUT_S)
        assert isinstance(stats, DiskStats) and stats.stats["queued_jobs"] == 1
        request.reply_to.put_nowait(CaptureLockGranted("disk_writer", 1))
        assert (await engine.expect(ReleaseCaptureLock, TIMEOUT_S)).grant_id == 1
        assert copies == [0]
        for grant_id in (2, 3, 4):
            await _grant(engine, copies, grant_id)
        assert isinstance(await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S), DiskDrained)
        assert copies == [0, GRID, 2 * GRID, 3 * GRID]
        assert not engine.unread  # four grants, four releases, nothing more
        writer.check_invariants()
    tier.close()
    again = make_tier(tmp_path / "disk")
    assert (len(again.index.chunks), len(again.index.anchors)) == (4, 4)
    offer = again.offer(prompt, SHARED, start=0)
    assert offer.line == 4 * GRID
    assert_same_as_cold(restore_fresh(again, model, prompt, offer), cold, prompt, want)


async def test_a_fence_before_the_copy_drops_the_rows_and_the_head_is_admitted_again(
        tmp_path, model, copies):
    tier = make_tier(tmp_path / "disk")
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 2)
    plan, cold, want, job = _job(model, tier, prompt)
    harness = Harness()
    engine = harness.probe("engine")
    harness.add(DiskWriterActor(tier=tier, engine=engine))
    with capture_logs() as logs:
        async with harness:
            await harness.inject("disk_writer", job)
            request = await engine.expect(RequestCaptureLock, TIMEOUT_S)
            # another slot's fence closes nothing of this one's
            assert await harness.ask("disk_writer", Fence(1, 0), TIMEOUT_S) == Fenced(1, 0)
            # the next request in slot 0 writes from row 2 G on: rows 2 G..4 G are not copied
            assert await harness.ask("disk_writer", Fence(0, 2 * GRID), TIMEOUT_S) == \
                Fenced(0, 2)
            request.reply_to.put_nowait(CaptureLockGranted("disk_writer", 1))
            await engine.expect(ReleaseCaptureLock, TIMEOUT_S)
            await _grant(engine, copies, 2)
            assert isinstance(await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S),
                              DiskDrained)
            assert not engine.unread
    assert copies == [0, GRID]  # nothing at or above the fence's row was read
    assert [e for e in logs if e["event"] == "disk_window_closed"][0]["entries"] == 2
    assert set(tier.index.chunks) == {plan.key(GRID), plan.key(2 * GRID)}
    assert tier.statistics()["window_drops"] == 2 and not tier.admission.pending
    # what was written serves, bit for bit
    offer = tier.offer(prompt, SHARED, start=0)
    assert offer.line == 2 * GRID
    assert_same_as_cold(restore_fresh(tier, model, prompt, offer), cold, prompt, want)
    # the head is admitted again: the chunks it lacks, under the anchors already on disk
    again = head_plan(tier, prompt)
    assert again.chunk_lines == (3 * GRID, 4 * GRID)
    assert set(again.repaired) == {3 * GRID, 4 * GRID}
    tier.check_invariants()


async def test_a_write_error_in_the_writer_fails_nothing_and_it_goes_on(
        tmp_path, model, copies, monkeypatch):
    tier = make_tier(tmp_path / "disk")
    prompt = tokens(model.vocab_size, 2 * GRID + 9, 3)
    plan, cold, want, job = _job(model, tier, prompt)
    real = os.fsync
    calls = []

    def failing(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    harness = Harness()
    writer = harness.add(DiskWriterActor(tier=tier))  # no engine: no lock to take
    with capture_logs() as logs:
        async with harness:
            await harness.inject("disk_writer", job)
            assert isinstance(await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S),
                              DiskDrained)
            stats = (await harness.ask("disk_writer", GetDiskStats(), TIMEOUT_S)).stats
            assert stats["write_failures"] == 1 and stats["writes"] == 3
            writer.check_invariants()
            cleared = await harness.ask("disk_writer", ClearDisk(), TIMEOUT_S)
            assert isinstance(cleared, DiskCleared) and cleared.dropped["files"] == 3
            assert writer.state == "running"
    failed = [e for e in logs if e["event"] == "disk_write_failed"]
    assert len(failed) == 1 and set(failed[0]) >= {"kind", "key", "errno"}
    assert not list(tier.files.entries()) and not tier.files.leftovers()


async def test_a_fence_waits_for_the_copy_under_way_and_drops_the_rest(tmp_path, model,
                                                                       monkeypatch):
    tier = make_tier(tmp_path / "disk")
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 4)
    plan, cold, want, job = _job(model, tier, prompt)
    started, go = threading.Event(), threading.Event()
    real = disk_writer.host_rows

    def held(views, start, stop):
        started.set()
        assert go.wait(TIMEOUT_S)
        return real(views, start, stop)

    monkeypatch.setattr(disk_writer, "host_rows", held)
    harness = Harness()
    engine = harness.probe("engine")
    harness.add(DiskWriterActor(tier=tier, engine=engine))
    async with harness:
        await harness.inject("disk_writer", job)
        request = await engine.expect(RequestCaptureLock, TIMEOUT_S)
        request.reply_to.put_nowait(CaptureLockGranted("disk_writer", 1))
        assert await asyncio.to_thread(started.wait, TIMEOUT_S)  # chunk 0..G being copied
        fence = asyncio.ensure_future(harness.ask("disk_writer", Fence(0, 0), TIMEOUT_S))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not fence.done()  # the copy under way reaches row 0: the fence waits for it
        go.set()
        assert await fence == Fenced(0, 3)
        await engine.expect(ReleaseCaptureLock, TIMEOUT_S)
        await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S)
        assert not engine.unread
    assert set(tier.index.chunks) == {plan.key(GRID)}  # copied before the fence: written
    tier.check_invariants()


async def test_a_bug_in_the_writer_stops_the_actor_rather_than_vanishing(tmp_path, model,
                                                                        monkeypatch):
    tier = make_tier(tmp_path / "disk")
    prompt = tokens(model.vocab_size, 2 * GRID + 9, 5)
    _, _, _, job = _job(model, tier, prompt)

    def broken(*args):
        raise ValueError("a bug")

    monkeypatch.setattr(tier, "write_chunk", broken)
    harness = Harness(check_failures=False)
    writer = harness.add(DiskWriterActor(tier=tier))
    async with harness:
        await harness.inject("disk_writer", job)
        await harness.until_stopped(TIMEOUT_S)
    assert writer.stopped and isinstance(harness.supervisor.exception, ValueError)
