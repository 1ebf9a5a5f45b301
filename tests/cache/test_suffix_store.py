import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.cache.suffix import (SEPARATOR, PersistentSuffixStore, SuffixStoreError,
                                 TokenizerMismatch)

SHA = "ab" * 32
OTHER_SHA = "cd" * 32
REPO = Path(__file__).resolve().parents[2]


def make_store(directory: Path, **kwargs) -> PersistentSuffixStore:
    return PersistentSuffixStore(directory, tokenizer_sha256=kwargs.pop("sha", SHA), **kwargs)


def indexed(store: PersistentSuffixStore) -> PersistentSuffixStore:
    store.swap(store.build_index())
    assert not store.needs_rebuild
    return store


def file_ids(directory: Path) -> list[int]:
    return np.fromfile(directory / "tokens.u32", dtype="<u4").tolist()


def test_a_growing_agent_prompt_appends_only_from_where_it_parts_with_eight_tokens_before(tmp_path):
    store = make_store(tmp_path / "s")
    prompt1, output1 = list(range(100, 130)), list(range(200, 210))
    assert store.add_request(prompt1, output1) == 40
    prompt2, output2 = prompt1 + output1 + list(range(300, 305)), list(range(400, 403))
    assert store.add_request(prompt2, output2) == 8 + 5 + 3
    assert file_ids(tmp_path / "s") == (prompt1 + output1 + [SEPARATOR]
                                        + output1[-8:] + list(range(300, 305)) + output2
                                        + [SEPARATOR])
    assert store.add_request(prompt1, []) == 0  # all of it is a prefix of a recent request
    stats = store.statistics()
    assert (stats["tokens"], stats["documents"]) == (58, 2)
    assert (stats["appended_total"], stats["deduped_total"]) == (56, 32 + 30)
    assert store.needs_rebuild
    store.check_invariants()


def test_a_request_is_deduped_only_against_the_last_four(tmp_path):
    store = make_store(tmp_path / "s")
    first = list(range(1, 21))
    store.add_request(first, [])
    for i in range(4):
        store.add_request([1000 + i] * 20, [])
    assert store.add_request(first, []) == 20  # it left the last four: appended whole again


def test_scope_outputs_keeps_only_what_the_engine_wrote(tmp_path):
    store = make_store(tmp_path / "s", scope="outputs")
    assert store.add_request([1, 2, 3], [7, 8, 9]) == 3
    assert store.add_request([1, 2, 3, 7, 8, 9, 4], [7, 8, 9]) == 0
    assert file_ids(tmp_path / "s") == [7, 8, 9, SEPARATOR]


def test_over_the_cap_the_oldest_half_is_forgotten_at_a_document_boundary(tmp_path):
    store = make_store(tmp_path / "s", cap_mb=0.001)  # 1,048 bytes: 262 ids
    docs = [[d * 1000 + i for i in range(60)] for d in range(1, 6)]
    for doc in docs[:4]:
        store.add_request(doc, [])
    assert store.statistics()["tokens"] == 4 * 61
    store.add_request(docs[4], [])  # 305 ids: half is 152, inside doc 3, so docs 1 to 3 go
    assert file_ids(tmp_path / "s") == docs[3] + [SEPARATOR] + docs[4] + [SEPARATOR]
    stats = store.statistics()
    assert (stats["tokens"], stats["documents"], stats["forgotten_total"]) == (122, 2, 183)
    assert not list((tmp_path / "s").glob("*.tmp"))
    store.check_invariants()
    reopened = indexed(make_store(tmp_path / "s", cap_mb=0.001))
    assert reopened.lookup([4000, 4001], 3) == [4002, 4003, 4004]
    assert reopened.lookup([1000, 1001], 3) == []


def test_a_store_refuses_another_tokenizer(tmp_path):
    make_store(tmp_path / "s").add_request([1, 2, 3], [])
    with pytest.raises(TokenizerMismatch, match=f"{SHA[:12]}.*{OTHER_SHA[:12]}"):
        make_store(tmp_path / "s", sha=OTHER_SHA)
    with pytest.raises(TokenizerMismatch):
        make_store(tmp_path / "s", sha=OTHER_SHA, readonly=True)


