"""The disk tier over a folder: a plan's files written, found again after a restart and restored
bit for bit a cold prefill (the gate: torch.equal on the continued prefill's logits, every
section and every row); a file that fails is deleted with the longer chunks of its chain; an
I/O error never raises and leaves no partial entry; nothing of another fingerprint or salt."""

import errno
import os
import zlib

import pytest
import torch

from tandem.cache.namespace import SHARED, namespace_of
from tandem.io import direct, tierfile
from tandem.io.admission import DiskPlan
from tandem.io.chain import chain_keys
from tandem.io.tier import DiskReadFailed
from tandem.io.tierfile import TierFiles

from disk_rig import (FP, GRID, Clock, assert_same_as_cold, chunk_rows, cold_prefill, engine,
                      head_plan, make_tier, restore_fresh, tokens, write_plan)


@pytest.fixture
def root(tmp_path):
    return tmp_path / "disk"


def test_a_restore_through_a_reopened_tier_equals_a_cold_prefill(root, model):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 1)
    tier = make_tier(root)
    plan = head_plan(tier, prompt)
    assert plan.anchor_lines == (GRID, 2 * GRID, 3 * GRID, 4 * GRID)
    assert plan.chunk_lines == (GRID, 2 * GRID, 3 * GRID, 4 * GRID)
    cold, want, report = write_plan(tier, model, prompt, plan)
    assert len(report.written) == 8 and not report.failed and not report.dropped
    tier.check_invariants()
    assert tier.admission.pending == set()
    tier.close()

    again = make_tier(root)  # a restart: the files are the index
    again.check_invariants()
    assert (len(again.index.chunks), len(again.index.anchors)) == (4, 4)
    offer = again.offer(prompt, SHARED, start=0)
    assert offer.line == 4 * GRID and offer.first_chunk == 0
    assert len(offer.chunk_keys_to_read) == 4 and offer.est_ms > 0
    fresh = restore_fresh(again, model, prompt, offer)
    assert_same_as_cold(fresh, cold, prompt, want)
    stats = again.statistics()
    assert stats["hits"] == 1 and stats["restored_tokens"] == 4 * GRID
    assert stats["last_events"][-1]["event"] == "hit"
    again.check_invariants()


def test_the_offer_takes_the_longest_usable_anchor_above_start_and_reads_only_chunks_above_it(
        root, model, monkeypatch):
    prompt = tokens(model.vocab_size, 5 * GRID + 3, 2)
    tier = make_tier(root, head_anchors=0)
    plan = DiskPlan(GRID, (2 * GRID, 4 * GRID), (GRID, 2 * GRID, 3 * GRID, 4 * GRID),
                    tuple(chain_keys(prompt, GRID, SHARED)[:4]), (("head",), ("head",)))
    tier.admission.pending.update(plan.entries())
    cold, want, _ = write_plan(tier, model, prompt, plan)
    chain = chain_keys(prompt, GRID, SHARED)

    offer = tier.offer(prompt, SHARED, start=3 * GRID + 5)
    assert offer.line == 4 * GRID and offer.chunk_keys_to_read == (chain[3],)
    assert tier.offer(prompt, SHARED, start=4 * GRID) is None  # nothing above the rows in place
    assert tier.offer(prompt[:4 * GRID], SHARED, start=0).line == 2 * GRID  # one token forwarded

    # the rows in place below start are another prefill's; the restore reads the chunks from
    # the one that holds start, and rewrites that chunk's rows below start with the grid's (a
    # prefill that stopped inside a chunk ran them in a shorter one: on an EPYC host MKL
    # rounded those rows otherwise, and the resume missed the cold prefill's bits)
    read = []
    real = tier.files.load
    monkeypatch.setattr(tier.files, "load", lambda kind, key, *a, **k: (
        kind == "chunk" and read.append(key)) or real(kind, key, *a, **k))
    partial = engine(model)
    partial.prefill(prompt[:2 * GRID + 10])
    offer = tier.offer(prompt, SHARED, start=2 * GRID + 10)
    assert offer.line == 4 * GRID and offer.first_chunk == 2
    below = {name: v.rows(0, 2 * GRID).clone()
             for name, v in partial.cache_state().views.items()}
    restore_fresh(tier, model, prompt, offer, partial)
    assert read == [chain[2], chain[3]]
    for name, v in partial.cache_state().views.items():
        assert torch.equal(v.rows(0, 2 * GRID), below[name])  # below the chunks read: kept
        assert torch.equal(v.rows(2 * GRID, 2 * GRID + 10),
                           cold.cache_state().views[name].rows(2 * GRID, 2 * GRID + 10))
    assert_same_as_cold(partial, cold, prompt, want)


