"""The session spill's entries (tandem.io.spill; issue 16, parts 1, 3, 4 and 7) on the small
long-memory hybrid and the third architecture, bf16 and fp32.

Gate: torch.equal. A spill entry holds the bytes the engine held, so a restore gives back every
row, the end anchor and the grid anchors bit for bit, and the next turn's logits from the
restored engine equal the ones of the engine that never lost its rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import SHARED, namespace_of
from tandem.engine import Engine
from tandem.io.fingerprint import FingerprintInputs, Identity, fingerprint
from tandem.io.spill import (MANIFEST, EntryMeta, SessionSpill,
                             SpillEnd, SpillReadFailed, manifest_bytes, parse_manifest,
                             session_digest)
from tandem.io.spill_codec import RAW
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel
from tier_rig import GRID, tokens

FP = "0f" * 32
HOUR = 3600.0
T0 = 1_800_000_000.0  # a wall time the tests set, so that no test reads the clock


@pytest.fixture(scope="module")
def hybrid_bf16(hybrid_dir) -> HybridModel:
    return HybridModel.load(hybrid_dir, dtype=torch.bfloat16)


@pytest.fixture(params=[("hybrid", "float32"), ("hybrid", "bfloat16"), ("third", "float32"),
                        ("third", "bfloat16")], ids=lambda p: "-".join(p))
def any_model(request, hybrid, hybrid_bf16):
    arch, dtype = request.param
    if arch == "hybrid":
        return hybrid if dtype == "float32" else hybrid_bf16
    return ThirdModel(dtype=getattr(torch, dtype))


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now


def open_spill(root: Path, identity: Identity | None = None, **kw) -> SessionSpill:
    spill = SessionSpill(root, identity or Identity(FP), GRID, wall=kw.pop("wall", Clock()),
                         **kw)
    spill.open()
    return spill


@pytest.fixture
def spill(tmp_path):
    with open_spill(tmp_path / "sessions") as s:
        yield s


class Conversation:
    """A cold prefill with a grid anchor taken at every line it passes, then decoded tokens:
    the rows an engine really wrote (decode-written ones above the prompt), and its end."""

    def __init__(self, model, prompt: list[int], decoded: int, window: int = 640):
        self.engine = Engine(model, window=window, prefix_chunk=GRID)
        self.anchors: dict[int, SectionsCopy] = {}
        self.extend(prompt, decoded)

    def extend(self, tail: list[int], decoded: int) -> None:
        eng = self.engine

        def on_chunk(end: int) -> None:
            if end % GRID == 0:
                self.anchors[end] = SectionsCopy.take(eng.cache_state())

        logits = eng.prefill(eng.token_ids + tail, on_chunk=on_chunk)
        for _ in range(decoded):
            logits = eng.decode(int(torch.argmax(logits)))
        self.logits = logits

    @property
    def valid(self) -> int:
        return self.engine.length

    def end(self, meta=None) -> SpillEnd:
        return SpillEnd(self.valid, SectionsCopy.take(self.engine.cache_state()).tensors, meta)

    def save(self, spill: SessionSpill, meta: EntryMeta, **kw):
        state = self.engine.cache_state()
        return spill.save(meta.entry_id, state, self.valid, self.engine.token_ids,
                          self.anchors, self.end({"hidden": [[3, 9]], "regions": [[300, 310]]}),
                          meta, **kw)


def meta_of(key: str = "chat-1", salt: str | None = None, taint=None) -> EntryMeta:
    return EntryMeta(session_digest(key), namespace_of(salt), taint)


def entry_dir(spill: SessionSpill, eid: str) -> Path:
    return spill.root / eid


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def assert_rows_equal(a: Engine, b: Engine, n: int) -> None:
    for name, va in a.cache_state().views.items():
        vb = b.cache_state().views[name]
        assert torch.equal(va.rows(0, n), vb.rows(0, n)), name


def assert_sections_equal(a, b) -> None:
    a, b = getattr(a, "tensors", a), getattr(b, "tensors", b)
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- a round trip -----------------------------------------------------------------------------

def test_a_save_and_a_restore_into_a_fresh_state_are_equal_bit_for_bit(any_model, spill):
    conv = Conversation(any_model, tokens(any_model.vocab_size, 300, 1), decoded=21)
    meta = meta_of(taint=conv.engine.taint)
    report = conv.save(spill, meta)
    valid = conv.valid
    assert report.blocks_written == -(-valid // GRID) and report.blocks_kept == 0
    assert report.anchors_written == 5  # the newest 4 grid anchors and the end
    assert set(report.ms) >= {"sums", "copy", "compress", "write", "fsync", "manifest", "total"}

    fresh = Engine(any_model, window=640, prefix_chunk=GRID)
    got = spill.restore(meta.entry_id, fresh.cache_state(), fresh.token_ids)
    assert got.line == valid and got.blocks_read == report.blocks_written
    assert got.blocks_in_place == 0
    assert_rows_equal(conv.engine, fresh, valid)
    assert_sections_equal(fresh.cache_state().sections, conv.engine.cache_state().sections)
    assert got.end is not None and got.end.meta == {"hidden": [[3, 9]], "regions": [[300, 310]]}
    assert_sections_equal(got.end.sections, conv.engine.cache_state().sections)
    assert sorted(got.anchors) == [64, 128, 192, 256]
    for line, copy in got.anchors.items():
        assert_sections_equal(copy, conv.anchors[line])
    assert got.token_ids == conv.engine.token_ids and got.taint == conv.engine.taint

    # The next turn: the restored engine writes what the one that kept its rows writes.
    fresh.resume_at(got.line, got.token_ids, taint=got.taint)
    nxt = int(torch.argmax(conv.logits))
    assert torch.equal(fresh.decode(nxt), conv.engine.decode(nxt))


def test_a_grid_anchor_resumes_where_the_end_is_not_reached(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 2), decoded=10)
    meta = meta_of()
    conv.save(spill, meta)
    prompt = conv.engine.token_ids[:200] + tokens(hybrid.vocab_size, 50, 3)
    offer = spill.offer(prompt, meta.namespace)
    assert offer is not None and offer.matched == 200 and offer.line == 192
    assert not offer.end_reached and offer.anchors_below == [64, 128, 192]
    assert spill.offer(prompt, namespace_of("another tenant")) is None
    assert spill.offer(tokens(hybrid.vocab_size, 50, 4), meta.namespace) is None
    full = spill.offer(conv.engine.token_ids + [5, 6], meta.namespace)
    assert full.end_reached and full.line == conv.valid == full.end_length
    assert full.end_meta == {"hidden": [[3, 9]], "regions": [[300, 310]]}

    fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
    got = spill.restore(meta.entry_id, fresh.cache_state(), [], line=offer.line)
    assert got.line == 192 and got.blocks_read == 3
    assert_rows_equal(conv.engine, fresh, 192)
    assert_sections_equal(fresh.cache_state().sections, conv.anchors[192])


def test_the_entry_names_no_session_key_and_no_salt(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 100, 5), decoded=3)
    meta = meta_of("user-secret-chat", salt="tenant-secret")
    conv.save(spill, meta)
    folder = entry_dir(spill, meta.entry_id)
    assert folder.name == meta.entry_id and meta.entry_id != meta_of("user-secret-chat").entry_id
    for p in folder.iterdir():
        data = p.read_bytes()
        assert b"user-secret-chat" not in data and b"tenant-secret" not in data
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {"0o600"}


# -- incremental by content -------------------------------------------------------------------

def test_a_conversation_saved_a_second_time_writes_only_its_new_blocks(any_model, spill):
    conv = Conversation(any_model, tokens(any_model.vocab_size, 200, 6), decoded=10)
    meta = meta_of()
    first = conv.save(spill, meta)
    assert first.blocks_written == 4  # rows [0, 210): 3 full blocks and a short one
    files_before = {p.name: p.stat().st_ino for p in entry_dir(spill, meta.entry_id).iterdir()}

    # The same conversation again: nothing moved, nothing is written.
    again = conv.save(spill, meta)
    assert again.skipped == "nothing" and again.nbytes_written == 0 and again.blocks_kept == 4

    conv.extend(tokens(any_model.vocab_size, 120, 7), decoded=5)  # rows [0, 335)
    second = conv.save(spill, meta)
    # Blocks 0-2 are unchanged; the short block 3 grew, and 4 and 5 are new.
    assert (second.blocks_kept, second.blocks_written) == (3, 3)
    # The newest 4 anchors are now 128..320: 128 and 192 were on the disk with equal sums.
    assert second.anchors_kept == 2 and second.anchors_written == 3  # 256, 320 and the end
    m = spill.entries()[meta.entry_id]
    files_after = {p.name: p.stat().st_ino for p in entry_dir(spill, meta.entry_id).iterdir()}
    for b in m.blocks[:3]:
        assert files_after[b.name] == files_before[b.name]  # the very file, not a rewrite
    assert set(files_after) - {MANIFEST} == {f.name for f in m.files()}  # the old ones went

    fresh = Engine(any_model, window=640, prefix_chunk=GRID)
    got = spill.restore(meta.entry_id, fresh.cache_state(), [])
    assert_rows_equal(conv.engine, fresh, conv.valid)
    assert_sections_equal(fresh.cache_state().sections, conv.engine.cache_state().sections)
    for line, copy in got.anchors.items():
        assert_sections_equal(copy, conv.anchors[line])


def test_a_save_without_an_end_keeps_the_one_on_the_disk_when_no_row_moved(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 150, 8), decoded=4)
    meta = meta_of()
    conv.save(spill, meta)
    state = conv.engine.cache_state()
    report = spill.save(meta.entry_id, state, conv.valid, conv.engine.token_ids, conv.anchors,
                        None, meta)
    assert report.end_kept_from_disk and report.nbytes_written == 0
    assert spill.entries()[meta.entry_id].end is not None


def test_a_block_in_place_is_not_read(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 9), decoded=12)
    meta = meta_of()
    conv.save(spill, meta)
    m = spill.entries()[meta.entry_id]
    # Blocks 0 and 1 broken on the disk: a restore that read them would fail.
    for b in m.blocks[:2]:
        flip(entry_dir(spill, meta.entry_id) / b.name, 100)

    fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
    fresh.prefill(conv.engine.token_ids[:150])  # rows [0, 150) in place: blocks 0 and 1
    got = spill.restore(meta.entry_id, fresh.cache_state(), fresh.token_ids)
    assert (got.blocks_in_place, got.blocks_read) == (2, len(m.blocks) - 2)
    assert_rows_equal(conv.engine, fresh, conv.valid)

    # Read back once, the same entry again in place reads nothing.
    fresh.resume_at(got.line, got.token_ids, taint=got.taint)
    again = spill.restore(meta.entry_id, fresh.cache_state(), fresh.token_ids)
    assert again.blocks_read == 0 and again.blocks_in_place == len(m.blocks)


# -- what must not be served ------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["planes", "raw"])
@pytest.mark.parametrize("target", ["block", "anchor", "end"])
def test_a_flipped_byte_fails_the_restore_and_deletes_the_entry(hybrid_bf16, tmp_path, codec,
                                                                 target):
    kw = {"codec_version": RAW} if codec == "raw" else {}
    with open_spill(tmp_path / "sessions", **kw) as spill:
        conv = Conversation(hybrid_bf16, tokens(hybrid_bf16.vocab_size, 300, 10), decoded=8)
        meta = meta_of()
        conv.save(spill, meta)
        m = spill.entries()[meta.entry_id]
        rec = {"block": m.blocks[2], "anchor": m.anchors[1], "end": m.end.file}[target]
        part = rec.parts[-1]
        flip(entry_dir(spill, meta.entry_id) / rec.name, part.offset + part.header.nbytes // 2)

        fresh = Engine(hybrid_bf16, window=640, prefix_chunk=GRID)
        with pytest.raises(SpillReadFailed) as err:
            spill.restore(meta.entry_id, fresh.cache_state(), [])
        # The raw codec has no frame checksum: what caught the byte is the sums.
        assert err.value.reason == "sums" if codec == "raw" else err.value.reason in (
            "sums", "codec")
        assert err.value.intact_below == 0
        assert not entry_dir(spill, meta.entry_id).exists()
        assert spill.offer(conv.engine.token_ids, meta.namespace) is None


@pytest.mark.parametrize("codec", ["planes", "raw"])
def test_a_restores_reused_buffers_hold_no_bytes_that_pass_another_entrys_bad_file(
        hybrid_bf16, tmp_path, codec):
    # One spill's read and planes buffers and scratch blocks serve every restore: entry B's
    # flipped byte still fails B though the buffers hold A's good bytes of the same layout,
    # and A still comes back bit for bit after B's failure.
    kw = {"codec_version": RAW} if codec == "raw" else {}
    with open_spill(tmp_path / "sessions", **kw) as spill:
        a = Conversation(hybrid_bf16, tokens(hybrid_bf16.vocab_size, 300, 12), decoded=8)
        b = Conversation(hybrid_bf16, tokens(hybrid_bf16.vocab_size, 300, 13), decoded=8)
        meta_a, meta_b = meta_of("chat-a"), meta_of("chat-b")
        a.save(spill, meta_a)
        b.save(spill, meta_b)
        fresh = Engine(hybrid_bf16, window=640, prefix_chunk=GRID)
        spill.restore(meta_a.entry_id, fresh.cache_state(), [])
        assert_rows_equal(fresh, a.engine, a.valid)
        rec = spill.entries()[meta_b.entry_id].blocks[1]
        part = rec.parts[0]
        flip(entry_dir(spill, meta_b.entry_id) / rec.name, part.offset + part.header.nbytes // 3)
        with pytest.raises(SpillReadFailed) as err:
            spill.restore(meta_b.entry_id, fresh.cache_state(), [])
        assert err.value.reason in (("sums",) if codec == "raw" else ("sums", "codec"))
        assert not entry_dir(spill, meta_b.entry_id).exists()
        again = Engine(hybrid_bf16, window=640, prefix_chunk=GRID)
        report = spill.restore(meta_a.entry_id, again.cache_state(), [])
        assert_rows_equal(again, a.engine, a.valid)
        assert_sections_equal(report.end.sections, a.end().sections)


def test_a_restore_into_another_layout_is_refused_before_a_byte_is_read(hybrid, spill):
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 11), decoded=2)
    meta = meta_of()
    conv.save(spill, meta)
    other = Engine(ThirdModel(), window=640, prefix_chunk=GRID)
    before = [t.clone() for t in other.cache_state().sections.values()]
    with pytest.raises(SpillReadFailed) as err:
        spill.restore(meta.entry_id, other.cache_state(), [])
    assert err.value.reason == "layout"
    for a, b in zip(before, other.cache_state().sections.values()):
        assert torch.equal(a, b)


def test_an_entry_without_a_manifest_is_deleted_at_open(hybrid, tmp_path):
    root = tmp_path / "sessions"
    with open_spill(root) as spill:
        conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 12), decoded=2)
        meta = meta_of()
        conv.save(spill, meta)
        kept = meta_of("chat-2")
        conv.save(spill, kept)
    (root / meta.entry_id / MANIFEST).unlink()  # a save that did not finish
    (root / "not-ours").mkdir()
    with open_spill(root) as spill:
        assert spill.dropped_at_open == {"unfinished": 1}
        assert not (root / meta.entry_id).exists()
        assert list(spill.entries()) == [kept.entry_id]
        assert (root / "not-ours").exists()  # a name the spill never makes is left alone


def test_a_bad_manifest_and_a_missing_file_are_deleted_at_open(hybrid, tmp_path):
    root = tmp_path / "sessions"
    with open_spill(root) as spill:
        conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 13), decoded=2)
        a, b = meta_of("a"), meta_of("b")
        conv.save(spill, a)
        conv.save(spill, b)
        m = spill.entries()[b.entry_id]
    flip(root / a.entry_id / MANIFEST, 200)  # a token id's digit, perhaps
    (root / b.entry_id / m.blocks[1].name).unlink()
    with open_spill(root) as spill:
        assert spill.dropped_at_open == {"manifest": 1, "missing": 1}
        assert spill.entries() == {} and list(root.iterdir()) == []


def test_another_fingerprints_entry_is_deleted_at_open(hybrid, tmp_path):
    # The tier's identity: the fingerprint of the engine's manifest (tandem.io.fingerprint).
    eng = Engine(hybrid, window=640, prefix_chunk=GRID)
    mine = fingerprint(FingerprintInputs(eng.manifest()))
    other = fingerprint(FingerprintInputs(dict(eng.manifest(), prefix_chunk="128")))
    root = tmp_path / "sessions"
    with open_spill(root, Identity(other)) as spill:
        conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 14), decoded=2)
        conv.save(spill, meta_of())
    with open_spill(root, Identity(mine, frozenset({other}))) as spill:
        assert len(spill.entries()) == 1  # an adopted fingerprint is read
    with open_spill(root, Identity(mine)) as spill:
        assert spill.dropped_at_open == {"fingerprint": 1}
        assert spill.entries() == {} and list(root.iterdir()) == []


def test_a_manifest_is_refused_whole_when_a_byte_of_it_changed():
    from tandem.io.spill import Manifest
    m = Manifest(1, FP, GRID, SHARED, "ab" * 32, 1, None, [7], [], [], [], [], None, T0)
    raw = manifest_bytes(m)
    assert parse_manifest(raw) == m
    bad = raw.replace(b"[7]", b"[8]")
    with pytest.raises(ValueError):
        parse_manifest(bad)


# -- the budget -------------------------------------------------------------------------------

def test_entries_unused_for_48_hours_go_and_a_used_one_stays(hybrid, tmp_path):
    clock = Clock()
    root = tmp_path / "sessions"
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 15), decoded=2)
    old, used = meta_of("old"), meta_of("used")
    with open_spill(root, wall=clock) as spill:
        conv.save(spill, old)
        conv.save(spill, used)
        clock.now += 40 * HOUR
        fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
        spill.restore(used.entry_id, fresh.cache_state(), [])  # a read is a use
        clock.now += 9 * HOUR
    # When an entry was last used is on the disk: a restart keeps it.
    with open_spill(root, wall=clock) as spill:
        assert spill.evict() == [old.entry_id]
        assert list(spill.entries()) == [used.entry_id]
        clock.now += 48 * HOUR + 1
        assert spill.evict() == [used.entry_id] and list(root.iterdir()) == []


def test_over_the_budget_the_least_recently_used_entry_goes_first(hybrid, tmp_path):
    clock = Clock()
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 130, 16), decoded=2)
    with open_spill(tmp_path / "probe", wall=clock) as probe:
        one = conv.save(probe, meta_of("probe")).entry_nbytes
    raw_need = sum(v.tensor.numel() // v.tensor.shape[v.token_axis] * v.tensor.element_size()
                   for v in conv.engine.cache_state().views.values()) * conv.valid + 5 * sum(
        t.numel() * t.element_size() for t in conv.engine.cache_state().sections.values())
    # Room for two entries as stored, and for the third's bytes in the engine beside one.
    budget = max(2 * one, one + raw_need) + one // 2
    a, b, c = meta_of("a"), meta_of("b"), meta_of("c")
    with open_spill(tmp_path / "sessions", budget_nbytes=budget, wall=clock) as spill:
        conv.save(spill, a)
        clock.now += 1
        conv.save(spill, b)
        clock.now += 1
        fresh = Engine(hybrid, window=640, prefix_chunk=GRID)
        spill.restore(a.entry_id, fresh.cache_state(), [])  # a is now used after b
        clock.now += 1
        report = conv.save(spill, c)
        assert report.evicted == 1
        assert set(spill.entries()) == {a.entry_id, c.entry_id}
        assert spill.nbytes <= budget
    with open_spill(tmp_path / "tiny", budget_nbytes=one // 2, wall=clock) as spill:
        report = conv.save(spill, a)
        assert report.skipped == "budget" and spill.entries() == {}


def test_an_io_error_mid_save_leaves_no_entry_to_serve(hybrid, tmp_path, monkeypatch):
    from tandem.io import direct
    from tandem.io.spill import SpillWriteFailed
    root = tmp_path / "sessions"
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 17), decoded=4)
    meta = meta_of()
    with open_spill(root) as spill:
        conv.save(spill, meta)
        conv.extend(tokens(hybrid.vocab_size, 100, 18), decoded=2)
        real = direct.DirectFile.pwrite_from
        calls = []

        def full_disk(self, buf, offset):
            calls.append(offset)
            if len(calls) == 2:  # the second new file: the rewrite is part way
                raise OSError(28, "No space left on device")
            return real(self, buf, offset)

        monkeypatch.setattr(direct.DirectFile, "pwrite_from", full_disk)
        with pytest.raises(SpillWriteFailed) as err:
            conv.save(spill, meta)
        assert err.value.errno == 28
        assert spill.entries() == {} and not (root / meta.entry_id).exists()
        assert spill.offer(conv.engine.token_ids, meta.namespace) is None
        monkeypatch.undo()
        assert conv.save(spill, meta).blocks_written == -(-conv.valid // GRID)


def test_a_save_cut_short_is_a_folder_without_a_manifest_the_next_open_deletes(hybrid, tmp_path,
                                                                                monkeypatch):
    root = tmp_path / "sessions"
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 200, 19), decoded=4)
    meta = meta_of()
    with open_spill(root) as spill:
        conv.save(spill, meta)
        conv.extend(tokens(hybrid.vocab_size, 100, 20), decoded=2)
        # A kill between two files: the cleanup never runs either.
        monkeypatch.setattr(SessionSpill, "_remove", lambda self, eid: False)
        real = SessionSpill._write_file
        calls = []

        def killed(self, *a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(self, *a, **kw)

        monkeypatch.setattr(SessionSpill, "_write_file", killed)
        with pytest.raises(KeyboardInterrupt):
            conv.save(spill, meta)
    monkeypatch.undo()
    assert (root / meta.entry_id).exists() and not (root / meta.entry_id / MANIFEST).exists()
    with open_spill(root) as spill:
        assert spill.dropped_at_open == {"unfinished": 1} and list(root.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_rows_on_the_device_are_summed_there_and_come_back_bit_for_bit(hybrid_bf16, spill):
    from tandem.models.base import CacheState, View
    conv = Conversation(hybrid_bf16, tokens(hybrid_bf16.vocab_size, 300, 21), decoded=9)
    host = conv.engine.cache_state()

    def on_device(state, fill=None):
        return CacheState({k: (t.cuda() if fill is None
                               else torch.full_like(t, fill, device="cuda"))
                           for k, t in state.sections.items()},
                          {k: View(v.tensor.cuda() if fill is None
                                   else torch.full_like(v.tensor, fill, device="cuda"),
                                   v.token_axis) for k, v in state.views.items()})

    dev = on_device(host)
    meta = meta_of()
    anchors = {line: {k: t.cuda() for k, t in a.tensors.items()}
               for line, a in conv.anchors.items()}
    end = SpillEnd(conv.valid, dict(dev.sections))
    spill.save(meta.entry_id, dev, conv.valid, conv.engine.token_ids, anchors, end, meta)
    fresh = on_device(host, fill=float("nan"))
    got = spill.restore(meta.entry_id, fresh, [])
    for k, v in fresh.views.items():
        assert v.tensor.is_cuda
        assert torch.equal(v.rows(0, conv.valid), dev.views[k].rows(0, conv.valid))
    assert_sections_equal(fresh.sections, dev.sections)
    for line, copy in got.anchors.items():
        assert_sections_equal(copy, anchors[line])


def test_a_restore_into_a_slot_whose_rows_are_lent_copies_them_first(hybrid, spill, monkeypatch):
    """A store snapshot lent by a slot (tandem.cache.copies.LentRows) is copied before the
    spill's restore writes that slot's rows: restored elsewhere afterwards it gives the rows
    the slot held when it was taken (the witness check off, so the bits fail)."""
    import tandem.cache.copies as copies

    monkeypatch.setattr(copies, "CHECK_LENT", False)
    conv = Conversation(hybrid, tokens(hybrid.vocab_size, 300, 1), decoded=21)
    meta = meta_of(taint=conv.engine.taint)
    conv.save(spill, meta)
    slot = Engine(hybrid, window=640, prefix_chunk=GRID)
    slot.prefill(tokens(hybrid.vocab_size, 200, 2))
    held = {n: v.rows(0, 200).clone() for n, v in slot.cache_state().views.items()}
    lent = copies.LentRows.take(slot.cache_state(), 0, 200)
    got = spill.restore(meta.entry_id, slot.cache_state(), slot.token_ids)
    assert not lent.lent
    assert_rows_equal(conv.engine, slot, got.line)
    elsewhere = Engine(hybrid, window=640, prefix_chunk=GRID)
    lent.restore(elsewhere.cache_state())
    for n, v in elsewhere.cache_state().views.items():
        assert torch.equal(v.rows(0, 200), held[n]), n
