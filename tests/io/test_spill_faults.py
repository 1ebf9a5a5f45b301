"""The session spill's faults (issue 16, "Faults"): kill -9 during saves, a full disk and an I/O
error mid-save, an I/O error mid-restore.

Gate: never a torn entry or another version served. After a kill, every entry the next start
lists restores torch.equal to the last complete save of its conversation (or the save the kill
cut after its manifest landed), and an absent entry is the only other outcome. A failed save
raises ``SpillWriteFailed`` and leaves no entry of its id (the previous one goes with the
manifest, removed first) while other entries stay whole; a failed restore raises
``SpillReadFailed``, deletes the entry and leaves the rows below ``intact_below`` as they
were."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
import torch

from test_session_spill import (Conversation, assert_rows_equal, assert_sections_equal,
                                entry_dir, meta_of, open_spill)
from tandem.engine import Engine
from tandem.io import direct, spill as spill_module
from tandem.io.spill import SessionSpill, SpillReadFailed, SpillWriteFailed
from tandem.models.third import ThirdModel
from tier_rig import GRID, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from spill_kill_check import run_check  # noqa: E402

# The stepped targets first: their kill points follow from the seed alone.
TARGETS = ["save", "manifest", "landed", "delete", "start", "manifest", "save", "drift",
           "drift"]


@pytest.fixture(scope="module")
def third():
    return ThirdModel()


# -- kill -9 ----------------------------------------------------------------------------------

def test_a_saver_killed_at_every_kind_of_point_leaves_no_torn_entry_served(tmp_path, third):
    summary = run_check(tmp_path / "sessions", len(TARGETS), 16, third, targets=TARGETS)
    assert summary.failures == []
    assert summary.kills == summary.runs == len(TARGETS) and not summary.missed
    assert summary.before_call["rename"] >= 2  # two kills just before a manifest landed
    # the kills left saves cut short, which the starts deleted, and whole entries, restored
    assert summary.dropped["unfinished"] >= 2 and summary.entries_verified >= 2


def _drain_skipped():
    """A saver whose manifest does not wait for its writes (the bug the pipe's drain exists
    to prevent), on a slow disk: the manifest lands while the last files are being written."""
    import time
    spill_module._WritePipe.drain = lambda self: None
    real = SessionSpill._put_file

    def slow(self, *a, **kw):
        time.sleep(0.02)
        return real(self, *a, **kw)

    SessionSpill._put_file = slow


def test_the_check_finds_the_torn_entries_of_a_saver_whose_manifest_outruns_its_writes(
        tmp_path, third):
    summary = run_check(tmp_path / "sessions", 6, 16, third, targets=["landed"],
                        writer_fault=_drain_skipped)
    assert any("must never leave" in f or "torn" in f for f in summary.failures), \
        summary.failures


# -- a full disk and an I/O error mid-save ---------------------------------------------------

def _fail_at(monkeypatch, cls, name: str, at: int, code: int) -> list[int]:
    real = getattr(cls, name)
    calls: list[int] = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == at:
            raise OSError(code, errno.errorcode[code])
        return real(*a, **kw)

    monkeypatch.setattr(cls, name, failing)
    return calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("where", ["first write", "a middle write", "last write", "fsync",
                                   "manifest"])
def test_a_failed_save_serves_nothing_wrong_and_leaves_the_other_entries_whole(
        hybrid, tmp_path, monkeypatch, code, where):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 41), decoded=4)
    other = Conversation(hybrid, tokens(hybrid.vocab_size, 140, 42), decoded=2)
    meta, kept = meta_of("failing"), meta_of("kept")
    root = tmp_path / "sessions"
    with open_spill(root) as spill:
        conv.save(spill, meta)
        other.save(spill, kept)
        conv.extend(tokens(hybrid.vocab_size, 100, 43), decoded=2)
        # rows [0, 192) and the anchors at 64-192 are kept: blocks 3 and 4, the anchor at
        # 256 and the end are the save's 4 files
        files = {"first write": 1, "a middle write": 2, "last write": 4, "fsync": 3,
                 "manifest": 1}[where]
        if where == "fsync":
            calls = _fail_at(monkeypatch, direct.DirectFile, "finish_write", files, code)
        elif where == "manifest":
            calls = _fail_at(monkeypatch, spill_module, "write_atomic_at", files, code)
        else:
            calls = _fail_at(monkeypatch, direct.DirectFile, "pwrite_from", files, code)
        with pytest.raises(SpillWriteFailed) as err:
            conv.save(spill, meta)
        monkeypatch.undo()
        assert err.value.errno == code and calls == [1] * files
        assert set(spill.entries()) == {kept.entry_id}
        assert not (root / meta.entry_id).exists()
        offer = spill.offer(conv.engine.token_ids, meta.namespace)
        assert offer is None or offer.entry_id == kept.entry_id
    # A new start agrees: only the other entry, whole.
    with open_spill(root) as spill:
        assert set(spill.entries()) == {kept.entry_id} and spill.dropped_at_open == {}
        fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
        spill.restore(kept.entry_id, fresh.cache_state(), [])
        assert_rows_equal(other.engine, fresh, other.valid)
        assert_sections_equal(fresh.cache_state().sections, other.engine.cache_state().sections)
        # and the conversation saves again whole once the disk answers
        report = conv.save(spill, meta)
        assert report.blocks_written == -(-conv.valid // GRID)


def test_a_failed_write_stops_the_save_within_one_file(hybrid, tmp_path, monkeypatch):
    """The pipe: a write that failed is seen at the next stage taken, so a save encodes at most
    one more file after it and writes none."""
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 44), decoded=4)
    with open_spill(tmp_path / "sessions") as spill:
        writes = _fail_at(monkeypatch, direct.DirectFile, "pwrite_from", 1, errno.EIO)
        encoded = []
        real = SessionSpill._write_file
        monkeypatch.setattr(SessionSpill, "_write_file",
                            lambda self, *a, **kw: encoded.append(1) or real(self, *a, **kw))
        with pytest.raises(SpillWriteFailed):
            conv.save(spill, meta_of())
        assert len(writes) == 1 and len(encoded) <= 3  # of 10 files


# -- an I/O error mid-restore ---------------------------------------------------------------

@pytest.mark.parametrize("at", [1, 2, "anchor"])
def test_an_io_error_mid_restore_deletes_the_entry_and_leaves_the_rows_below_intact(
        hybrid, tmp_path, monkeypatch, at):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 45), decoded=12)
    meta = meta_of()
    with open_spill(tmp_path / "sessions") as spill:
        conv.save(spill, meta)
        m = spill.entries()[meta.entry_id]
        fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
        fresh.prefill(conv.engine.token_ids[:150])  # blocks 0 and 1 in place
        state = fresh.cache_state()
        before = {k: v.tensor.clone() for k, v in state.views.items()}
        sections = {k: t.clone() for k, t in state.sections.items()}
        todo = len(m.blocks) - 2
        nth = {1: 1, 2: 2, "anchor": todo + 1}[at]  # the reads: the blocks, then the anchors
        _fail_at(monkeypatch, direct.DirectFile, "pread_into", nth, errno.EIO)
        with pytest.raises(SpillReadFailed) as err:
            spill.restore(meta.entry_id, state, fresh.token_ids)
        monkeypatch.undo()
        assert err.value.reason == "io" and err.value.intact_below == 2 * GRID
        assert not entry_dir(spill, meta.entry_id).exists() and spill.entries() == {}
        assert spill.offer(conv.engine.token_ids, meta.namespace) is None
        for name, v in state.views.items():
            assert torch.equal(v.rows(0, 2 * GRID), before[name].narrow(v.token_axis, 0,
                                                                        2 * GRID)), name
        for name, t in state.sections.items():  # the end is set only after every check
            assert torch.equal(t, sections[name]), name