def test_a_store_without_a_fingerprint_gets_it_recorded_when_opened_for_writing(tmp_path):
    make_store(tmp_path / "s").add_request([1, 2, 3], [])
    (tmp_path / "s" / "meta.json").write_text(json.dumps({"format": 1}))
    make_store(tmp_path / "s", readonly=True)
    assert "tokenizer_sha256" not in json.loads((tmp_path / "s" / "meta.json").read_text())
    assert make_store(tmp_path / "s").statistics()["tokens"] == 4
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["tokenizer_sha256"] == SHA
    with pytest.raises(TokenizerMismatch):
        make_store(tmp_path / "s", sha=OTHER_SHA)


@pytest.mark.parametrize("existing", [False, True])
def test_the_directory_has_mode_0700(tmp_path, existing):
    directory = tmp_path / "s"
    if existing:
        directory.mkdir(mode=0o755)
        os.chmod(directory, 0o755)
    old_umask = os.umask(0o022)
    try:
        make_store(directory)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_store_inside_the_repository_is_refused():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    with pytest.raises(SuffixStoreError, match="inside the repository"):
        make_store(REPO / "suffix-store-test-never-created")
    assert not (REPO / "suffix-store-test-never-created").exists()


def test_readonly_writes_nothing(tmp_path):
    make_store(tmp_path / "s").add_request(list(range(1, 50)), [60, 61])
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    store = make_store(tmp_path / "s", readonly=True)
    assert store.add_request(list(range(500, 550)), [1, 2]) == 0
    assert store.statistics()["readonly_skipped"] == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    assert indexed(store).lookup([48, 49], 3) == [60, 61]


