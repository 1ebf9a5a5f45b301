"""The tower's cache (issue 19, part 4): rows kept by digest within a byte budget, least
recently used out first; an entry over the whole budget is refused and drops nothing."""

import torch

from tandem.cache.tower import TowerCache


def _rows(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n, 4), fill, dtype=torch.float32)  # 16 bytes a row


def test_a_digest_seen_before_is_a_hit_and_returns_the_rows_kept():
    cache = TowerCache(budget_nbytes=1024)
    assert cache.get("a") is None
    rows = _rows(8, 1.5)
    assert cache.put("a", rows)
    assert torch.equal(cache.get("a"), rows)
    assert cache.statistics() == {"entries": 1, "nbytes": 128, "budget_nbytes": 1024,
                                  "hits": 1, "misses": 1, "evictions": 0, "refused": 0}


def test_the_least_recently_used_goes_first_when_the_budget_is_full():
    cache = TowerCache(budget_nbytes=3 * 128)
    for name in "abc":
        cache.put(name, _rows(8))
    cache.get("a")                      # a is now the most recent; b the least
    cache.put("d", _rows(8))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.nbytes == 3 * 128 and cache.evictions == 1


def test_rows_over_the_whole_budget_are_refused_and_drop_nothing():
    cache = TowerCache(budget_nbytes=256)
    cache.put("a", _rows(8))
    assert not cache.put("huge", _rows(64))
    assert "a" in cache and "huge" not in cache and cache.refused == 1


def test_putting_a_digest_again_replaces_its_rows_and_its_bytes():
    cache = TowerCache(budget_nbytes=1024)
    cache.put("a", _rows(8))
    cache.put("a", _rows(4, 2.0))
    assert cache.nbytes == 64 and len(cache) == 1
    assert torch.equal(cache.get("a"), _rows(4, 2.0))
    assert cache.clear() == 1 and cache.nbytes == 0 and len(cache) == 0