def _flip(path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_failed_restore_deletes_the_file_and_every_longer_chunk_of_its_chain(root, model):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 3)
    tier = make_tier(root)
    cold, want, _ = write_plan(tier, model, prompt, head_plan(tier, prompt))
    chain = chain_keys(prompt, GRID, SHARED)
    _flip(tier.files.path("chunk", chain[1]), 5000)  # a byte of its rows
    offer = tier.offer(prompt, SHARED, start=0)
    fresh = engine(model)
    before = {name: t.clone() for name, t in fresh.cache_state().sections.items()}
    with pytest.raises(DiskReadFailed) as failed:
        tier.restore(offer, prompt, fresh.cache_state())
    assert failed.value.reason == "corrupt" and failed.value.kind == "chunk"
    assert [tier.files.path("chunk", k).exists() for k in chain] == [True, False, False, False]
    assert set(tier.index.chunks) == {chain[0]}
    for name, t in fresh.cache_state().sections.items():
        assert torch.equal(t, before[name]), name  # the anchor never reached the state
    tier.check_invariants()
    assert tier.statistics()["failed_restores"] == 1

    # the request resumes from what is in place (nothing): a cold prefill, bit for bit
    fresh.resume_at(0)
    assert_same_as_cold(fresh, cold, prompt, want)
    # the next offer is the anchor whose chunks are all still there, and it serves
    offer = tier.offer(prompt, SHARED, start=0)
    assert offer.line == GRID
    assert_same_as_cold(restore_fresh(tier, model, prompt, offer), cold, prompt, want)
    # and the head is admitted again: its missing chunks, its anchors kept
    plan = head_plan(tier, prompt)
    assert plan.chunk_lines == (2 * GRID, 3 * GRID, 4 * GRID) and plan.anchor_lines == ()
    assert set(plan.repaired) == {2 * GRID, 3 * GRID, 4 * GRID}


def test_a_failed_anchor_goes_with_the_chunks_above_its_line(root, model):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 4)
    tier = make_tier(root, head_anchors=2)
    write_plan(tier, model, prompt, head_plan(tier, prompt))
    chain = chain_keys(prompt, GRID, SHARED)
    _flip(tier.files.path("anchor", chain[2]))  # the anchor at 3 G, its last padding byte
    longer = prompt + tokens(model.vocab_size, 3, 5)
    tier.files.path("anchor", chain[3]).unlink()  # the longer one gone behind the tier's back
    tier.index.remove("anchor", chain[3])
    offer = tier.offer(longer, SHARED, start=0)
    assert offer.line == 3 * GRID
    with pytest.raises(DiskReadFailed):
        restore_fresh(tier, model, longer, offer)
    assert set(tier.index.chunks) == set(chain[:3]) and not tier.index.anchors
    assert not tier.files.path("chunk", chain[3]).exists()
    tier.check_invariants()


def test_a_restart_finds_the_entries_and_a_clear_drops_them_and_the_counts(root, model):
    prompt = tokens(model.vocab_size, 3 * GRID + 1, 6)
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt))
    written = tier.statistics()
    tier.close()
    again = make_tier(root)
    stats = again.statistics()
    assert (stats["chunks"], stats["anchors"], stats["nbytes"]) == \
        (written["chunks"], written["anchors"], written["nbytes"])
    assert again.admission.counts == tier.admission.counts  # the counts outlive the process
    dropped = again.clear()
    assert dropped["files"] == 6 and dropped["lines"] == 3
    assert again.offer(prompt, SHARED, start=0) is None
    again.close()
    after = make_tier(root)
    assert not after.index.chunks and not after.index.anchors and not after.admission.counts


