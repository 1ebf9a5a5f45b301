"""The spill's overlap (issue 16, part 5: "two writer threads so one block compresses while the
one before is written; the restore decompresses while the engine copies the block before").

Gate: the overlapped save writes the very files the one-step-at-a-time save writes (bytes and
names), and the overlapped restore gives back the same rows; each overlap is shown by a file
that waits, with a timeout, for the next file's work to have started: it never does when the
steps run one after another."""

from __future__ import annotations

import threading

import pytest
import torch

# any_model and hybrid_bf16 are test_session_spill's fixtures, imported to be used here
from test_session_spill import (Conversation, any_model, assert_rows_equal,  # noqa: F401
                                assert_sections_equal, entry_dir, flip, hybrid_bf16, meta_of,
                                open_spill)
from tandem.engine import Engine
from tandem.io.spill import SessionSpill, SpillReadFailed
from tier_rig import GRID, tokens

WAIT_S = 5.0


def folder_bytes(spill: SessionSpill, eid: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((spill.root / eid).iterdir())}


def test_the_overlapped_save_writes_the_files_the_serial_one_writes_bit_for_bit(any_model,
                                                                                  tmp_path):
    conv = Conversation(any_model, tokens(any_model.vocab_size, 250, 31), decoded=9)
    meta = meta_of()
    with open_spill(tmp_path / "a") as fast, open_spill(tmp_path / "b", overlap=False) as slow:
        first = conv.save(fast, meta), conv.save(slow, meta)
        assert folder_bytes(fast, meta.entry_id) == folder_bytes(slow, meta.entry_id)
        conv.extend(tokens(any_model.vocab_size, 90, 32), decoded=4)  # an incremental rewrite
        second = conv.save(fast, meta), conv.save(slow, meta)
        assert folder_bytes(fast, meta.entry_id) == folder_bytes(slow, meta.entry_id)
        for a, b in (first, second):
            assert (a.blocks_written, a.blocks_kept, a.nbytes_written) == (
                b.blocks_written, b.blocks_kept, b.nbytes_written)
        assert second[0].blocks_kept == 4  # rows [0, 256) did not move

        engines = []
        for spill in (fast, slow):
            fresh = Engine(any_model, window=640, prefix_chunk=GRID)
            got = spill.restore(meta.entry_id, fresh.cache_state(), [])
            assert got.line == conv.valid
            engines.append((fresh, got))
        for fresh, got in engines:
            assert_rows_equal(conv.engine, fresh, conv.valid)
            assert_sections_equal(fresh.cache_state().sections,
                                  conv.engine.cache_state().sections)
        (_, a), (_, b) = engines
        assert sorted(a.anchors) == sorted(b.anchors)
        for line in a.anchors:
            assert_sections_equal(a.anchors[line], b.anchors[line])


def save_overlaps(spill: SessionSpill, conv: Conversation, monkeypatch) -> bool:
    """Whether the first file's write saw the second file's encoding begin."""
    next_encoding = threading.Event()
    real_write_file, real_put = SessionSpill._write_file, SessionSpill._put_file
    calls, seen = [], []

    def write_file(self, *a, **kw):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            next_encoding.set()
        return real_write_file(self, *a, **kw)

    def put_file(self, *a, **kw):
        if not seen:
            seen.append((next_encoding.wait(WAIT_S), threading.current_thread().name))
        return real_put(self, *a, **kw)

    monkeypatch.setattr(SessionSpill, "_write_file", write_file)
    monkeypatch.setattr(SessionSpill, "_put_file", put_file)
    conv.save(spill, meta_of())
    monkeypatch.undo()
    overlapped, writer = seen[0]
    assert calls[0] == threading.current_thread().name  # the encoding: the caller's thread
    return overlapped and writer.startswith("spill-io")


def restore_overlaps(spill: SessionSpill, model, monkeypatch) -> bool:
    """Whether the first file's check saw the second file's read begin."""
    next_read = threading.Event()
    real_read, real_check = SessionSpill._read_file, SessionSpill._check_file
    reads, seen = [], []

    def read_file(self, *a, **kw):
        reads.append(threading.current_thread().name)
        if len(reads) == 2:
            next_read.set()
        return real_read(self, *a, **kw)

    def check_file(self, *a, **kw):
        if not seen:
            seen.append(next_read.wait(WAIT_S))
        return real_check(self, *a, **kw)

    monkeypatch.setattr(SessionSpill, "_read_file", read_file)
    monkeypatch.setattr(SessionSpill, "_check_file", check_file)
    fresh = Engine(model, window=640, prefix_chunk=GRID)
    spill.restore(meta_of().entry_id, fresh.cache_state(), [])
    monkeypatch.undo()
    return seen[0] and all(name.startswith("spill-io") for name in reads)


