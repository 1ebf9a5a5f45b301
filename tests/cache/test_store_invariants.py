"""The store's invariant check (tandem/cache/store.py StoreCore.check_invariants) runs after
every request, so it hashes each entry's key ids once (when first checked) and one more entry
in turn each call, rather than every entry every call. It still finds an entry put under a
wrong hash on the first call after its put, and a key list that changed after its put (an
alias of a list that grows) within as many calls as there are entries; and it hashes no more
than that."""

import pytest

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.cache.store import StoreCore, StoreEntry, token_hash


def _core(hashed: list) -> StoreCore:
    def counting_hash(ids):
        hashed.append(len(ids))
        return token_hash(ids)

    return StoreCore(MemoryAccountant({"store": 1 << 20}), entry_nbytes=1 << 20,
                     hash_fn=counting_hash)


def _put(core: StoreCore, key: list[int], key_hash: int | None = None) -> StoreEntry:
    entry = StoreEntry(key, "prefix", SectionsCopy({}), RowsCopy(0, len(key), {}), None, 10,
                       token_hash(key) if key_hash is None else key_hash)
    assert core.admit(key, "prefix", 10) == "reserved"
    core.insert(entry)
    return entry


def test_each_call_hashes_the_new_entries_and_one_more_in_turn():
    hashed: list[int] = []
    core = _core(hashed)
    for i in range(6):
        _put(core, [i] * (10 + i))
    hashed.clear()
    core.check_invariants()
    assert len(hashed) == 6  # every entry once: each is new to the check
    for _ in range(4):
        hashed.clear()
        core.check_invariants()
        assert len(hashed) == 1  # one in turn
    _put(core, [99] * 20)
    hashed.clear()
    core.check_invariants()
    assert len(hashed) == 2 and 20 in hashed  # the new one and one in turn


def test_a_wrong_hash_is_found_on_the_next_call_and_a_changed_key_within_a_round():
    core = _core([])
    for i in range(5):
        _put(core, [i] * 8)
    core.check_invariants()
    _put(core, [7] * 8, key_hash=token_hash([8] * 8))
    with pytest.raises(AssertionError, match="wrong hash"):
        core.check_invariants()

    core = _core([])
    entries = [_put(core, [i] * 8) for i in range(5)]
    core.check_invariants()
    entries[2].key_ids[0] = 99  # an alias changed in place after the put (its length kept)
    for _ in range(len(entries)):
        try:
            core.check_invariants()
        except AssertionError as e:
            assert "wrong hash" in str(e)
            break
    else:
        pytest.fail("a changed key was never found")
