"""Rows lent to the state store (tandem.cache.copies.LentRows, tandem.models.rows.lend): a
snapshot reads the rows of the slot it was taken from until that slot writes over them, and
copies them just before it does.

Gate 1 (grid) throughout: a lent snapshot restored anywhere, before or after its slot wrote over
the rows, gives rows torch.equal to those the slot held when it was taken, and a prefix resume
from it logits torch.equal to a cold prefill's. The model remembers (decay near 1), so a restore
that lost rows would change the logits.

Every write path is run with the witness check off (``CHECK_LENT``, which the suite turns on
for every other test): what fails here without a path's ``rows_written`` is the bits."""

import pytest
import torch

import tandem.cache.copies as copies
from resident_rig import CHUNK, assert_bit_exact, budgets, cold, tokens
from store_rig import MiB
from tandem.cache.copies import LentRows, LentRowsChanged, RowsCopy
import tandem.cache.governor as governor
from tandem.cache.governor import CpuAllocator
from tandem.cache.keep import swap_rows
from tandem.cache.memory import MemoryAccountant
from tandem.cache.store import StateStore, StoreCore
from tandem.engine import Engine
from tandem.models.hybrid import HybridModel
from tandem.models.rows import lent_nbytes, release_rows


@pytest.fixture(scope="module")
def model(qwen3_5_dir):
    return HybridModel.load(qwen3_5_dir)


@pytest.fixture
def no_witness(monkeypatch):
    monkeypatch.setattr(copies, "CHECK_LENT", False)


def _engine(model, prompt):
    engine = Engine(model, window=1024, prefix_chunk=CHUNK)
    engine.prefill(prompt)
    return engine


def _rows(engine, n):
    return {name: v.rows(0, n).clone() for name, v in engine.cache_state().views.items()}


def _assert_rows(engine, want):
    state = engine.cache_state()
    for name, rows in want.items():
        assert torch.equal(state.views[name].rows(0, rows.shape[state.views[name].token_axis]),
                           rows), name


def test_lent_rows_stay_in_place_while_the_slot_goes_on_past_them(model, no_witness):
    v = model.vocab_size
    prompt = tokens(v, 200, 1)
    engine = _engine(model, prompt)
    want = _rows(engine, 128)
    before = lent_nbytes()
    lent = LentRows.take(engine.cache_state(), 0, 128)
    assert lent.lent and lent_nbytes() - before == lent.nbytes == 128 * \
        engine.cache_state().row_nbytes()
    engine.prefill(prompt + tokens(v, 60, 2))  # the next turn: rows from 200 on
    engine.resume_at(engine.length)  # its end, where the turn after resumes
    assert lent.lent, "a write above the lent rows copied them"
    other = Engine(model, window=1024, prefix_chunk=CHUNK)
    lent.restore(other.cache_state(), 0, 128)
    _assert_rows(other, want)
    del lent
    assert lent_nbytes() == before


def _resume_lower(model, engine):
    engine.resume_at(64)
    engine.prefill(engine.token_ids + tokens(model.vocab_size, 100, 9))


def _release(model, engine):
    release_rows(engine.state, 64)


def _restore_a_copy(model, engine):
    donor = _engine(model, tokens(model.vocab_size, 200, 9))
    RowsCopy.take(donor.cache_state(), 0, 200).restore(engine.cache_state(), 0, 200)


def _swap(model, engine):
    donor = _engine(model, tokens(model.vocab_size, 200, 9))
    buffer = RowsCopy.take(donor.cache_state(), 32, 160)
    swap_rows(engine.cache_state(), buffer, 32, 160)


def _restore_lent(model, engine):
    donor = _engine(model, tokens(model.vocab_size, 200, 9))
    LentRows.take(donor.cache_state(), 0, 200).restore(engine.cache_state(), 0, 200)


@pytest.mark.parametrize("write", [_resume_lower, _release, _restore_a_copy, _swap,
                                   _restore_lent])
def test_every_write_under_lent_rows_copies_them_first(model, no_witness, write):
    engine = _engine(model, tokens(model.vocab_size, 200, 1))
    want = _rows(engine, 128)
    lent = LentRows.take(engine.cache_state(), 0, 128)
    write(model, engine)
    assert not lent.lent, "the rows were written over while still lent"
    other = Engine(model, window=1024, prefix_chunk=CHUNK)
    lent.restore(other.cache_state(), 0, 128)
    _assert_rows(other, want)


def test_rows_lent_below_a_write_stay_lent(model, no_witness):
    engine = _engine(model, tokens(model.vocab_size, 200, 1))
    low, high = (LentRows.take(engine.cache_state(), 0, n) for n in (64, 192))
    engine.resume_at(100)
    assert low.lent and not high.lent


def test_a_write_that_skips_the_hook_is_caught_by_the_witness(model, monkeypatch):
    monkeypatch.setattr(copies, "CHECK_LENT", True)
    engine = _engine(model, tokens(model.vocab_size, 200, 1))
    lent = LentRows.take(engine.cache_state(), 0, 128)
    next(iter(engine.cache_state().views.values())).rows(10, 11).add_(1.0)  # no rows_written
    with pytest.raises(LentRowsChanged):
        lent.restore(Engine(model, window=1024, prefix_chunk=CHUNK).cache_state())