def test_a_store_written_by_one_process_is_read_by_the_next(tmp_path):
    code = ("import sys; from pathlib import Path; "
            "from tandem.cache.suffix import PersistentSuffixStore as S; "
            f"s = S(Path(sys.argv[1]), tokenizer_sha256='{SHA}'); "
            "s.add_request([5, 6, 7, 8], [9, 10, 11]); s.add_request([20, 21], [22])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], check=True, cwd=REPO)
    store = make_store(tmp_path / "s")
    assert store.lookup([7, 8], 2) == []  # no index yet
    assert store.needs_rebuild
    assert indexed(store).lookup([7, 8], 2) == [9, 10]
    assert store.lookup([20, 21], 5) == [22]
    store.check_invariants()


def test_a_torn_tail_is_cut_to_the_last_whole_id_and_never_served(tmp_path):
    make_store(tmp_path / "s").add_request([1, 2, 3, 4], [])
    with open(tmp_path / "s" / "tokens.u32", "ab") as f:
        f.write(np.array([5, 6], "<u4").tobytes() + b"\x07\x00")  # a document cut mid-id
    readonly = indexed(make_store(tmp_path / "s", readonly=True))
    assert readonly.lookup([5, 6], 3) == []
    assert (tmp_path / "s" / "tokens.u32").stat().st_size == 4 * 7 + 2
    store = indexed(make_store(tmp_path / "s"))
    assert file_ids(tmp_path / "s") == [1, 2, 3, 4, SEPARATOR, 5, 6, SEPARATOR]
    store.add_request([6, 8], [])
    assert indexed(store).lookup([5, 6], 3) == []  # the cut document does not run into the next
    store.check_invariants()


@pytest.mark.parametrize("meta", ["{not json", json.dumps({"format": 2, "tokenizer_sha256": SHA}),
                                  json.dumps([1])])
def test_a_corrupt_meta_is_an_error_when_read_only_and_an_empty_store_when_writing(tmp_path, meta):
    make_store(tmp_path / "s").add_request([1, 2, 3, 4], [])
    (tmp_path / "s" / "meta.json").write_text(meta)
    with pytest.raises(SuffixStoreError, match="meta.json is corrupt"):
        make_store(tmp_path / "s", readonly=True)
    store = indexed(make_store(tmp_path / "s"))
    assert store.statistics()["tokens"] == 0
    assert store.lookup([1, 2], 2) == []
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["tokenizer_sha256"] == SHA
    store.check_invariants()


@pytest.fixture
def store(tmp_path) -> PersistentSuffixStore:
    store = make_store(tmp_path / "s")
    store.add_request([1, 2, 3, 4, 5, 6], [])
    store.add_request([9, 3, 4, 70, 71], [])
    store.add_request([8, 3, 4, 80, 81, 82, 83], [])
    store.add_request([50, 51], [])
    return indexed(store)


def test_the_longest_match_wins(store):
    assert store.lookup([7, 2, 3, 4], 2) == [5, 6]
    assert store.lookup([7, 9, 3, 4], 2) == [70, 71]


def test_the_most_recent_occurrence_is_preferred(store):
    assert store.lookup([7, 7, 3, 4], 3) == [80, 81, 82]


def test_a_proposal_stops_at_a_document_separator_and_respects_k(store):
    assert store.lookup([80, 81], 10) == [82, 83]
    assert store.lookup([80, 81], 1) == [82]
    assert store.lookup([80, 81], 0) == []
    assert store.lookup([82, 83], 4) == []  # only a separator follows
    assert store.lookup([83, 50], 4) == []  # spans two documents: no match


def test_min_and_max_ngram_bound_the_match(store):
    assert store.lookup([4], 2) == []  # shorter than min_ngram
    assert store.lookup([4], 2, min_ngram=1) == [80, 81]
    assert store.lookup([2, 3, 4], 2, max_ngram=2) == [80, 81]
    assert store.lookup([2, 3, 4], 2, max_ngram=3) == [5, 6]


def test_lookup_matches_a_brute_force_reference_on_random_text(tmp_path):
    rng = np.random.default_rng(0)
    store = make_store(tmp_path / "s")
    for _ in range(60):
        store.add_request(rng.integers(0, 8, rng.integers(5, 40)).tolist(), [])
    indexed(store)
    log = file_ids(tmp_path / "s")
    for _ in range(300):
        context = rng.integers(0, 8, 12).tolist()
        assert store.lookup(context, 4, max_ngram=6) == reference(log, context, 4, 6)


def reference(log: list[int], context: list[int], k: int, max_ngram: int) -> list[int]:
    """The longest tail of context (2 to max_ngram tokens) found in the log, then the most
    recent of its occurrences that a token follows (none: no proposal)."""
    for n in range(min(max_ngram, len(context)), 1, -1):
        tail = context[-n:]
        starts = [s for s in range(len(log) - n + 1) if log[s:s + n] == tail]
        if not starts:
            continue
        followed = [s for s in starts if s + n < len(log) and log[s + n] != SEPARATOR]
        if not followed:
            return []
        follow = log[followed[-1] + n:followed[-1] + n + k]
        return follow[:follow.index(SEPARATOR)] if SEPARATOR in follow else follow
    return []


def test_a_second_writer_opens_the_store_read_only_until_the_first_lets_go(tmp_path):
    first = make_store(tmp_path / "s")
    first.add_request([1, 2, 3, 4], [5])
    before = file_ids(tmp_path / "s")
    second = make_store(tmp_path / "s")  # another process, as flock sees it
    assert second.busy and second.readonly and not first.busy
    assert second.add_request([7, 8, 9], [10]) == 0 and second.readonly_skipped == 1
    assert file_ids(tmp_path / "s") == before
    assert indexed(second).lookup([2, 3], 2) == [4, 5]  # it still drafts from what is there
    first.close()
    third = make_store(tmp_path / "s")
    assert not third.busy
    assert third.add_request([7, 8, 9], [10]) > 0
    third.check_invariants()


def test_an_id_the_store_cannot_hold_is_refused_and_the_store_is_unchanged(store):
    before = store.statistics()
    for bad in ([1, 2, 0xFFFFFFFF], [1, 1 << 62], [-1, 3]):  # an image's key is past 2**62
        with pytest.raises(ValueError):
            store.add_request(bad, [5, 6])
    assert store.statistics() == before