def test_a_file_of_another_fingerprint_or_salt_is_never_served(root, model):
    prompt = tokens(model.vocab_size, 2 * GRID + 5, 7)
    salted = namespace_of("tenant a")
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt, salted))
    assert tier.offer(prompt, salted, start=0).line == 2 * GRID
    for other in (SHARED, namespace_of("tenant b")):
        assert tier.offer(prompt, other, start=0) is None
    tier.close()
    adopting = make_tier(root, "ab" * 32, adopted=frozenset({FP}))  # adopts the earlier one
    assert adopting.offer(prompt, salted, start=0).line == 2 * GRID
    adopting.close()
    foreign = make_tier(root, "cd" * 32)  # another arithmetic: swept at the start
    assert foreign.scanned.other_fingerprint == 4
    assert foreign.offer(prompt, salted, start=0) is None
    assert not list(TierFiles(root).entries())


def test_the_tier_off_plans_nothing_and_offers_nothing(root, model):
    prompt = tokens(model.vocab_size, 2 * GRID + 5, 8)
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt))
    tier.configure(mode="off")
    assert head_plan(tier, prompt).empty
    assert tier.offer(prompt, SHARED, start=0) is None
    tier.configure(mode="on", min_free_gb=0.0, budget_gb=1.0, ttl_days=1.0, admit_after=3)
    assert tier.offer(prompt, SHARED, start=0).line == 2 * GRID
    assert tier.admission.admit_after == 3 and tier.budget_nbytes == 10 ** 9


class _Fail:
    """``os.<name>`` that raises EIO at its ``nth`` call (1-based) and passes the others."""

    def __init__(self, name: str, nth: int):
        self.real = getattr(os, name)
        self.nth = nth
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth:
            raise OSError(errno.EIO, "injected")
        return self.real(*args, **kwargs)


# 4 chunks and 2 anchors: two fsyncs a file (the file, its folder after the rename), one pwrite
# a section and a header; the write that fails is the first, the last or one between.
@pytest.mark.parametrize("call,nth", [("fsync", n) for n in (1, 2, 3, 6, 9, 12)]
                         + [("pwrite", n) for n in (1, 4, 7)])
def test_the_nth_write_or_fsync_failing_leaves_no_partial_entry_and_raises_nothing(
        root, hybrid, monkeypatch, call, nth):
    prompt = tokens(hybrid.vocab_size, 4 * GRID + 9, 9)
    tier = make_tier(root, head_anchors=2)
    plan = head_plan(tier, prompt)
    assert len(plan.entries()) == 6
    cold, want, staged = cold_prefill(hybrid, prompt, plan.anchor_lines)
    fail = _Fail(call, nth)
    monkeypatch.setattr(os, call, fail)
    report = tier.write_entries(plan, prompt, staged, chunk_rows(cold, plan))
    monkeypatch.undo()
    assert fail.calls >= nth
    assert len(report.failed) == 1 and len(report.written) == 5
    stats = tier.statistics()
    assert stats["write_failures"] == 1 and stats["last_events"][-1]["event"] in (
        "write", "write_failed")
    assert not tier.files.leftovers()
    tier.check_invariants()
    # what is on disk is what the index says, and every file of it verifies whole
    on_disk = set(tier.files.entries())
    assert on_disk == {("chunk", k) for k in tier.index.chunks} | \
        {("anchor", k) for k in tier.index.anchors}
    assert report.failed[0] not in on_disk
    state = cold.cache_state()
    for kind, key in on_disk:
        if kind == "chunk":
            tier.files.read_chunk(key, tier.identity, like=state, grid=GRID)
        else:
            tier.files.read_anchor(key, tier.identity, like=state, grid=GRID)
    # the failed entry is no longer pending: the next plan that names it admits it again
    assert not tier.admission.pending
    again = head_plan(tier, prompt)
    assert report.failed[0] in again.entries() or report.failed[0][0] == "chunk"
    tier.close()
    reopened = make_tier(root)
    assert reopened.scanned.leftovers == 0 and reopened.scanned.kept == 5
    offer = reopened.offer(prompt, SHARED, start=0)
    if offer is not None:  # whatever is usable serves, bit for bit
        assert_same_as_cold(restore_fresh(reopened, hybrid, prompt, offer), cold, prompt, want)


