"""The disk tier's admission: which lines a prefill writes, decided before it runs, from the cold
reads counted by key (spec: "Disk tier", its two rules of 0.3.18-test and the written anchor of
0.3.14-test). Plain bookkeeping, no engine: a plan's files are 'written' into a TierIndex as the
disk writer will, except in the test of a real sweep."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tandem.cache.namespace import SHARED, namespace_of
from tandem.io.admission import Admission, DiskPlan
from tandem.io.chain import chain_keys
from tandem.io.fingerprint import Identity
from tandem.io.tierfile import TierFiles
from tandem.io.tierindex import AnchorEntry, ChunkEntry, TierIndex, scan
from tandem.models.third import ThirdModel

import tier_rig

G = 16
FP = "ab" * 32


def toks(n_lines: int, seed: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_lines * G + extra)]


def adm(path=None, **kw) -> Admission:
    kw.setdefault("min_tokens", 4 * G)
    return Admission(path, grid=G, **kw)


def write(index: TierIndex, a: Admission, plan: DiskPlan, chunks: bool = True) -> None:
    """What the disk writer does with a plan that succeeds (``chunks=False``: every chunk write
    failed, the anchors were written)."""
    for b in plan.chunk_lines:
        if chunks:
            index.add_chunk(ChunkEntry(plan.key(b), b - G, b, 4096, FP))
    for b in plan.anchor_lines:
        index.add_anchor(AnchorEntry(plan.key(b), b, plan.chunk_keys(b), 8192, FP))
    done = [e for e in plan.entries() if chunks or e[0] == "anchor"]
    a.done(done)
    a.failed([e for e in plan.entries() if e not in done])
    index.check_invariants()
    a.check_invariants()


def read_cold(a: Admission, prompt, index=None, **kw) -> DiskPlan:
    """A prefill whose plan is then dropped (fenced): only its counts stay."""
    kw.setdefault("start", 0)
    kw.setdefault("taint", None)
    plan = a.decide(prompt, SHARED, on_disk=index or TierIndex(), **kw)
    a.failed(plan.entries())
    return plan


def counts(a: Admission, prompt, namespace=SHARED) -> list[int]:
    return [a.count_of(k) for k in chain_keys(prompt, G, namespace)]


# -- counting ---------------------------------------------------------------------------------

def test_only_the_lines_a_prefill_forwards_cold_are_counted():
    a = adm()
    prompt = toks(10, 1, extra=5)  # the partial chunk at the end is no line
    read_cold(a, prompt, start=4 * G)
    assert counts(a, prompt) == [0] * 4 + [1] * 6
    read_cold(a, prompt)
    assert counts(a, prompt) == [1] * 4 + [2] * 6
    assert a.statistics()["lines_counted"] == 16


def test_the_cache_salt_keeps_counts_apart():
    a = adm()
    prompt = toks(6, 2)
    read_cold(a, prompt)
    assert counts(a, prompt, namespace_of("tenant")) == [0] * 6
    plan = a.decide(prompt, namespace_of("tenant"), start=0, taint=None, on_disk=TierIndex())
    assert plan.empty  # a first read in its namespace, whatever the shared one saw


def test_a_line_is_admitted_at_its_second_cold_read_and_the_longest_such_line_wins():
    a = adm()
    head = toks(8, 3)
    first = head + toks(4, 4)
    second = head[:6 * G] + toks(5, 5)  # parts from the first inside its eighth line
    assert read_cold(a, first).empty
    plan = a.decide(second, SHARED, start=0, taint=None, on_disk=TierIndex())
    assert plan.anchor_lines == (6 * G,)
    assert plan.chunk_lines == tuple(b * G for b in range(1, 7))
    assert plan.keys == tuple(chain_keys(second, G, SHARED)[:6])
    assert "repeated" in plan.reasons[0]


def test_admit_after_sets_how_many_cold_reads_a_line_needs():
    a = adm(admit_after=3)
    prompt = toks(6, 6)
    assert read_cold(a, prompt).empty
    assert read_cold(a, prompt).empty
    assert read_cold(a, prompt).anchor_lines == (6 * G,)
    a.configure(admit_after=1)  # from the next request
    other = toks(5, 7)
    assert read_cold(a, other).anchor_lines == (5 * G,)


def test_a_line_whose_anchor_is_on_disk_is_not_written_again_and_its_chunks_neither():
    a, index = adm(), TierIndex()
    prompt = toks(6, 8)
    read_cold(a, prompt)
    write(index, a, a.decide(prompt, SHARED, start=0, taint=None, on_disk=index))
    assert index.longest_anchor(chain_keys(prompt, G, SHARED)).line == 6 * G
    assert a.decide(prompt, SHARED, start=0, taint=None, on_disk=index).empty
    longer = prompt + toks(3, 9)
    read_cold(a, longer, index, start=6 * G)
    plan = a.decide(longer, SHARED, start=6 * G, taint=None, on_disk=index)
    assert plan.anchor_lines == (9 * G,) and plan.chunk_lines == (7 * G, 8 * G, 9 * G)


# -- a session's head -------------------------------------------------------------------------

def test_a_sessions_first_long_request_gets_anchors_at_the_last_lines_below_its_last_user_message():
    a = adm()
    prompt = toks(12, 10, extra=3)
    user = 9 * G + 5
    plan = a.decide(prompt, SHARED, start=0, taint=None, on_disk=TierIndex(),
                    first_of_session=True, last_user_start=user)
    assert plan.anchor_lines == (6 * G, 7 * G, 8 * G, 9 * G)
    assert all(r == ("head",) for r in plan.reasons)
    assert plan.chunk_lines == tuple(b * G for b in range(1, 10))
    on_line = adm()
    plan = on_line.decide(prompt, SHARED, start=0, taint=None, on_disk=TierIndex(),
                          first_of_session=True, last_user_start=9 * G)
    assert plan.anchor_lines[-1] == 9 * G  # a line where the message starts holds none of it


def test_a_later_request_of_a_session_gets_no_head_anchors():
    a = adm()
    plan = a.decide(toks(12, 11), SHARED, start=0, taint=None, on_disk=TierIndex(),
                    first_of_session=False, last_user_start=9 * G)
    assert plan.empty


def test_head_anchors_are_only_the_lines_the_prefill_passes_and_their_chunks_come_from_the_rows_in_place():
    a = adm(head_anchors=4)
    plan = a.decide(toks(12, 12), SHARED, start=7 * G, taint=None, on_disk=TierIndex(),
                    first_of_session=True, last_user_start=9 * G)
    assert plan.anchor_lines == (8 * G, 9 * G)
    assert plan.chunk_lines == tuple(b * G for b in range(1, 10))


def test_a_head_whose_chunks_failed_is_admitted_again_by_the_next_first_request():
    a, index = adm(), TierIndex()
    head = toks(8, 13)
    first = head + toks(2, 14)
    kw = dict(start=0, taint=None, first_of_session=True, last_user_start=8 * G)
    plan = a.decide(first, SHARED, on_disk=index, **kw)
    assert plan.anchor_lines == (5 * G, 6 * G, 7 * G, 8 * G)
    # while the job is in flight, a second session's plan does not name the same files
    second = head + toks(2, 15)
    assert a.decide(second, SHARED, on_disk=index, **kw).empty
    write(index, a, plan, chunks=False)  # the anchors landed, every chunk failed
    third = head + toks(2, 16)
    chain = chain_keys(third, G, SHARED)
    assert index.longest_anchor(chain) is None
    again = a.decide(third, SHARED, on_disk=index, **kw)
    # an anchor counts as written only with every chunk below it: the chunks it lacks are
    # written, the anchors' state is on disk already
    assert again.anchor_lines == () and again.repaired == (5 * G, 6 * G, 7 * G, 8 * G)
    assert again.chunk_lines == tuple(b * G for b in range(1, 9))
    write(index, a, again)
    assert index.longest_anchor(chain).line == 8 * G
    assert a.decide(head + toks(2, 17), SHARED, on_disk=index, **kw).empty


def test_a_failed_write_takes_its_entries_out_of_the_pending_ones():
    a, index = adm(), TierIndex()
    prompt = toks(6, 17)
    kw = dict(start=0, taint=None, first_of_session=True, last_user_start=6 * G)
    plan = a.decide(prompt, SHARED, on_disk=index, **kw)
    assert not plan.empty and a.decide(prompt, SHARED, on_disk=index, **kw).empty
    a.failed(plan.entries())
    assert a.decide(prompt, SHARED, on_disk=index, **kw).anchor_lines == plan.anchor_lines


# -- branches ---------------------------------------------------------------------------------

def test_a_line_where_an_earlier_prompt_went_on_differently_gets_a_branch_anchor():
    a = adm()
    shared, rest = toks(4, 20), toks(4, 21)
    read_cold(a, shared + rest + toks(3, 22))
    read_cold(a, shared + toks(5, 23))  # parts at line 4
    third = shared + rest + toks(3, 24)  # counts 3 3 3 3 2 2 2 2 1 1 1
    assert counts(a, third)[:9] == [2] * 4 + [1] * 4 + [0]
    plan = a.decide(third, SHARED, start=0, taint=None, on_disk=TierIndex())
    assert dict(zip(plan.anchor_lines, plan.reasons)) == {
        4 * G: ("branch",), 8 * G: ("repeated", "branch")}


def test_branches_are_only_in_the_head_two_sessions_can_share():
    a = adm()
    shared, rest = toks(4, 25), toks(4, 26)
    read_cold(a, shared + rest + toks(3, 27))
    read_cold(a, shared + toks(5, 28))
    third = shared + rest + toks(3, 29)
    # the conversation's first answer starts inside line 3: line 4 is past the shared head
    plan = a.decide(third, SHARED, start=0, taint=None, on_disk=TierIndex(), head_stop=3 * G + 7)
    assert plan.anchor_lines == (8 * G,) and plan.reasons == (("repeated",),)


def test_only_the_branch_max_longest_branches_get_anchors():
    a = adm(min_tokens=0)
    line = toks(7, 30)
    for k in range(1, 7):  # the k-th prompt shares k lines with the last one
        read_cold(a, line[:k * G] + toks(2, 40 + k))
    last = line + toks(1, 50)
    plan = a.decide(last, SHARED, start=0, taint=None, on_disk=TierIndex())
    assert counts(a, last) == [7, 6, 5, 4, 3, 2, 1, 1]
    assert plan.anchor_lines == (3 * G, 4 * G, 5 * G, 6 * G)
    assert a.branch_max == 4


def test_two_folders_a_deploy_and_a_new_folder_resume_at_the_branch_line(tmp_path):
    """The spec's case: sessions in folders A and B, a deploy that sweeps every file, a third
    session in A (it writes the branch line, its own head and its repeated line), and a fourth
    in a new folder, which finds the branch line on disk."""
    path = tmp_path / "admission.counts"
    tools = toks(8, 60)  # the tool block and the system text up to the working directory
    env = {f: toks(6, 61 + i) for i, f in enumerate("ABC")}

    def session(folder: str, seed: int) -> tuple[list[int], int]:
        head = tools + env[folder]
        return head + toks(2, seed, extra=9), len(head)

    def first_request(a, index, folder, seed) -> DiskPlan:
        prompt, user = session(folder, seed)
        hit = index.longest_anchor(chain_keys(prompt, G, SHARED))
        plan = a.decide(prompt, SHARED, start=hit.line if hit else 0, taint=None,
                        on_disk=index, first_of_session=True, last_user_start=user)
        write(index, a, plan)
        return plan

    def run(branch_max: int) -> int:
        a, index = adm(path, branch_max=branch_max), TierIndex()
        assert first_request(a, index, "A", 70).anchor_lines == (11 * G, 12 * G, 13 * G, 14 * G)
        first_request(a, index, "B", 71)
        a.save()
        a, index = adm(path, branch_max=branch_max), TierIndex()  # the deploy
        third = first_request(a, index, "A", 72)
        reasons = dict(zip(third.anchor_lines, third.reasons))
        assert set(reasons) >= {11 * G, 12 * G, 13 * G, 14 * G}
        assert "repeated" in reasons[14 * G]
        fourth, _ = session("C", 73)
        hit = index.longest_anchor(chain_keys(fourth, G, SHARED))
        a.clear()
        return hit.line if hit else 0

    assert run(branch_max=4) == 8 * G
    assert run(branch_max=0) == 0  # without the rule the new folder reads its head cold


# -- what is never written --------------------------------------------------------------------

def test_a_prompt_under_min_tokens_writes_nothing_but_is_counted():
    a = adm(min_tokens=6 * G)
    short = toks(5, 80, extra=G - 1)
    kw = dict(start=0, taint=None, on_disk=TierIndex(), first_of_session=True,
              last_user_start=4 * G)
    assert a.decide(short, SHARED, **kw).empty
    assert a.decide(short, SHARED, **kw).empty  # its lines are counted twice now
    assert counts(a, short) == [2] * 5
    plan = a.decide(short + [1], SHARED, **kw)  # min_tokens now: the head and the line read thrice
    assert plan.anchor_lines == (G, 2 * G, 3 * G, 4 * G, 5 * G)


def test_a_request_resumed_from_a_session_snapshot_counts_and_writes_nothing():
    a = adm()
    prompt = toks(8, 81)
    read_cold(a, prompt)
    plan = a.decide(prompt, SHARED, start=0, taint=None, on_disk=TierIndex(),
                    first_of_session=True, last_user_start=6 * G, from_snapshot=True)
    assert plan.empty and counts(a, prompt) == [1] * 8


@pytest.mark.parametrize("start,taint", [(6 * G, 3 * G), (6 * G, 6 * G - 1), (5 * G + 3, None),
                                         (5 * G + 3, 9 * G)])
def test_a_request_resumed_above_taint_or_off_the_grid_counts_and_writes_nothing(start, taint):
    a = adm()
    prompt = toks(10, 82)
    read_cold(a, prompt)
    plan = a.decide(prompt, SHARED, start=start, taint=taint, on_disk=TierIndex(),
                    first_of_session=True, last_user_start=9 * G)
    assert plan.empty and counts(a, prompt) == [1] * 10


@pytest.mark.parametrize("taint", [6 * G, 8 * G + 5])
def test_a_resume_at_a_grid_line_at_or_below_taint_prefills_cold_again_and_is_written(taint):
    a = adm()
    prompt = toks(10, 83)
    plan = a.decide(prompt, SHARED, start=6 * G, taint=taint, on_disk=TierIndex(),
                    first_of_session=True, last_user_start=9 * G)
    assert plan.anchor_lines == (7 * G, 8 * G, 9 * G)
    assert counts(a, prompt) == [0] * 6 + [1] * 4


# -- the counts file --------------------------------------------------------------------------

def test_the_counts_survive_a_reopen_and_a_clear_drops_them(tmp_path):
    path = tmp_path / "admission.counts"
    a = adm(path)
    prompt = toks(6, 90)
    read_cold(a, prompt)
    assert a.dirty and a.save() and not a.dirty
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert not os.path.exists(str(path) + ".tmp")
    b = adm(path)
    assert counts(b, prompt) == [1] * 6 and b.seq == a.seq
    assert b.decide(prompt, SHARED, start=0, taint=None,
                    on_disk=TierIndex()).anchor_lines == (6 * G,)
    b.clear()
    assert counts(b, prompt) == [0] * 6 and not b.pending
    assert counts(adm(path), prompt) == [0] * 6  # the clear is on disk at once


def test_the_counts_outlive_a_new_fingerprint_that_sweeps_every_file(tmp_path):
    """A deploy that changes the arithmetic deletes every file of the tier; the counts file
    beside them stays, and the next session's cold read of the shared head is its second."""
    model = ThirdModel()
    g = tier_rig.GRID
    with TierFiles(tmp_path / "tier") as files:
        path = files.root / "admission.counts"
        a = Admission(path, grid=g, min_tokens=2 * g)
        head = tier_rig.tokens(model.vocab_size, 3 * g, 1)
        first = head + tier_rig.tokens(model.vocab_size, g + 5, 2)
        plan = a.decide(first, SHARED, start=0, taint=None, on_disk=TierIndex(),
                        first_of_session=True, last_user_start=3 * g)
        assert plan.anchor_lines
        tier_rig.write_prompt(files, model, first, list(plan.anchor_lines))
        a.done(plan.entries())
        a.save()
        (files.root / "ab").mkdir(mode=0o700)
        (files.root / "ab" / "junk.tmp").write_bytes(b"x")  # a crashed write
        index, report = scan(files, Identity("cd" * 32), g)  # the new fingerprint
        assert report.other_fingerprint > 0 and not index.chunks and not index.anchors
        assert path.exists()
        b = Admission(path, grid=g, min_tokens=2 * g)
        second = head + tier_rig.tokens(model.vocab_size, g + 5, 3)
        plan = b.decide(second, SHARED, start=0, taint=None, on_disk=index)
        assert plan.anchor_lines == (3 * g,) and "repeated" in plan.reasons[0]