def test_a_save_encodes_the_next_block_while_the_one_before_is_written(hybrid, tmp_path,
                                                                       monkeypatch):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 33), decoded=3)
    with open_spill(tmp_path / "a") as spill:
        assert save_overlaps(spill, conv, monkeypatch)


def test_a_restore_reads_the_next_block_while_the_one_before_is_checked_and_copied(
        hybrid, tmp_path, monkeypatch):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 34), decoded=3)
    with open_spill(tmp_path / "a") as spill:
        conv.save(spill, meta_of())
        assert restore_overlaps(spill, hybrid, monkeypatch)


def test_the_serial_spill_overlaps_nothing_so_the_checks_above_can_fail(hybrid, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr("test_spill_overlap.WAIT_S", 0.2)
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 35), decoded=3)
    with open_spill(tmp_path / "a", overlap=False) as spill:
        assert not save_overlaps(spill, conv, monkeypatch)
        assert not restore_overlaps(spill, hybrid, monkeypatch)


def test_close_ends_the_spills_io_thread(hybrid, tmp_path):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 36), decoded=2)
    spill = open_spill(tmp_path / "a")
    conv.save(spill, meta_of())
    assert any(t.name.startswith("spill-io") for t in threading.enumerate())
    spill.close()
    assert not any(t.name.startswith("spill-io") for t in threading.enumerate())


def test_a_restores_check_still_runs_before_a_row_of_the_block_is_written(hybrid_bf16,
                                                                          tmp_path):
    """A bad second block: the first block's rows were copied (they passed), the bad one's
    rows never are, whatever was read ahead."""
    conv = Conversation(hybrid_bf16, tokens(hybrid_bf16.vocab_size, 300, 37), decoded=5)
    meta = meta_of()
    with open_spill(tmp_path / "a") as spill:
        conv.save(spill, meta)
        m = spill.entries()[meta.entry_id]
        bad = m.blocks[1]
        flip(entry_dir(spill, meta.entry_id) / bad.name,
             bad.parts[0].offset + bad.parts[0].header.nbytes // 2)
        fresh = Engine(hybrid_bf16, window=640, prefix_chunk=GRID)
        before = {k: v.tensor.clone() for k, v in fresh.cache_state().views.items()}
        with pytest.raises(SpillReadFailed) as err:
            spill.restore(meta.entry_id, fresh.cache_state(), [])
        assert err.value.intact_below == 0 and err.value.reason in ("sums", "codec")
        for name, v in fresh.cache_state().views.items():
            assert torch.equal(v.rows(0, GRID), conv.engine.cache_state().views[name].rows(0, GRID))
            assert torch.equal(v.rows(GRID, conv.valid), before[name].narrow(
                v.token_axis, GRID, conv.valid - GRID))


def test_a_restore_reads_several_files_ahead_while_the_first_is_checked(hybrid, tmp_path,
                                                                        monkeypatch):
    # A small file's read is mostly the disk's latency: the readers keep READ_AHEAD of them
    # in flight, each in its own slot, and the rows still come back bit for bit.
    from tandem.io import spill as spill_module

    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 400, 37), decoded=3)
    started, enough = [], threading.Event()
    real_read, real_check = SessionSpill._read_file, SessionSpill._check_file
    seen = []

    def read_file(self, fd, rec, slot):
        started.append(slot)
        if len(started) >= 1 + spill_module.READ_AHEAD:
            enough.set()
        return real_read(self, fd, rec, slot)

    def check_file(self, *a, **kw):
        if not seen:
            seen.append(enough.wait(WAIT_S))
        return real_check(self, *a, **kw)

    with open_spill(tmp_path / "a") as spill:
        conv.save(spill, meta_of())
        monkeypatch.setattr(SessionSpill, "_read_file", read_file)
        monkeypatch.setattr(SessionSpill, "_check_file", check_file)
        fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
        spill.restore(meta_of().entry_id, fresh.cache_state(), [])
    assert seen == [True]
    slots = 1 + spill_module.READ_AHEAD
    assert started == [i % slots for i in range(len(started))]  # file i in slot i % S
    assert_rows_equal(fresh, conv.engine, conv.valid)
