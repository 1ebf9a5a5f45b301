"""The disk tier's budget: entries go by value ((hits + 1) x tokens saved per byte held alone,
halved for every day unused), past their TTL, and to keep the free-space floor; chunks go with
the last anchor that read them (spec: "The disk", in "Disk tier"). Pure over a TierIndex."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cache.namespace import SHARED
from tandem.io.chain import Key, chain_keys
from tandem.io.eviction import (DAY_S, TierUsage, plan_eviction, room_for, seed_from_files,
                                value_of)
from tandem.io.tierfile import TierFiles
from tandem.io.tierindex import AnchorEntry, ChunkEntry, TierIndex

G = 16
FP = "ab" * 32
CHUNK = 1000
ANCHOR = 4000
NOW = 1_000_000.0
ROOMY = dict(free_nbytes=10**12, floor_nbytes=0)


def chain(seed: int, lines: int = 8) -> list[Key]:
    rng = random.Random(seed)
    return chain_keys([rng.randrange(50_000) for _ in range(lines * G)], G, SHARED)


def put(index: TierIndex, usage: TierUsage, keys: list[Key], lines: list[int], *,
        when: float = NOW, chunk_nbytes: int = CHUNK, anchor_nbytes: int = ANCHOR,
        chunks: bool = True) -> None:
    """Anchors at ``lines`` (in grid steps) of a chain and every chunk below them."""
    if chunks:
        for i in range(max(lines)):
            if keys[i] not in index.chunks:
                index.add_chunk(ChunkEntry(keys[i], i * G, (i + 1) * G, chunk_nbytes, FP))
                usage.written("chunk", keys[i], when)
    for n in lines:
        index.add_anchor(AnchorEntry(keys[n - 1], n * G, tuple(keys[:n]), anchor_nbytes, FP))
        usage.written("anchor", keys[n - 1], when)
    index.check_invariants()


def anchors_in(victims) -> list[Key]:
    return [k for kind, k in victims if kind == "anchor"]


def test_nothing_goes_while_the_tier_fits_its_budget_and_leaves_the_floor_free():
    index, usage = TierIndex(), TierUsage()
    put(index, usage, chain(1), [4])
    room = room_for(ANCHOR, index, usage, NOW, budget_nbytes=index.nbytes + ANCHOR,
                    free_nbytes=10 * ANCHOR, floor_nbytes=9 * ANCHOR)
    assert room.fits and room.evict == () and room.freed_nbytes == 0


def test_the_least_valuable_entry_goes_first_by_hits_and_age():
    index, usage = TierIndex(), TierUsage()
    a, b, c = chain(1), chain(2), chain(3)
    for keys in (a, b, c):
        put(index, usage, keys, [4])
    usage.hit(index.anchors[a[3]], NOW)
    usage.hit(index.anchors[a[3]], NOW)  # 3 x b's value
    usage.uses[("anchor", c[3])].last_used = NOW - 2 * DAY_S  # a quarter of b's
    entry = ANCHOR + 4 * CHUNK
    order = [anchors_in(plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - k * entry,
                                      **ROOMY)) for k in (1, 2, 3)]
    assert order == [[c[3]], [c[3], b[3]], [c[3], b[3], a[3]]]
    assert value_of(index.anchors[a[3]], index, usage, NOW) == pytest.approx(
        3 * value_of(index.anchors[b[3]], index, usage, NOW))


def test_an_entry_that_holds_more_bytes_for_the_same_tokens_goes_first():
    index, usage = TierIndex(), TierUsage()
    small, big = chain(4), chain(5)
    put(index, usage, small, [4])
    put(index, usage, big, [4], anchor_nbytes=3 * ANCHOR)
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, **ROOMY)
    assert anchors_in(victims) == [big[3]]


def test_an_entry_that_saves_more_tokens_per_byte_stays():
    index, usage = TierIndex(), TierUsage()
    short, long = chain(6), chain(7)
    put(index, usage, short, [2])
    put(index, usage, long, [8])  # 8 lines for 4000 + 8000 bytes beats 2 for 4000 + 2000
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, **ROOMY)
    assert anchors_in(victims) == [short[1]]


def test_the_value_is_halved_for_every_day_unused():
    index, usage = TierIndex(), TierUsage()
    keys = chain(8)
    put(index, usage, keys, [4])
    a = index.anchors[keys[3]]
    v0 = value_of(a, index, usage, NOW)
    assert v0 == pytest.approx(4 * G / (ANCHOR + 4 * CHUNK))
    assert value_of(a, index, usage, NOW + DAY_S) == pytest.approx(v0 / 2)
    assert value_of(a, index, usage, NOW + 3 * DAY_S) == pytest.approx(v0 / 8)
    usage.hit(a, NOW + 3 * DAY_S)
    assert value_of(a, index, usage, NOW + 3 * DAY_S) == pytest.approx(2 * v0)


def test_a_shared_chunk_counts_a_share_of_its_bytes_for_each_anchor_that_reads_it():
    index, usage = TierIndex(), TierUsage()
    keys = chain(9)
    put(index, usage, keys, [2, 4])
    low, high = index.anchors[keys[1]], index.anchors[keys[3]]
    # chunks 1 and 2 are read by both, 3 and 4 by the longer one alone
    assert value_of(low, index, usage, NOW) == pytest.approx(2 * G / (ANCHOR + CHUNK))
    assert value_of(high, index, usage, NOW) == pytest.approx(4 * G / (ANCHOR + 3 * CHUNK))


def test_chunks_no_anchor_reads_go_with_the_last_anchor_that_read_them():
    index, usage = TierIndex(), TierUsage()
    keys = chain(10)
    put(index, usage, keys, [2, 4])
    usage.hit(index.anchors[keys[1]], NOW)  # the short one is worth more
    one = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, **ROOMY)
    assert one == [("anchor", keys[3]), ("chunk", keys[3]), ("chunk", keys[2])]
    both = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - ANCHOR - 2 * CHUNK - 1,
                         **ROOMY)
    assert both == one + [("anchor", keys[1]), ("chunk", keys[1]), ("chunk", keys[0])]


def test_an_entry_unused_past_its_ttl_goes_even_when_there_is_room():
    index, usage = TierIndex(), TierUsage()
    old, new = chain(11), chain(12)
    put(index, usage, old, [3], when=NOW - 8 * DAY_S)
    put(index, usage, new, [3], when=NOW - 6 * DAY_S)
    victims = plan_eviction(index, usage, NOW, budget_nbytes=10**12, ttl_s=7 * DAY_S, **ROOMY)
    assert victims == [("anchor", old[2])] + [("chunk", k) for k in reversed(old[:3])]
    usage.hit(index.anchors[old[2]], NOW)
    assert plan_eviction(index, usage, NOW, budget_nbytes=10**12, ttl_s=7 * DAY_S, **ROOMY) == []


def test_the_free_space_floor_evicts_when_other_files_fill_the_disk():
    index, usage = TierIndex(), TierUsage()
    a, b = chain(13), chain(14)
    put(index, usage, a, [4])
    put(index, usage, b, [4])
    usage.hit(index.anchors[b[3]], NOW)
    entry = ANCHOR + 4 * CHUNK
    victims = plan_eviction(index, usage, NOW, budget_nbytes=10**12, free_nbytes=100,
                            floor_nbytes=100 + entry)
    assert anchors_in(victims) == [a[3]]
    room = room_for(entry, index, usage, NOW, budget_nbytes=10**12, free_nbytes=100,
                    floor_nbytes=100)
    assert room.fits and anchors_in(room.evict) == [a[3]] and room.freed_nbytes == entry


def test_a_write_that_cannot_fit_evicts_nothing_for_itself():
    index, usage = TierIndex(), TierUsage()
    put(index, usage, chain(15), [4])
    stale = chain(16)
    put(index, usage, stale, [2], when=NOW - 9 * DAY_S)
    budget = index.nbytes
    room = room_for(budget + 1, index, usage, NOW, budget_nbytes=budget, **ROOMY)
    # only what the TTL asks goes; the rest stays, as the write is skipped
    assert not room.fits and anchors_in(room.evict) == [stale[1]]
    assert room.freed_nbytes == ANCHOR + 2 * CHUNK


def test_a_lowered_budget_evicts_though_the_write_cannot_fit():
    index, usage = TierIndex(), TierUsage()
    a, b = chain(17), chain(18)
    put(index, usage, a, [4])
    put(index, usage, b, [4])
    usage.hit(index.anchors[b[3]], NOW)
    entry = ANCHOR + 4 * CHUNK
    room = room_for(10 * entry, index, usage, NOW, budget_nbytes=entry, **ROOMY)
    assert not room.fits and anchors_in(room.evict) == [a[3]]


def test_a_chunk_no_anchor_reads_is_worth_nothing_and_goes_first():
    index, usage = TierIndex(), TierUsage()
    keys, orphan = chain(19), chain(20)
    put(index, usage, keys, [4], when=NOW - 2 * DAY_S)
    index.add_chunk(ChunkEntry(orphan[0], 0, G, CHUNK, FP))  # its anchor's write failed
    usage.written("chunk", orphan[0], NOW)
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, **ROOMY)
    assert victims == [("chunk", orphan[0])]
    late = plan_eviction(index, usage, NOW + 8 * DAY_S, budget_nbytes=10**12, **ROOMY)
    assert ("chunk", orphan[0]) in late  # and by its own TTL


def test_an_anchor_missing_a_chunk_below_it_is_worth_nothing():
    index, usage = TierIndex(), TierUsage()
    whole, broken = chain(21), chain(22)
    put(index, usage, whole, [4], when=NOW - 3 * DAY_S)
    put(index, usage, broken, [4])
    index.remove("chunk", broken[1])
    assert value_of(index.anchors[broken[3]], index, usage, NOW) == 0
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, **ROOMY)
    assert anchors_in(victims) == [broken[3]]
    assert ("chunk", broken[1]) not in victims and len(victims) == 4


def test_the_chain_of_a_write_in_flight_is_never_evicted():
    index, usage = TierIndex(), TierUsage()
    keys, other = chain(23), chain(24)
    put(index, usage, keys, [2], when=NOW - 3 * DAY_S)  # the least valuable
    put(index, usage, other, [4])
    # a job writes chunks 3, 4 and the anchor at 4 of the same chain: chunks 1 and 2 are its
    protect = set(keys[:4])
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1, protect=protect,
                            **ROOMY)
    assert anchors_in(victims) == [other[3]]
    # a job that reads chunk 1 only: the anchor at 2 may go, and its chunk 2, not chunk 1
    victims = plan_eviction(index, usage, NOW, budget_nbytes=index.nbytes - 1,
                            protect={keys[0]}, **ROOMY)
    assert victims[0] == ("anchor", keys[1]) and ("chunk", keys[0]) not in victims


def test_a_start_seeds_the_last_use_from_the_files_mtimes(tmp_path):
    keys = chain(25)
    index = TierIndex()
    with TierFiles(tmp_path / "tier") as files:
        for kind in ("chunk", "anchor"):
            path = files.path(kind, keys[0])
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.write_bytes(b"x")
            os.utime(path, (NOW - 9 * DAY_S, NOW - 9 * DAY_S))
        index.add_chunk(ChunkEntry(keys[0], 0, G, 1, FP))
        index.add_anchor(AnchorEntry(keys[0], G, (keys[0],), 1, FP))
        usage = TierUsage()
        seed_from_files(usage, files, index)
    assert usage.get("anchor", keys[0], NOW).last_used == NOW - 9 * DAY_S
    assert plan_eviction(index, usage, NOW, budget_nbytes=10**12, **ROOMY) == [
        ("anchor", keys[0]), ("chunk", keys[0])]
    usage.prune(TierIndex())
    assert not usage.uses


# -- properties -------------------------------------------------------------------------------

entry = st.tuples(st.integers(0, 3),  # chain
                  st.integers(1, 6),  # line
                  st.integers(0, 9),  # days since last use
                  st.integers(0, 3))  # hits


@settings(max_examples=300, deadline=None)
@given(st.lists(entry, max_size=10), st.sets(st.tuples(st.integers(0, 3), st.integers(0, 5))),
       st.integers(0, 60_000), st.integers(0, 60_000), st.integers(0, 60_000),
       st.integers(0, 20_000), st.sets(st.tuples(st.integers(0, 3), st.integers(0, 5))))
def test_an_eviction_keeps_every_kept_anchors_chunks_and_fits_when_it_says_so(
        entries, missing, budget, free, floor, nbytes, protected):
    chains = [chain(100 + c) for c in range(4)]
    index, usage = TierIndex(), TierUsage()
    for c, line, days, hits in entries:
        keys = chains[c]
        for i in range(line):
            if keys[i] not in index.chunks and (c, i) not in missing:
                index.add_chunk(ChunkEntry(keys[i], i * G, (i + 1) * G, CHUNK + 7 * i, FP))
                usage.written("chunk", keys[i], NOW - days * DAY_S)
        index.add_anchor(AnchorEntry(keys[line - 1], line * G, tuple(keys[:line]),
                                     ANCHOR + 13 * line, FP))
        usage.written("anchor", keys[line - 1], NOW - days * DAY_S)
        usage.uses[("anchor", keys[line - 1])].hits = hits
    index.check_invariants()
    protect = {chains[c][i] for c, i in protected}
    room = room_for(nbytes, index, usage, NOW, budget_nbytes=budget, free_nbytes=free,
                    floor_nbytes=floor, ttl_s=7 * DAY_S, protect=protect)
    ev = list(room.evict)
    assert len(set(ev)) == len(ev) and all(index.has(kind, k) for kind, k in ev)
    assert not {k for _, k in ev} & protect
    sizes = {("chunk", k): e.nbytes for k, e in index.chunks.items()}
    sizes |= {("anchor", k): e.nbytes for k, e in index.anchors.items()}
    assert room.freed_nbytes == sum(sizes[v] for v in ev)
    gone = set(ev)
    for key, a in index.anchors.items():
        if ("anchor", key) not in gone:  # a kept anchor keeps every chunk it had
            assert not any(("chunk", c) in gone for c in a.chunks)
    for key in index.chunks:
        readers = [a.key for a in index.readers(key)]
        if readers and all(("anchor", r) in gone for r in readers) and key not in protect:
            assert ("chunk", key) in gone  # it went with the last anchor that read it
            last = max(ev.index(("anchor", r)) for r in readers)
            assert ev.index(("chunk", key)) > last
    expired = set(plan_eviction(index, usage, NOW, budget_nbytes=10**15, free_nbytes=10**15,
                                floor_nbytes=0, ttl_s=7 * DAY_S, protect=protect))
    assert expired <= gone
    held, freed = index.nbytes, room.freed_nbytes
    if room.fits:
        assert held - freed + nbytes <= budget and free + freed - nbytes >= floor
    else:
        # every entry it could delete is deleted only when the tier itself cannot fit
        assert held - freed + nbytes > budget or free + freed - nbytes < floor