@pytest.mark.parametrize("damage", ["flip", "cut", "foreign", "grid", "empty"])
def test_a_damaged_counts_file_starts_empty_and_says_so(tmp_path, damage):
    path = tmp_path / "admission.counts"
    a = adm(path)
    prompt = toks(6, 91)
    read_cold(a, prompt)
    a.save()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[40] ^= 0x10  # inside the first record
    elif damage == "cut":
        data = data[:-7]
    elif damage == "foreign":
        data[:8] = b"NOTOURS!"
    elif damage == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))
    with capture_logs() as logs:
        b = Admission(path, grid=2 * G if damage == "grid" else G, min_tokens=4 * G)
    assert not b.counts and b.seq == 0
    events = [e for e in logs if e["event"] == "disk_admission_counts_unreadable"]
    assert len(events) == 1
    want = {"flip": "corrupt", "cut": "truncated", "foreign": "foreign", "grid": "grid",
            "empty": "truncated"}[damage]
    assert events[0]["reason"] == want
    b.check_invariants()
    read_cold(b, prompt)
    assert b.save()  # and the next save replaces it
    assert Admission(path, grid=b.grid).counts == b.counts


def test_a_symlink_where_the_counts_file_should_be_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    path = tmp_path / "admission.counts"
    path.symlink_to(target)
    with capture_logs() as logs:
        a = adm(path)
    assert not a.counts
    assert [e["reason"] for e in logs if e["event"] == "disk_admission_counts_unreadable"] \
        == ["refused"]
    read_cold(a, toks(5, 92))
    assert a.save()
    assert target.read_bytes() == b"secret" and not path.is_symlink()


