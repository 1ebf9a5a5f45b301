"""The caches' words: every source maps to one tier through tier_of, and no other word passes."""

import pytest

from tandem.cache.vocabulary import SOURCES, tier_of


def test_every_resident_source_is_the_resident_tier():
    for source in ("engine", "resident", "prompt_end", "end", "pin", "park"):
        assert tier_of(source) == "resident"


def test_the_store_the_disk_the_spill_and_the_response_cache_are_their_own_tiers():
    assert tier_of("store") == "store"
    assert tier_of("disk") == "disk"
    assert tier_of("spill") == "spill"
    assert tier_of("prepared") == "prepared"  # the preparer's summaries, no engine ran
    assert tier_of("response") == "response"
    assert tier_of("cold") is None
    assert set(SOURCES) == {"cold", "engine", "resident", "prompt_end", "end", "pin", "park",
                            "store", "disk", "spill", "response", "continuation",
                            "prepared"}


def test_a_continuation_counts_as_the_resident_tier_by_itself():
    # Its usage frame names the tier its rows came from (in place, the park, the spill).
    assert tier_of("continuation") == "resident"


def test_an_unknown_source_is_refused_rather_than_called_resident():
    with pytest.raises(ValueError):
        tier_of("nvme")  # a tier added later must name its source here first
