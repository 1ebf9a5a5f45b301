"""The caches' words as types: where a prompt's rows came from, the tier that holds such a copy,
and why a generation ended. One function, :func:`tier_of`, maps a source to its tier; usage,
the journal, the console, the planner and the peek (tandem/server/peek_routes.py) all go
through it.

Tiers (``usage.tandem.cache.tier``, the journal's ``cache_tier``, the peek's ``tier``; the
spec's "Peek and prewarm" names): ``resident`` (the rows in place: a grid anchor, the end or
prompt-end anchor, the engine's own rows), ``ram_park`` (the parked session or the pinned
head), ``ram_snapshot`` (the state store), ``nvme_spill`` (the session spill), ``disk_tier``
(the disk tier's files) and ``none`` (a cold prompt). Two answers that no tier of rows served
keep their own words: ``response`` (the response cache answered, no engine ran) and
``prepared`` (a compaction answered from the summary the preparer wrote ahead); a peek never
names them.

Sources (``usage.tandem.cache.source``):

- ``cold``: nothing was resumed; ``engine``: the engine alone resumed rows in place (caches off);
- ``resident``: a grid anchor; ``prompt_end``: the state at the end of the last prompt (the
  same prompt again, or one going on from it and part of its answer);
  ``end``: the end of the last answer; ``pin``: the head a compaction pinned; ``park``: a
  conversation parked when another came (all in the resident tier);
- ``store``: a state store snapshot; ``disk``: the disk tier's chunk and anchor files (above the
  rows in place); ``spill``: a whole conversation read back from the session spill on the NVMe;
  ``response``: the response cache answered, no engine ran;
- ``continuation``: a compaction request served as the continuation of the conversation the
  engine held for its session (tandem/server/compaction.py): the prefill resumed at the end
  anchor of its last generation (in place, parked or on the NVMe) and read only the new turn.
  Its tier is the resident's here; the usage frame names the tier the rows really came from;
- ``prepared``: a compaction request answered from the summary the compaction preparer wrote
  ahead at that end anchor, with the same system text and template: no engine ran.
"""

from __future__ import annotations

from typing import Literal, get_args

Source = Literal["cold", "engine", "resident", "prompt_end", "end", "pin", "park", "store",
                 "disk", "spill", "response", "continuation", "prepared"]
Tier = Literal["resident", "ram_park", "ram_snapshot", "nvme_spill", "disk_tier", "none",
               "response", "prepared"]
# How a generation that ran ended (the engine's word); the routes add "tool_calls" and "error".
FinishReason = Literal["stop", "length", "cancelled"]

SOURCES: tuple[str, ...] = get_args(Source)
TIERS: tuple[str, ...] = get_args(Tier)
# The tiers a peek answers with: where rows are, never an answer kept whole.
PEEK_TIERS: tuple[str, ...] = ("resident", "ram_park", "ram_snapshot", "nvme_spill",
                               "disk_tier", "none")
_OWN_TIER = {"cold": "none", "park": "ram_park", "pin": "ram_park", "store": "ram_snapshot",
             "spill": "nvme_spill", "disk": "disk_tier", "response": "response",
             "prepared": "prepared"}


def tier_of(source: Source) -> Tier:
    """The tier holding the copy a source names (``none`` for a cold prompt). The engine's own
    rows in place, the end and prompt-end anchors and a continuation count as the resident
    tier's (they are what the resident prefix keeps)."""
    if source not in SOURCES:
        raise ValueError(f"unknown cache source {source!r}")
    return _OWN_TIER.get(source, "resident")  # type: ignore[return-value]
