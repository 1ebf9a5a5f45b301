import numpy as np
import pytest

from tandem.cache.drafter import LookupDrafter
from tandem.cache.suffix import PersistentSuffixStore


@pytest.fixture
def store(tmp_path) -> PersistentSuffixStore:
    store = PersistentSuffixStore(tmp_path / "s", tokenizer_sha256="ab" * 32)
    store.add_request([10, 11, 12, 13, 14, 15], [16, 17])
    store.swap(store.build_index())
    return store


def test_repetitive_text_proposes_what_followed_its_last_occurrence():
    drafter = LookupDrafter()
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9]
    drafter.start(prompt)
    assert drafter.propose(prompt + [1, 2], 3) == [3, 9, 9]  # the most recent "1 2"
    assert drafter.propose(prompt + [1, 2, 3, 4], 3) == [5, 6, 1]  # "1 2 3 4", the prompt's head


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    drafter = LookupDrafter()
    context = [7, 8, 9, 50, 1, 8, 9, 60, 2, 7, 8, 9]
    assert drafter.propose(context, 2) == [50, 1]


def test_a_proposal_may_run_to_the_context_end_and_respects_k():
    drafter = LookupDrafter()
    context = [1, 2, 3, 1, 2]
    assert drafter.propose(context, 5) == [3, 1, 2]
    assert drafter.propose(context + [3], 2) == [1, 2]
    assert drafter.propose(context + [3], 0) == []


def test_fresh_text_proposes_nothing(store):
    drafter = LookupDrafter(store)
    context = list(range(100, 140))
    drafter.start(context[:30])
    for end in range(30, 41):
        assert drafter.propose(context[:end], 4) == []
    assert drafter.statistics()["misses"] == 11


def test_the_context_comes_first_then_the_store(store):
    drafter = LookupDrafter(store)
    drafter.start([12, 13, 99, 5])
    assert drafter.propose([12, 13, 99, 5, 12, 13], 3) == [99, 5, 12]
    drafter.start([40, 41])
    assert drafter.propose([40, 41, 12, 13], 3) == [14, 15, 16]
    stats = drafter.statistics()
    assert (stats["lookups"], stats["hits_context"], stats["hits_store"], stats["misses"]) == (
        2, 1, 1, 0)


def test_a_growing_context_gives_what_a_fresh_drafter_gives():
    rng = np.random.default_rng(0)
    context = rng.integers(0, 5, 400).tolist()
    growing = LookupDrafter(max_ngram=6)
    growing.start(context[:100])
    for end in range(100, 401, 3):
        assert growing.propose(context[:end], 4) == LookupDrafter(max_ngram=6).propose(
            context[:end], 4) == reference(context[:end], 4, 6)


def test_a_shorter_context_starts_over():
    drafter = LookupDrafter()
    drafter.start([1, 2, 3, 4, 1, 2, 3, 4, 5])
    assert drafter.propose([6, 7, 6], 2) == []
    assert drafter.propose([6, 7, 6, 7], 2) == [6, 7]


def reference(context: list[int], k: int, max_ngram: int) -> list[int]:
    """Longest tail (2 to max_ngram tokens) with an earlier occurrence; its most recent one."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), 1, -1):
        for end in range(length - 1, n - 1, -1):
            if context[end - n:end] == context[length - n:]:
                return context[end:end + k]
    return []


def test_a_draft_stops_before_an_images_key_and_the_store_never_sees_one():
    """A prompt with images holds their key ids: text before an image that repeats would draft
    the image's rows, which no decode step may forward (issue 19, part 3)."""
    from tandem.models.image_keys import KEY_BASE

    class Store:
        asked = []

        def lookup(self, context, k, **_):
            self.asked.append(list(context))
            return [7, 7]

    key = KEY_BASE + 12345
    context = [1, 2, 3, key, key, 9, 1, 2, 3]
    drafter = LookupDrafter(Store())
    drafter.start(context)
    assert drafter.propose(context, 4) == []  # "1 2 3" is followed by the image's rows
    tail = [5, key, 6]
    assert LookupDrafter(Store()).propose(tail, 2) == [] and Store.asked == []