def _stores(model, n):
    """``n`` slots over one store core, as the engine actor builds them."""
    memory = MemoryAccountant({**budgets(), "store": 64 * MiB})
    core = StoreCore(memory, entry_nbytes=16 * MiB)
    engines = [Engine(model, window=1024, prefix_chunk=CHUNK) for _ in range(n)]
    return core, engines, [StateStore(e, core, entry_nbytes=16 * MiB, boundaries=1)
                           for e in engines]


def _prefill(store, prompt, start=0):
    store.plan_prefix(prompt, start)
    logits = store.engine.prefill(prompt, on_chunk=store.on_chunk)
    store.end_prefill()
    return logits


def test_a_snapshot_lent_by_one_slot_resumes_another_bit_for_bit(model, no_witness):
    """Slot A's prefix snapshot, its rows still A's, restored into slot B: B resumes at the
    line and its prefill gives a cold prefill's logits, rows and sections; A's rows are
    untouched and the entry still lends them."""
    v = model.vocab_size
    core, (a, b), (sa, sb) = _stores(model, 2)
    first = tokens(v, 300, 1)
    _prefill(sa, first)
    assert len(core) == 1
    second = first[:280] + tokens(v, 60, 3)
    n, entry = sb.offer(second)
    assert n == 256 and entry.rows.lent
    sb.restore(entry, second)
    assert b.length == 256 and entry.rows.lent
    logits = _prefill(sb, second, 256)
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(b, engine, len(second))
    a_cold, _ = cold(model, first)
    assert_bit_exact(a, a_cold, len(first))


def test_a_snapshot_whose_slot_moved_on_resumes_bit_for_bit_from_its_copy(model, no_witness):
    v = model.vocab_size
    core, (a, b), (sa, sb) = _stores(model, 2)
    first = tokens(v, 300, 1)
    _prefill(sa, first)
    a.resume_at(0)  # slot A takes another conversation
    _prefill(sa, tokens(v, 300, 2))
    second = first[:280] + tokens(v, 60, 3)
    n, entry = sb.offer(second)
    assert n == 256 and not entry.rows.lent
    sb.restore(entry, second)
    logits = _prefill(sb, second, 256)
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(b, engine, len(second))


def test_restoring_into_the_slot_that_lent_the_rows_writes_none(model, no_witness):
    v = model.vocab_size
    core, (a,), (sa,) = _stores(model, 1)
    first = tokens(v, 300, 1)
    _prefill(sa, first)
    held = _rows(a, 300)
    second = first[:280] + tokens(v, 60, 3)
    n, entry = sa.offer(second)
    sa.restore(entry, second)
    assert a.length == 256 and entry.rows.lent
    _assert_rows(a, {k: t.narrow(a.cache_state().views[k].token_axis, 0, 256)
                     for k, t in held.items()})
    logits = _prefill(sa, second, 256)
    assert entry.rows.lent  # the prefill wrote from 256 on, above the lent rows
    engine, want = cold(model, second)
    assert torch.equal(logits, want)


def test_the_governor_holds_lent_rows_as_copied(model, no_witness, monkeypatch):
    engine = _engine(model, tokens(model.vocab_size, 200, 1))
    lent = LentRows.take(engine.cache_state(), 0, 192)
    with_lent = lent_nbytes()
    assert with_lent >= lent.nbytes
    engine.resume_at(0)  # copies them: now measured, no longer added
    assert lent_nbytes() == with_lent - lent.nbytes
    monkeypatch.setattr(governor, "lent_nbytes", lambda: 1 << 40)
    assert CpuAllocator().measure().held_nbytes > 1 << 40


def test_borrowers_copied_at_one_write_copy_each_row_once(model, no_witness):
    """A conversation's snapshots, turn after turn, copied when its slot is taken: the copies
    hold the longest one's rows once, in segments, and each restores its own rows."""
    engine = _engine(model, tokens(model.vocab_size, 300, 1))
    stops = (64, 150, 300)
    want = {n: _rows(engine, n) for n in stops}
    lent = [LentRows.take(engine.cache_state(), 0, n) for n in stops]
    engine.resume_at(0)
    _engine_rows = engine.cache_state().row_nbytes()
    held = {id(t.untyped_storage()): t.numel() * t.element_size()
            for b in lent for seg in b._copy for t in seg.tensors.values()}
    assert sum(held.values()) == 300 * _engine_rows  # not (64 + 150 + 300) rows
    engine.prefill(tokens(model.vocab_size, 300, 2))  # the slot writes over every row
    for b, n in zip(lent, stops):
        assert not b.lent and b.nbytes == n * _engine_rows
        other = Engine(model, window=1024, prefix_chunk=CHUNK)
        b.restore(other.cache_state())
        _assert_rows(other, want[n])
    del lent[2]  # the longest goes: its own segment with it, the two below stay held
    held = {id(t.untyped_storage()) for b in lent for seg in b._copy for t in seg.tensors.values()}
    assert len(held) == 2 * len(want[64])


def test_a_copy_that_fails_leaves_its_borrowers_lent_and_the_rows_unwritten(model, no_witness,
                                                                            monkeypatch):
    engine = _engine(model, tokens(model.vocab_size, 200, 1))
    lent = LentRows.take(engine.cache_state(), 0, 128)

    def refuse(*_):
        raise MemoryError("no room for the copy")

    clone = copies.host_clone
    monkeypatch.setattr(copies, "host_clone", refuse)
    with pytest.raises(MemoryError):
        engine.resume_at(64)
    assert lent.lent and engine.length == 200
    monkeypatch.setattr(copies, "host_clone", clone)
    engine.resume_at(64)  # now it copies
    assert not lent.lent