def test_a_write_that_does_not_fit_is_skipped_and_evicts_by_value_first(root, model):
    first = tokens(model.vocab_size, 2 * GRID + 1, 10)
    second = tokens(model.vocab_size, 2 * GRID + 1, 11)
    tier = make_tier(root, head_anchors=1)
    _, _, report = write_plan(tier, model, first, head_plan(tier, first))
    held = tier.index.nbytes
    tier.configure(budget_gb=(held * 1.5) / 10 ** 9)  # room for one prompt's files, not two
    _, _, report = write_plan(tier, model, second, head_plan(tier, second))
    assert len(report.written) == 3
    assert tier.offer(first, SHARED, start=0) is None  # the least valuable went
    assert tier.offer(second, SHARED, start=0).line == 2 * GRID
    assert tier.index.nbytes <= held * 1.5
    assert tier.statistics()["evictions"] == 3
    tier.configure(budget_gb=0.0)
    third = tokens(model.vocab_size, 2 * GRID + 1, 12)
    _, _, report = write_plan(tier, model, third, head_plan(tier, third))
    assert not report.written and len(report.failed) == 3 and not tier.admission.pending
    assert tier.statistics()["skipped_no_room"] == 3
    tier.check_invariants()


def test_a_small_disk_keeps_the_floor_free(root, model):
    prompt = tokens(model.vocab_size, 2 * GRID + 1, 13)
    tier = make_tier(root, floor_nbytes=10 ** 9, free_nbytes=10 ** 9 + 4096)
    _, _, report = write_plan(tier, model, prompt, head_plan(tier, prompt))
    assert not report.written and not list(tier.files.entries())
    tier.configure(min_free_gb=0.0)  # a setting may not go under the start's floor
    assert tier.floor_nbytes == 10 ** 9


def test_the_server_builds_the_tier_from_its_config_and_none_when_it_is_off(tmp_path):
    from tandem.config import Config, DiskConfig
    from tandem.io.tier import make_disk_tier
    from tandem.models.third import ThirdModel

    eng = engine(ThirdModel())
    config = Config(home=str(tmp_path), disk=DiskConfig(disk_cache_gb=2.0,
                                                        disk_cache_min_free_gb=0.0))
    tier = make_disk_tier(config, eng)
    assert tier.root == tmp_path / "disk" and tier.grid == GRID
    assert tier.budget_nbytes == 2 * 10 ** 9 and tier.admission.min_tokens == 4096
    assert (tmp_path / "disk" / "fp-equal.json").exists()
    fp = tier.identity.fingerprint
    tier.close()
    again = make_disk_tier(config, eng)  # the same arithmetic: the same fingerprint
    assert again.identity.fingerprint == fp
    again.close()
    assert make_disk_tier(Config(home=str(tmp_path), disk=DiskConfig(disk_cache="off")),
                          eng) is None


def test_a_restore_reads_each_file_in_one_transfer_into_buffers_the_next_one_reuses(
        root, model, monkeypatch):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 11)
    tier = make_tier(root)
    cold, want, _ = write_plan(tier, model, prompt, head_plan(tier, prompt))
    reads, allocated = [], []
    real_pread, real_aligned = direct.DirectFile.pread_into, tierfile.aligned
    monkeypatch.setattr(direct.DirectFile, "pread_into",
                        lambda f, buf, offset: reads.append(f.name) or real_pread(f, buf, offset))
    monkeypatch.setattr(tierfile, "aligned",
                        lambda n: allocated.append(n) or real_aligned(n))
    offer = tier.offer(prompt, SHARED, start=0)
    assert_same_as_cold(restore_fresh(tier, model, prompt, offer), cold, prompt, want)
    # header and sections in one transfer a file (the index knows each file's size)
    assert sorted(reads) == sorted(
        [tier.files.file_name("anchor", offer.anchor_key)]
        + [tier.files.file_name("chunk", k) for k in offer.chunk_keys_to_read])
    assert allocated and tier.statistics()["hits"] == 1
    reads.clear()
    allocated.clear()
    assert_same_as_cold(restore_fresh(tier, model, prompt, offer), cold, prompt, want)
    assert len(reads) == 5 and allocated == []  # the staging's buffers, no fresh pages


