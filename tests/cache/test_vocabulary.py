"""The caches' words: every source maps to one tier through tier_of (the spec's peek names),
and no other word passes."""

import pytest

from tandem.cache.vocabulary import PEEK_TIERS, SOURCES, TIERS, tier_of


def test_every_resident_source_is_the_resident_tier():
    for source in ("engine", "resident", "prompt_end", "end"):
        assert tier_of(source) == "resident"


def test_each_tier_of_rows_has_the_spec_s_peek_name():
    assert tier_of("cold") == "none"
    assert tier_of("park") == tier_of("pin") == "ram_park"
    assert tier_of("store") == "ram_snapshot"
    assert tier_of("spill") == "nvme_spill"
    assert tier_of("disk") == "disk_tier"
    assert set(PEEK_TIERS) == {"resident", "ram_park", "ram_snapshot", "nvme_spill",
                               "disk_tier", "none"}
    assert set(SOURCES) == {"cold", "engine", "resident", "prompt_end", "end", "pin", "park",
                            "store", "disk", "spill", "response", "continuation",
                            "prepared"}


def test_the_answers_kept_whole_keep_their_own_words_outside_the_peek_s_tiers():
    assert tier_of("response") == "response"
    assert tier_of("prepared") == "prepared"  # the preparer's summaries, no engine ran
    assert {"response", "prepared"}.isdisjoint(PEEK_TIERS)
    assert set(TIERS) == set(PEEK_TIERS) | {"response", "prepared"}


def test_a_continuation_counts_as_the_resident_tier_by_itself():
    # Its usage frame names the tier its rows came from (in place, the park, the spill).
    assert tier_of("continuation") == "resident"


def test_an_unknown_source_is_refused_rather_than_called_resident():
    with pytest.raises(ValueError):
        tier_of("nvme")  # a tier added later must name its source here first