def test_an_unwritable_folder_is_logged_and_never_raised(tmp_path):
    a = adm(tmp_path / "gone" / "admission.counts")
    read_cold(a, toks(5, 93))
    with capture_logs() as logs:
        assert a.save() is False
    assert [e["event"] for e in logs] == ["disk_admission_counts_unsaved"]
    assert a.dirty


def test_the_counts_are_bounded_and_the_least_recently_counted_go_first(tmp_path):
    a = adm(tmp_path / "c", max_lines=8)
    old, new = toks(5, 94), toks(5, 95)
    read_cold(a, old)
    read_cold(a, new)
    assert len(a.counts) == 8
    assert counts(a, new) == [1] * 5 and sum(counts(a, old)) == 3
    a.save()
    assert len(adm(tmp_path / "c", max_lines=4).counts) == 4


# -- properties -------------------------------------------------------------------------------

request = st.tuples(st.integers(0, 3),  # which prefix family
                    st.integers(1, 10),  # lines shared with the family
                    st.integers(0, 3),  # own lines after
                    st.integers(0, 6),  # start line (capped below the prompt's end)
                    st.booleans(),  # first of its session
                    st.booleans())  # the writer succeeds


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=1, max_size=12), st.integers(1, 3))
def test_every_plan_names_lines_it_may_write_and_every_chunk_its_anchors_need(reqs, after):
    a, index = adm(admit_after=after, min_tokens=2 * G), TierIndex()
    model: dict[str, int] = {}
    families = {f: toks(10, 100 + f) for f in range(4)}
    unwritten: list[DiskPlan] = []
    for n, (family, shared, own, start_line, first, succeeds) in enumerate(reqs):
        prompt = families[family][:shared * G] + toks(own, 200 + n, extra=3)
        lines = len(prompt) // G
        start = min(start_line, lines - 1) * G if lines else 0
        chain = chain_keys(prompt, G, SHARED)
        pending_before = set(a.pending)
        plan = a.decide(prompt, SHARED, start=start, taint=None, on_disk=index,
                        first_of_session=first, last_user_start=shared * G)
        for k in chain[start // G:]:
            model[k] = model.get(k, 0) + 1
        assert all(a.count_of(k) == model.get(k, 0) for k in chain)
        assert not set(plan.entries()) & pending_before
        assert all(start < b <= len(prompt) for b in plan.anchor_lines)
        assert set(plan.repaired).isdisjoint(plan.anchor_lines)
        for b in plan.anchor_lines + plan.repaired:
            for j, k in enumerate(chain[:b // G]):
                assert (k in index.chunks or (j + 1) * G in plan.chunk_lines
                        or ("chunk", k) in a.pending), (b, j)
        if len(prompt) < 2 * G:
            assert plan.empty
        if succeeds:
            write(index, a, plan)
        else:
            unwritten.append(plan)
        a.check_invariants()
    for plan in unwritten:
        a.failed(plan.entries())
    assert not a.pending
