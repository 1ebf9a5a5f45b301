"""The spill writer actor (issue 16, parts 6, 7 and 8): a save through it is the spill's own
entry, restored bit for bit; the write guard's levels decide what an eviction may write (a
drain always); an I/O error answers ``failed`` and the writer goes on; its mailbox answers while
a save runs; the disk writer gives the drive to a save, not longer than its cap; the sweep runs
on the actor's clock; a clear and a drain.

Gate: torch.equal (an entry holds the bytes the engine held) and the same next-token logits."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from disk_rig import GRID, cold_prefill, head_plan, make_tier, tokens
from small_hybrid import make_small_hybrid
from tandem.actors.disk_messages import DiskDrained, DiskJob, DrainDisk
from tandem.actors.disk_writer import DiskWriterActor
from tandem.actors.harness import FakeClock, Harness
from tandem.actors.spill_messages import (ClearSpill, DrainSpill, GetSpillStats, SpillCleared,
                                          SpillDrained, SpillRestore, SpillRestored, SpillSave,
                                          SpillSaved, SpillStats)
from tandem.actors.spill_writer import SpillWriterActor
from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import namespace_of
from tandem.engine import Engine
from tandem.io import write_guard
from tandem.io.fingerprint import Identity
from tandem.io.spill import EntryMeta, SessionSpill, SpillEnd, session_digest
from tandem.io.turns import IoTurns
from tandem.io.write_guard import WriteGuard
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

TIMEOUT_S = 30.0
FP = "0f" * 32
T0 = 1_800_000_000.0
HOUR = 3600.0
TIME_KEYS = {"writer", "lock", "waits", "staging", "sums", "copy", "compress", "write", "fsync",
             "anchors", "manifest", "total"}


class Wall:
    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> HybridModel:
    # the small hybrid with long recurrent memory: a row lost or wrong changes the next turn
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(params=["hybrid", "third"])
def model(request, hybrid):
    return hybrid if request.param == "hybrid" else ThirdModel()


@pytest.fixture
def wall():
    return Wall()


@pytest.fixture
def guard(tmp_path, wall):
    return WriteGuard(tmp_path / "writes.json", budget_gb=1.0, clock=wall)


@pytest.fixture
def spill(tmp_path, guard, wall):
    s = SessionSpill(tmp_path / "sessions", Identity(FP), GRID, wall=wall, guard=guard)
    s.open()
    yield s
    s.close()


class Conversation:
    """A cold prefill with a grid anchor at every line it passes, then decoded tokens: rows an
    engine really wrote, and its end."""

    def __init__(self, model, prompt: list[int], decoded: int, key: str = "chat-1"):
        self.engine = Engine(model, window=640, prefix_chunk=GRID)
        self.anchors: dict[int, SectionsCopy] = {}
        self.meta = EntryMeta(session_digest(key), namespace_of(None), self.engine.taint)
        eng = self.engine

        def on_chunk(end: int) -> None:
            if end % GRID == 0:
                self.anchors[end] = SectionsCopy.take(eng.cache_state())

        logits = eng.prefill(prompt, on_chunk=on_chunk)
        for _ in range(decoded):
            logits = eng.decode(int(torch.argmax(logits)))
        self.logits = logits

    @property
    def valid(self) -> int:
        return self.engine.length

    def save(self, reason="evict", slot=0) -> SpillSave:
        eng = self.engine
        end = SpillEnd(self.valid, SectionsCopy.take(eng.cache_state()).tensors,
                       {"hidden": [], "regions": []})
        return SpillSave(reason, slot, self.meta.entry_id, eng.cache_state(), self.valid,
                         list(eng.token_ids), self.anchors, end, self.meta)


def writer_in(harness: Harness, spill, **kw) -> SpillWriterActor:
    return harness.add(SpillWriterActor(spill=spill, **kw))


async def ask(harness, msg):
    return await harness.ask("spill_writer", msg, TIMEOUT_S)


# -- a save and a restore through the actor ------------------------------------------------

async def test_a_save_through_the_writer_restores_into_a_fresh_state_bit_for_bit(
        model, spill, guard):
    conv = Conversation(model, tokens(model.vocab_size, 300, 1), decoded=21)
    harness = Harness()
    writer = writer_in(harness, spill)
    with capture_logs() as logs:
        async with harness:
            saved = await ask(harness, conv.save())
            assert isinstance(saved, SpillSaved) and saved.skipped == ""
            assert saved.report.blocks_written == -(-conv.valid // GRID)
            fresh = Engine(model, window=640, prefix_chunk=GRID)
            got = await ask(harness, SpillRestore(conv.meta.entry_id, fresh.cache_state(), []))
            assert isinstance(got, SpillRestored) and got.failed == ""
            writer.check_invariants()
            stats = (await ask(harness, GetSpillStats())).stats
    r = got.report
    assert r.line == conv.valid and r.token_ids == conv.engine.token_ids
    for name, v in conv.engine.cache_state().views.items():
        assert torch.equal(fresh.cache_state().views[name].rows(0, conv.valid),
                           v.rows(0, conv.valid)), name
    for name, t in conv.engine.cache_state().sections.items():
        assert torch.equal(fresh.cache_state().sections[name], t), name
    assert sorted(r.anchors) == [64, 128, 192, 256]
    for line, copy in r.anchors.items():
        for name, t in conv.anchors[line].tensors.items():
            assert torch.equal(copy.tensors[name], t), (line, name)
    fresh.resume_at(r.line, r.token_ids, taint=r.taint)
    nxt = int(torch.argmax(conv.logits))
    assert torch.equal(fresh.decode(nxt), conv.engine.decode(nxt))

    # every byte the save wrote is in the day's count, once (the spill adds it, not the actor)
    written = saved.report.nbytes_written + saved.report.manifest_nbytes
    assert guard.report()["spill_nbytes"] == written == stats["nbytes_written"]
    assert stats["saves"] == 1 and stats["saves_by_reason"]["evict"] == 1
    assert stats["restores"] == 1 and stats["entries"] == 1
    assert stats["last_save"]["rows"] == r.line  # conv decoded one more since
    # one line a save, with where its time went
    lines = [e for e in logs if e["event"] == "spill_saved"]
    assert len(lines) == 1
    assert {f"{k}_ms" for k in TIME_KEYS} <= set(lines[0])
    assert set(saved.ms) >= TIME_KEYS


# -- the write guard -------------------------------------------------------------------------

async def test_the_guards_levels_decide_what_an_eviction_writes_and_a_drain_is_always_written(
        hybrid, spill, guard, monkeypatch):
    short = Conversation(hybrid, tokens(hybrid.vocab_size, 100, 2), decoded=3, key="a")
    long_ = Conversation(hybrid, tokens(hybrid.vocab_size, 250, 3), decoded=3, key="b")
    # over the budget an eviction of SPILL_OVER_MIN_TOKENS or more is still written: 200 here,
    # so that "long" need not be 32,768 tokens
    monkeypatch.setattr(write_guard, "SPILL_OVER_MIN_TOKENS", 200)
    harness = Harness()
    writer_in(harness, spill)
    with capture_logs() as logs:
        async with harness:
            assert (await ask(harness, short.save("park"))).skipped == ""  # ok: written
            spill.clear()
            guard.add(guard.budget_nbytes, "tier")
            assert guard.level() == "over"
            assert (await ask(harness, short.save("evict"))).skipped == "guard"
            assert (await ask(harness, short.save("store_restore"))).skipped == "guard"
            assert (await ask(harness, long_.save("evict"))).skipped == ""
            assert (await ask(harness, short.save("drain"))).skipped == ""
            guard.add(guard.budget_nbytes, "tier")
            assert guard.level() == "hard"
            assert (await ask(harness, long_.save("evict"))).skipped == "guard"
            assert (await ask(harness, long_.save("drain"))).skipped == ""
            stats = (await ask(harness, GetSpillStats())).stats
    assert stats["skips"]["guard"] == 3 and stats["skips_total"] == 3
    assert stats["saves"] == 4
    skips = [e for e in logs if e["event"] == "disk_guard_skip"]
    assert [(e["who"], e["why"], e["tokens"]) for e in skips] == [
        ("spill", "over", short.valid), ("spill", "over", short.valid),
        ("spill", "hard", long_.valid)]
    assert guard.report()["skip_reasons"]["spill"] == {"over": 2, "hard": 1}
    journal = [e for e in guard.drain_events() if e["who"] == "spill"]
    assert len(journal) == 3  # held for the journal


# -- faults ----------------------------------------------------------------------------------

async def test_an_io_error_mid_save_answers_failed_and_the_writer_goes_on(
        hybrid, spill, monkeypatch):
    from tandem.io import direct
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 4), decoded=4)
    real = direct.DirectFile.pwrite_from
    calls = []

    def eio(self, buf, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(self, buf, offset)

    monkeypatch.setattr(direct.DirectFile, "pwrite_from", eio)
    harness = Harness()
    writer = writer_in(harness, spill)
    with capture_logs() as logs:
        async with harness:
            saved = await ask(harness, conv.save())
            assert saved.skipped == "failed" and saved.report is None
            assert spill.entries() == {}
            again = await ask(harness, conv.save())  # the third write on: no error
            assert again.skipped == "" and not writer.stopped
            stats = (await ask(harness, GetSpillStats())).stats
    assert stats["failures"] == 1 and stats["skips"]["failed"] == 1 and stats["saves"] == 1
    assert [e["errno"] for e in logs if e["event"] == "spill_save_failed"] == [5]


async def test_a_bug_in_a_save_stops_the_writer_rather_than_vanishing(hybrid, spill,
                                                                      monkeypatch):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 100, 5), decoded=2)

    def broken(*args, **kw):
        raise ValueError("a bug")

    monkeypatch.setattr(spill, "save", broken)
    harness = Harness(check_failures=False)
    writer = writer_in(harness, spill)
    async with harness:
        with pytest.raises(ValueError):
            await ask(harness, conv.save())
        await harness.until_stopped(TIMEOUT_S)
    assert writer.stopped and isinstance(harness.supervisor.exception, ValueError)


# -- its own I/O path ------------------------------------------------------------------------

async def test_stats_are_answered_while_a_save_waits_and_the_wait_is_timed_as_lock(
        hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 6), decoded=2)
    harness = Harness()
    writer_in(harness, spill)
    async with harness:
        spill.io_lock.acquire()  # an engine-thread restore under way
        try:
            save = asyncio.ensure_future(ask(harness, conv.save()))
            await asyncio.sleep(0)  # one turn of the loop: the save is in the mailbox first
            stats = await ask(harness, GetSpillStats())
            assert isinstance(stats, SpillStats) and stats.stats["queued"] == 1
            assert not save.done() and stats.stats["saves"] == 0
        finally:
            spill.io_lock.release()
        saved = await asyncio.wait_for(save, TIMEOUT_S)
    assert saved.skipped == "" and saved.ms["lock"] > 0.0


def test_an_engine_thread_restore_waits_for_the_save_under_way(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 7), decoded=3)
    msg = conv.save()
    spill.save(msg.entry_id, msg.state, msg.valid, msg.token_ids, msg.anchors, msg.end,
               msg.meta)
    in_save, release = threading.Event(), threading.Event()
    real = spill._save

    def slow_save(*args, **kw):
        in_save.set()
        assert release.wait(TIMEOUT_S)
        return real(*args, **kw)

    spill._save = slow_save
    saver = threading.Thread(target=spill.save, args=(
        msg.entry_id, msg.state, msg.valid, msg.token_ids, msg.anchors, msg.end, msg.meta))
    saver.start()
    assert in_save.wait(TIMEOUT_S)
    fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
    got = []
    reader = threading.Thread(target=lambda: got.append(
        spill.restore(msg.entry_id, fresh.cache_state(), [])))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # it waits for the save's io_lock
    release.set()
    saver.join(TIMEOUT_S)
    reader.join(TIMEOUT_S)
    assert got and got[0].line == conv.valid and got[0].ms["lock"] >= 200.0


def _disk_job(model, tier, seed):
    prompt = tokens(model.vocab_size, 2 * GRID + 9, seed)
    plan = head_plan(tier, prompt)
    cold, _, staged = cold_prefill(model, prompt, plan.anchor_lines)
    return DiskJob("job-1", 0, plan, staged, cold.cache_state().views, prompt)


async def test_the_disk_writer_waits_between_its_files_while_a_save_runs(tmp_path):
    model = ThirdModel()
    tier = make_tier(tmp_path / "disk")
    turns = IoTurns()
    job = _disk_job(model, tier, 8)
    harness = Harness()
    writer = harness.add(DiskWriterActor(tier=tier, spill_turns=lambda: turns))
    with capture_logs() as logs:
        async with harness:
            with turns.save():  # a spill save runs
                await harness.inject("disk_writer", job)
                assert await asyncio.to_thread(turns.file_waiting.wait, TIMEOUT_S)
                assert tier.counters["writes"] == 0  # the first file waits for the save
            assert isinstance(await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S),
                              DiskDrained)
    assert tier.counters["writes"] == 4  # two chunks, two anchors
    waits = [e for e in logs if e["event"] == "disk_writer_waited_for_spill"]
    assert len(waits) == 1 and not waits[0]["capped"]  # after the save, no file waited
    assert writer.counters["spill_waits"] == 1


async def test_a_save_longer_than_the_cap_holds_the_disk_writer_no_longer_than_it(tmp_path):
    model = ThirdModel()
    tier = make_tier(tmp_path / "disk")
    turns = IoTurns()
    job = _disk_job(model, tier, 9)
    harness = Harness()
    writer = harness.add(DiskWriterActor(tier=tier, spill_turns=turns, spill_wait_s=0.05))
    with capture_logs() as logs:
        async with harness:
            with turns.save():  # a save that outlasts the whole job
                await harness.inject("disk_writer", job)
                assert isinstance(await harness.ask("disk_writer", DrainDisk(), TIMEOUT_S),
                                  DiskDrained)
                assert tier.counters["writes"] == 4
    waits = [e for e in logs if e["event"] == "disk_writer_waited_for_spill"]
    assert len(waits) == 4 and all(e["capped"] and e["ms"] >= 50.0 for e in waits)
    assert writer.counters["spill_waits_capped"] == 4


def test_a_save_waits_for_the_disk_writers_file_under_way_and_reports_it():
    turns = IoTurns()
    in_file, release = threading.Event(), threading.Event()

    def one_file():
        with turns.file():
            in_file.set()
            assert release.wait(TIMEOUT_S)

    t = threading.Thread(target=one_file)
    t.start()
    assert in_file.wait(TIMEOUT_S)
    threading.Timer(0.1, release.set).start()
    with turns.save() as waited_ms:
        assert waited_ms >= 90.0  # the file's end, not the cap
        assert release.is_set()
    t.join(TIMEOUT_S)


# -- budget and TTL --------------------------------------------------------------------------

async def test_the_writer_sweeps_at_start_and_every_few_minutes_on_its_clock(
        hybrid, spill, wall):
    old = Conversation(hybrid, tokens(hybrid.vocab_size, 100, 10), decoded=2, key="old")
    new = Conversation(hybrid, tokens(hybrid.vocab_size, 100, 11), decoded=2, key="new")
    for conv in (old, new):
        m = conv.save()
        spill.save(m.entry_id, m.state, m.valid, m.token_ids, m.anchors, m.end, m.meta)
    wall.now += 49 * HOUR  # both unused for longer than the TTL
    new_used = spill.offer(new.engine.token_ids, new.meta.namespace)
    fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
    spill.restore(new_used.entry_id, fresh.cache_state(), [])  # "new" is used now
    clock = FakeClock()
    harness = Harness()
    writer_in(harness, spill, clock=clock, sweep_every_s=300.0)
    async with harness:
        assert set(spill.entries()) == {new.meta.entry_id}  # the start's sweep took "old"
        await clock.until_sleeping(1, TIMEOUT_S)
        wall.now += 49 * HOUR
        clock.advance(300.0)
        await clock.until_sleeping(1, TIMEOUT_S)  # asleep again: the sweep is done
        stats = (await ask(harness, GetSpillStats())).stats
    assert spill.entries() == {} and stats["sweeps"] == 2 and stats["swept"] == 2


async def test_a_save_through_the_writer_makes_room_by_evicting_the_least_recently_used(
        hybrid, tmp_path, wall):
    a = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 12), decoded=2, key="a")
    b = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 13), decoded=2, key="b")
    with SessionSpill(tmp_path / "probe", Identity(FP), GRID, wall=wall) as probe:
        probe.open()
        m = b.save()
        raw_b = probe.save(m.entry_id, m.state, m.valid, m.token_ids, m.anchors, m.end,
                           m.meta).raw_nbytes_written
    # room for b alone: a must go for it
    spill = SessionSpill(tmp_path / "sessions", Identity(FP), GRID, wall=wall,
                         budget_nbytes=raw_b)
    spill.open()
    harness = Harness()
    writer_in(harness, spill)
    async with harness:
        assert (await ask(harness, a.save())).skipped == ""
        wall.now += 1
        saved = await ask(harness, b.save())
    spill.close()
    assert saved.skipped == "" and saved.report.evicted == 1
    assert set(spill.entries()) == {b.meta.entry_id}


# -- clear and drain -------------------------------------------------------------------------

async def test_a_clear_empties_the_spill_and_a_drain_waits_for_every_save_told_before_it(
        hybrid, spill):
    convs = [Conversation(hybrid, tokens(hybrid.vocab_size, 100, 14 + i), decoded=2,
                          key=f"c{i}") for i in range(2)]
    harness = Harness()
    writer_in(harness, spill)
    async with harness:
        for conv in convs:
            await harness.inject("spill_writer", conv.save("drain"))  # told, not asked
        assert isinstance(await ask(harness, DrainSpill()), SpillDrained)
        assert set(spill.entries()) == {c.meta.entry_id for c in convs}
        nbytes = spill.nbytes
        cleared = await ask(harness, ClearSpill())
        assert isinstance(cleared, SpillCleared)
        assert cleared.dropped == {"entries": 2, "nbytes": nbytes}
        assert spill.entries() == {} and not any(Path(spill.root).iterdir())


async def test_a_writer_without_a_spill_answers_off(hybrid):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 70, 16), decoded=1)
    harness = Harness()
    writer_in(harness, lambda: None)
    async with harness:
        assert (await ask(harness, conv.save())).skipped == "off"
        assert (await ask(harness, GetSpillStats())).stats == {"on": False}
        assert isinstance(await ask(harness, DrainSpill()), SpillDrained)


# -- the capture lock (issue 20, part 3) ---------------------------------------------------

async def _save_granting(harness, engine, msg) -> tuple[SpillSaved, int]:
    """Ask the save while the fake engine grants every request of the writer in turn, each
    released before the next is asked; the reply and how many grants it took."""
    from tandem.actors.engine_messages import (CaptureLockGranted, ReleaseCaptureLock,
                                               RequestCaptureLock)

    reply = asyncio.ensure_future(ask(harness, msg))
    grants = 0
    while not reply.done():
        request = asyncio.ensure_future(engine.expect(RequestCaptureLock, TIMEOUT_S))
        await asyncio.wait({reply, request}, return_when=asyncio.FIRST_COMPLETED)
        if not request.done():
            request.cancel()
            break
        grants += 1
        request.result().reply_to.put_nowait(CaptureLockGranted("spill_writer", grants))
        release = await engine.expect(ReleaseCaptureLock, TIMEOUT_S)
        assert release.grant_id == grants
    return await reply, grants


async def test_a_save_of_device_rows_holds_a_grant_around_each_files_device_work(
        hybrid, spill, monkeypatch):
    from tandem.actors import spill_writer

    # the rows taken for a device's (the CPU has none): the grants are what CUDA gets
    monkeypatch.setattr(spill_writer, "on_device", lambda state: True)
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 1), decoded=21)
    harness = Harness()
    engine = harness.probe("engine")
    writer = harness.add(SpillWriterActor(spill=spill, engine=engine))
    async with harness:
        saved, grants = await _save_granting(harness, engine, conv.save())
        assert saved.skipped == ""
        r = saved.report
        # the sums (one step), then each buffer's planes and their copy, each under its own:
        # a block's views, an anchor's (and the end's) sections
        state = conv.engine.cache_state()
        assert grants == (1 + r.blocks_written * len(state.views)
                          + r.anchors_written * len(state.sections))
        assert writer.counters["grants"] == grants
        # the drain's sender keeps the device still: no grant asked, none waited for
        conv.engine.decode(5)
        msg = msgspec.structs.replace(conv.save("drain"), locked=True)
        drained, grants = await _save_granting(harness, engine, msg)
        assert drained.skipped == "" and grants == 0
        assert not engine.unread


async def test_a_save_of_host_rows_asks_no_grant(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 2), decoded=3)
    harness = Harness()
    engine = harness.probe("engine")
    harness.add(SpillWriterActor(spill=spill, engine=engine))
    async with harness:
        saved, grants = await _save_granting(harness, engine, conv.save())
        assert saved.skipped == "" and grants == 0
