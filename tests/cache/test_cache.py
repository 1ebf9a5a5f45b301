"""The state store (spec: "State store"): prefix snapshots resume bit for bit (gate 1), session
snapshots resume greedy-equal (gate 2); room is reserved before a snapshot is cloned; a declined
put says why, once per conversation; and a hit compares every stored token, so two keys forced
onto one hash never answer each other."""

import pytest
import torch
from structlog.testing import capture_logs

import tandem.cache.store as store_module
from resident_rig import Uninterrupted, assert_bit_exact, assert_uninterrupted, cold, tokens, \
    uninterrupted
from store_rig import MiB, StoreRig
from tandem.models.hybrid import HybridModel


@pytest.fixture(scope="module")
def model(qwen3_5_dir):
    return HybridModel.load(qwen3_5_dir)


def test_a_prefix_snapshot_is_taken_at_the_longest_line_that_fits_and_resumes_bit_for_bit(model):
    v = model.vocab_size
    rig = StoreRig(model)
    first = tokens(v, 300, 1)
    rig.prefill(first)
    assert rig.store.statistics()["prefix_entries"] == 1
    rig.prefill(tokens(v, 300, 2))  # another prompt replaces the rows in place (no park)
    second = first[:280] + tokens(v, 60, 3)
    resume, logits = rig.prefill(second)
    assert (resume.source, resume.start, resume.tier) == ("store", 256, "ram_snapshot")
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(second))
    assert rig.core.stats.prefix_hits == 1


def test_the_resident_prefix_wins_a_tie_and_the_store_only_starts_later(model):
    v = model.vocab_size
    rig = StoreRig(model)
    first = tokens(v, 300, 1)
    rig.prefill(first)
    second = first[:280] + tokens(v, 30, 2)
    resume, logits = rig.prefill(second)
    assert (resume.source, resume.start) == ("resident", 256)
    assert rig.core.stats.prefix_hits == 0
    engine, want = cold(model, second)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(second))


def test_every_line_is_snapshot_with_boundaries_0_and_only_lines_under_the_cap(model):
    v = model.vocab_size
    rig = StoreRig(model, boundaries=0)
    rig.prefill(tokens(v, 300, 1))
    assert rig.store.statistics()["prefix_entries"] == 4  # 64, 128, 192, 256
    capped = StoreRig(model, entry_nbytes=StoreRig(model).store.snapshot_nbytes(150))
    capped.prefill(tokens(v, 300, 1))
    assert [e.n for e in capped.core._entries.values()] == [128]


def test_no_prefix_snapshot_is_taken_over_rows_decoding_wrote(model):
    v = model.vocab_size
    rig = StoreRig(model)
    turn1 = tokens(v, 100, 1)
    _, out1 = rig.turn(turn1)
    puts = rig.core.stats.prefix_puts
    rig.turn(turn1 + out1 + tokens(v, 120, 2))  # resumes at the end: taint 100 < line 192
    assert rig.engine.taint is not None
    assert rig.core.stats.prefix_puts == puts


def test_a_session_snapshot_resumes_the_next_turn_greedy_equal(model):
    v = model.vocab_size
    rig = StoreRig(model)
    turn1 = tokens(v, 200, 1)
    _, out1 = rig.turn(turn1, session="a")
    assert rig.core.stats.session_puts == 1
    rig.turn(tokens(v, 250, 2), session="b")  # b replaces a's rows and end anchor
    turn2 = turn1 + out1 + tokens(v, 40, 3)
    resume, out2 = rig.turn(turn2, session="a")
    assert (resume.source, resume.start) == ("store", len(turn1) + len(out1) - 1)
    assert rig.core.stats.session_hits == 1
    assert_uninterrupted(rig.engine, model, [turn1, turn2], [out1, out2])


