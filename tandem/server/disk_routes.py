"""The disk tier over HTTP: its settings read and changed at run time, and its events journaled.

    GET  /v1/cache/disk/settings   the settings in effect
    POST /v1/cache/disk/settings   {"mode": "off", "budget_gb": 8, "ttl_days": 2,
                                    "admit_after": 3, "min_free_gb": 80}

Any subset of the five keys; the rest keep their values. A value of the wrong kind (mode other
than on or off, a number that is not finite, a negative budget, a TTL or admit_after under its
least, a floor under the one the server was started with) is a 400 naming it and changes
nothing. The POST is an admin route (tandem/server/guard.py); it applies the set whole under the
tier's lock (``DiskTier.configure``), so every plan, offer and write from the next request on
sees it, journals an ``EventRow`` (kind memory, task disk_cache, event settings) and answers the
settings in effect. They hold until the next POST or a restart (which takes the config's again).

The tier's events (hit, write, eviction, drop, window, failed_restore, write_failed) happen on
the engine thread and the writer's; the journal is the loop's. ``journal_disk_events`` moves
what the tier gathered since its last call (``DiskTier.drain_events``: token counts and key
prefixes, no text) into journal rows; a task the supervisor owns calls it every
``JOURNAL_PERIOD_S``, the clear and the settings before their own row, and the shutdown once the
writer drained.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import structlog
from aiohttp import web

from tandem.io.eviction import DAY_S
from tandem.io.tier import GB, DiskTier
from tandem.server.body import read_json
from tandem.server.errors import ApiError, bad_request
from tandem.server.guard import admin_route
from tandem.server.journal import EventRow, Journal
from tandem.server.keys import CONFIG, DISK_WRITER, JOURNAL

log = structlog.get_logger("tandem.disk")

SETTING_KEYS = ("mode", "budget_gb", "ttl_days", "admit_after", "min_free_gb")
MODES = ("on", "off")
JOURNAL_PERIOD_S = 0.25  # a hit or a failed restore is in the journal within this (and a bit)


def add_disk_routes(app: web.Application) -> None:
    app.router.add_get("/v1/cache/disk/settings", disk_settings)
    app.router.add_post("/v1/cache/disk/settings", set_disk_settings)


def settings_of(tier: DiskTier) -> dict[str, Any]:
    """The settings in effect, and the floor ``min_free_gb`` may not go under."""
    return {"mode": tier.mode, "budget_gb": tier.budget_nbytes / GB,
            "ttl_days": tier.ttl_s / DAY_S, "admit_after": tier.admission.admit_after,
            "min_free_gb": tier.floor_nbytes / GB,
            "min_free_gb_floor": tier.min_floor_nbytes / GB}


def _tier(request: web.Request) -> DiskTier:
    writer = request.app.get(DISK_WRITER)
    if writer is None:
        raise ApiError(409, "the disk tier is off on this server", code="tier_off")
    tier = writer.tier
    if not isinstance(tier, DiskTier):  # the writer has not started: no request runs yet
        raise ApiError(503, "the disk tier is not open yet", code="disk_writer_starting")
    return tier


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{key} must be a finite number", param=key,
                          code="invalid_disk_settings")
    return float(value)


def validate_settings(body: Any, floor_gb: float) -> dict[str, Any]:
    """The body as ``DiskTier.configure``'s keywords, or the 400 of its first bad field (the
    whole set is checked before anything is applied)."""
    if not isinstance(body, dict) or not body or not set(body) <= set(SETTING_KEYS):
        raise bad_request(f"the body must be an object with some of {list(SETTING_KEYS)}",
                          code="invalid_disk_settings")
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key == "mode":
            if value not in MODES:
                raise bad_request(f"mode must be one of {', '.join(MODES)}", param=key,
                                  code="invalid_disk_settings")
            out[key] = value
        elif key == "admit_after":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad_request("admit_after must be an integer of at least 1", param=key,
                                  code="invalid_disk_settings")
            out[key] = value
        else:
            number = _number(key, value)
            if key == "budget_gb" and number < 0:
                raise bad_request("budget_gb must not be negative", param=key,
                                  code="invalid_disk_settings")
            if key == "ttl_days" and number <= 0:
                raise bad_request("ttl_days must be positive", param=key,
                                  code="invalid_disk_settings")
            if key == "min_free_gb" and number < floor_gb:
                raise bad_request(f"min_free_gb must be at least {floor_gb:g} (the floor the "
                                  "server was started with)", param=key,
                                  code="invalid_disk_settings")
            out[key] = number
    return out


async def disk_settings(request: web.Request) -> web.Response:
    return web.json_response(settings_of(_tier(request)))


@admin_route
async def set_disk_settings(request: web.Request) -> web.Response:
    tier = _tier(request)
    server = request.app[CONFIG].server
    body = await read_json(request, server.max_body_bytes, server.request_read_timeout_s)
    changes = validate_settings(body, tier.min_floor_nbytes / GB)
    tier.configure(**changes)
    effective = settings_of(tier)
    journal = request.app[JOURNAL]
    journal_disk_events(tier, journal)  # what happened under the old settings comes first
    journal.append(EventRow(kind="memory", task="disk_cache", event="settings", t=time.time(),
                            detail={key: effective[key] for key in changes}))
    log.info("disk_settings_changed", **{key: effective[key] for key in changes})
    return web.json_response(effective)


def journal_disk_events(tier: DiskTier, journal: Journal) -> int:
    """Append the tier's events since the last call as journal rows (on the loop); how many."""
    events = tier.drain_events()
    for e in events:
        journal.append(EventRow(kind="memory", task="disk_cache", event=e["event"], t=e["t"],
                                detail={"tokens": int(e["tokens"]), "key": e["key"]}))
    guard = getattr(tier, "guard", None)
    skips = guard.drain_events() if guard is not None else []
    for e in skips:  # the write guard's skips, the tier's and the spill's
        journal.append(EventRow(kind="memory", task="disk_guard", event=e["event"], t=e["t"],
                                detail={k: v for k, v in e.items() if k not in ("event", "t")}))
    return len(events) + len(skips)


async def journal_disk_events_every(tier: DiskTier, journal: Journal,
                                    period_s: float = JOURNAL_PERIOD_S) -> None:
    """The supervisor's task: the tier's events into the journal every ``period_s``, until the
    system stops (the shutdown journals the last ones itself)."""
    while True:
        await asyncio.sleep(period_s)
        journal_disk_events(tier, journal)