@pytest.mark.parametrize("offset", [5000, -1])  # the last file's first section, its last one
def test_a_failed_restore_leaves_the_state_at_its_length_as_it_was_and_nothing_in_flight(
        root, model, offset):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 12)
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt))
    chain = chain_keys(prompt, GRID, SHARED)
    # the last chunk read (its sections summed on both threads): the others were committed
    _flip(tier.files.path("chunk", chain[3]), offset)
    partial = engine(model)
    partial.prefill(prompt[:GRID + 10])
    state = partial.cache_state()
    sections = {name: t.clone() for name, t in state.sections.items()}
    below = {name: v.rows(0, GRID + 10).clone() for name, v in state.views.items()}
    offer = tier.offer(prompt, SHARED, start=GRID + 10)
    assert offer.chunk_keys_to_read == tuple(chain[1:4])
    with pytest.raises(DiskReadFailed) as failed:
        tier.restore(offer, prompt, state)
    assert failed.value.kind == "chunk" and failed.value.key == chain[3]
    for name, t in state.sections.items():
        assert torch.equal(t, sections[name]), name
    for name, v in state.views.items():
        assert torch.equal(v.rows(0, GRID + 10), below[name]), name
    assert not tier._reading  # no file of it is still protected, no check still running
    assert tier._staging.kept_nbytes > 0  # its buffers came back
    # the request goes on from what is in place, as if no restore had been tried
    reference = engine(model)
    reference.prefill(prompt[:GRID + 10])
    partial.resume_at(GRID + 10)
    assert_same_as_cold(partial, reference, prompt, reference.prefill(prompt))


def test_of_two_bad_files_the_lower_chunk_is_the_one_reported_and_everything_above_goes(
        root, model):
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 13)
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt))
    chain = chain_keys(prompt, GRID, SHARED)
    _flip(tier.files.path("chunk", chain[1]), 5000)  # found by the checker, after its read
    tier.files.path("chunk", chain[2]).write_bytes(b"")  # found by the read itself
    offer = tier.offer(prompt, SHARED, start=0)
    with pytest.raises(DiskReadFailed) as failed:
        restore_fresh(tier, model, prompt, offer)
    assert (failed.value.kind, failed.value.key, failed.value.reason) == \
        ("chunk", chain[1], "corrupt")
    assert set(tier.index.chunks) == {chain[0]}
    assert [tier.files.path("chunk", k).exists() for k in chain[:4]] == \
        [True, False, False, False]
    tier.check_invariants()


def test_the_tiers_crc32_is_zlibs(hybrid):
    data = os.urandom(3 << 20)
    assert tierfile.crc32(data) == zlib.crc32(data)
    assert tierfile.crc32(data[7:], 12345) == zlib.crc32(data[7:], 12345)


def test_a_restore_into_a_slot_whose_rows_are_lent_copies_them_first(root, model, monkeypatch):
    """A store snapshot lent by a slot (tandem.cache.copies.LentRows) is copied before the disk
    restore writes that slot's rows, on the checkers or here: restored elsewhere afterwards it
    gives the rows the slot held when it was taken (the witness check off, so the bits fail)."""
    import tandem.cache.copies as copies

    monkeypatch.setattr(copies, "CHECK_LENT", False)
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 1)
    tier = make_tier(root)
    cold, want, _ = write_plan(tier, model, prompt, head_plan(tier, prompt))
    slot = engine(model)
    slot.prefill(tokens(model.vocab_size, 3 * GRID, 2))
    held = {n: v.rows(0, 3 * GRID).clone() for n, v in slot.cache_state().views.items()}
    lent = copies.LentRows.take(slot.cache_state(), 0, 3 * GRID)
    restore_fresh(tier, model, prompt, tier.offer(prompt, SHARED, start=0), eng=slot)
    assert not lent.lent
    assert_same_as_cold(slot, cold, prompt, want)
    elsewhere = engine(model)
    lent.restore(elsewhere.cache_state())
    for n, v in elsewhere.cache_state().views.items():
        assert torch.equal(v.rows(0, 3 * GRID), held[n]), n