def test_room_is_reserved_before_a_snapshot_is_cloned(model, monkeypatch):
    v = model.vocab_size
    probe = StoreRig(model)
    one = probe.store.snapshot_nbytes(256)
    rig = StoreRig(model, store_nbytes=2 * one + one // 2)
    seen = []
    take = store_module.LentRows.take

    def watching(state, start, stop):
        seen.append((rig.memory.held["store"], len(rig.core)))
        return take(state, start, stop)

    monkeypatch.setattr(store_module.LentRows, "take", staticmethod(watching))
    for seed in (1, 2, 3):
        rig.prefill(tokens(v, 300, seed))
    # At every clone the bytes were already held, and the third was made room for (the LRU
    # entry evicted) before the clone, never after.
    assert seen == [(one, 0), (2 * one, 1), (2 * one, 1)]
    assert rig.core.stats.evictions == 1 and len(rig.core) == 2
    rig.store.check_invariants()


def test_a_put_the_engine_is_ahead_of_is_declined_before_anything_is_cloned(model, monkeypatch):
    v = model.vocab_size
    rig = StoreRig(model)
    clones = []
    monkeypatch.setattr(store_module.SectionsCopy, "take",
                        classmethod(lambda cls, state: clones.append(1)))
    prompt = tokens(v, 100, 1)
    rig.engine.prefill(prompt)
    with capture_logs() as logs:
        assert not rig.store.put_session(prompt[:90], "conv")  # the engine is 10 rows ahead
        assert not rig.store.put_session(prompt[:90], "conv")
        assert not rig.store.put_session(prompt[:90], "other")
    assert clones == [] and rig.memory.held["store"] == 0
    assert rig.core.stats.declined_short == 3
    said = [e for e in logs if e["event"] == "store_put_declined"]
    assert [(e["reason"], e["conversation"]) for e in said] == [("short", "conv"),
                                                                ("short", "other")]


def test_a_put_over_the_entry_cap_is_declined_big_and_said_once(model):
    v = model.vocab_size
    rig = StoreRig(model, entry_nbytes=StoreRig(model).store.snapshot_nbytes(100))
    with capture_logs() as logs:
        rig.turn(tokens(v, 200, 1), session="long")
        rig.turn(tokens(v, 220, 2), session="long")
    assert rig.core.stats.declined_big == 2 and rig.core.stats.session_puts == 0
    said = [e for e in logs if e["event"] == "store_put_declined"]
    assert len(said) == 1 and said[0]["reason"] == "big"
    assert "over the entry cap" in said[0]["detail"]


def test_two_keys_on_one_hash_never_answer_each_other(model):
    v = model.vocab_size
    rig = StoreRig(model, hash_fn=lambda ids: 0)  # every key collides
    a = tokens(v, 140, 1)
    b = tokens(v, 140, 2)
    rig.prefill(a)  # a snapshot of a's first 128 tokens
    rig.prefill(tokens(v, 200, 9))
    start, entry = rig.store.offer(b)
    assert (start, entry) == (0, None) and rig.core.stats.collisions >= 1
    resume, logits = rig.prefill(b)
    assert resume.source == "cold"
    engine, want = cold(model, b)
    assert torch.equal(logits, want)
    # Both now in the one bucket: each prompt gets its own state back.
    other = tokens(v, 200, 9)
    resume, logits = rig.prefill(other)
    assert (resume.source, resume.start) == ("store", 192)
    assert torch.equal(logits, cold(model, other)[1])
    b2 = b[:130] + tokens(v, 20, 3)
    resume, logits = rig.prefill(b2)
    assert (resume.source, resume.start) == ("store", 128)
    engine, want = cold(model, b2)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(b2))
    with pytest.raises(ValueError):
        rig.store.restore(rig.store.offer(a + [1])[1], b + [1])


def test_the_store_is_shed_least_recently_used_first(model):
    v = model.vocab_size
    rig = StoreRig(model)
    for seed in (1, 2, 3):
        rig.prefill(tokens(v, 300, seed))
    one = rig.store.snapshot_nbytes(256)
    assert rig.store.shed(1) == one and len(rig.core) == 2
    assert [e.key_ids[:3] for e in rig.core._entries.values()] == [
        tokens(v, 300, 2)[:3], tokens(v, 300, 3)[:3]]
    assert rig.memory.held["store"] == 2 * one
    assert MiB  # the rig's unit


def test_a_store_restore_parks_the_conversation_it_replaces(model):
    """Gate 1 for the store's rows; the parked conversation's next turn comes back from the
    park (its end anchor: greedy gate), as after any other session's request."""
    v = model.vocab_size
    rig = StoreRig(model)  # no park yet: the first conversation's rows are simply replaced
    b = tokens(v, 300, 1)
    rig.prefill(b, "b")
    a = tokens(v, 200, 2)
    rig.prefill(a, "a")
    rig.memory.budgets["park"] = 64 * MiB
    b2 = b[:280] + tokens(v, 30, 3)
    resume, logits = rig.prefill(b2, "b")
    assert (resume.source, resume.start) == ("store", 256)
    engine, want = cold(model, b2)
    assert torch.equal(logits, want)
    parked = rig.resident.parked
    assert parked is not None and parked.session == "a" and parked.token_ids == a
    a2 = a + tokens(v, 20, 4)
    resume, out = rig.turn(a2, "a", max_tokens=8)
    assert resume.source == "park" and resume.start == len(a)
    assert out == uninterrupted(model, [a2], max_tokens=8)[-1]
