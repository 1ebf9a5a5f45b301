"""The console: a live page at GET /console and the same data as JSON at GET /v1/actors.

The page (static/console.html: HTML, CSS and JS in one file, no build step, no external URL)
polls /v1/actors about twice a second. The document:

    {
      "at_s":    wall-clock seconds of this snapshot,
      "actors":  [ActorStatistics as builtins + "rate_msg_s" (null until a second sample) and,
                  in each of "last_messages", "ago_s" on the actor's own clock],
      "graph":   {"nodes": [GraphNode...], "edges": [GraphEdge...]} or null,
      "engine":  app[ENGINE].snapshot() or null,
      "journal": the last 20 request rows of app[JOURNAL].tail (newest last) or null: the
                 cache events (kind "memory", the disk tier's by the hundred) are left out,
                 the disk panel shows the tier's last ones,
      "cache":   await app[CACHE_STATS]() ({"tiers": {name: {counters}}}) or null,
      "memory":  await app[MEMORY]() (the governor's report: limits, held, levels, sheds) or null,
      "errors":  {part: exception type name} for the parts whose source raised,
    }

A part whose key is not in the app (no engine yet) is null; a source that raises is logged and
its part is null too, so one broken source never blanks the whole console. A source may be a
coroutine function (the cache stats and the memory report ask their actors): it is awaited.

Rates are computed here, not in the page, so every client sees the same number: a `RateMeter`
keeps one sample per actor and refreshes it when at least `min_interval_s` has passed, so that
several pages polling at once do not turn each other's deltas into noise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web

from tandem.actors.clock import SYSTEM_CLOCK, Clock
from tandem.actors.runtime import ActorStatistics
from tandem.server.keys import CACHE_STATS, ENGINE, JOURNAL, MEMORY, SUPERVISOR

log = structlog.get_logger("tandem.console")

CONSOLE_HTML = Path(__file__).parent / "static" / "console.html"
JOURNAL_ROWS = 20
JOURNAL_SCAN = 1000  # rows looked through for the last request rows (the journal keeps 1000)


class RateMeter:
    """Messages handled per second, per actor, from the handled_total of successive polls."""

    def __init__(self, clock: Clock, min_interval_s: float = 0.25) -> None:
        self.clock = clock
        self.min_interval_s = min_interval_s
        # name -> (monotonic seconds of the sample, handled_total then, the rate it gave)
        self._samples: dict[str, tuple[float, int, float | None]] = {}

    def rate(self, name: str, handled_total: int) -> float | None:
        """None until two samples at least `min_interval_s` apart exist."""
        now_s = self.clock.monotonic()
        previous = self._samples.get(name)
        if previous is None:
            self._samples[name] = (now_s, handled_total, None)
            return None
        at_s, total, rate = previous
        elapsed_s = now_s - at_s
        if elapsed_s < self.min_interval_s:
            return rate
        # max(0, ...): an actor replaced under the same name restarts its count.
        rate = max(0, handled_total - total) / elapsed_s
        self._samples[name] = (now_s, handled_total, rate)
        return rate


_RATES: web.AppKey[RateMeter] = web.AppKey("console_rates", RateMeter)


def add_console_routes(app: web.Application, *, clock: Clock | None = None) -> None:
    """Register GET /console and GET /v1/actors. `clock` times the rates (a FakeClock in tests)."""
    app[_RATES] = RateMeter(clock if clock is not None else SYSTEM_CLOCK)
    app.router.add_get("/console", _console_page)
    app.router.add_get("/v1/actors", _actors_document)


async def _console_page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(CONSOLE_HTML, headers={"Cache-Control": "no-store"})


async def _actors_document(request: web.Request) -> web.Response:
    document = await console_document(request.app)
    return web.Response(
        body=msgspec.json.encode(document, enc_hook=_encode_other),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def console_document(app: web.Application) -> dict[str, Any]:
    """The /v1/actors document (see the module docstring)."""
    errors: dict[str, str] = {}
    supervisor = app.get(SUPERVISOR)
    actors: list[dict[str, Any]] = []
    graph: Any = None
    if supervisor is not None:
        actors = await _read(errors, "actors", lambda: _actor_rows(app, supervisor)) or []
        graph = await _read(errors, "graph", lambda: msgspec.to_builtins(supervisor.graph()))
    engine = app.get(ENGINE)
    journal = app.get(JOURNAL)
    cache_stats = app.get(CACHE_STATS)
    memory = app.get(MEMORY)
    return {
        "at_s": SYSTEM_CLOCK.wall_time(),
        "actors": actors,
        "graph": graph,
        "engine": None if engine is None else await _read(errors, "engine", engine.snapshot),
        "journal": (
            None if journal is None
            else await _read(errors, "journal", lambda: _request_rows(journal))
        ),
        "cache": None if cache_stats is None else await _read(errors, "cache", cache_stats),
        "memory": None if memory is None else await _read(errors, "memory", memory),
        "errors": errors,
    }


def _request_rows(journal: Any) -> list[dict[str, Any]]:
    rows = [row for row in journal.tail(JOURNAL_SCAN) if row.get("kind", "request") == "request"]
    return rows[-JOURNAL_ROWS:]


def _actor_rows(app: web.Application, supervisor: Any) -> list[dict[str, Any]]:
    rates = app[_RATES]
    rows = []
    for stats in supervisor.statistics():
        stats: ActorStatistics
        row = msgspec.to_builtins(stats)
        row["rate_msg_s"] = rates.rate(stats.name, stats.handled_total)
        actor = supervisor.actors.get(stats.name)
        now_s = actor.clock.monotonic() if actor is not None else None
        for recent in row["last_messages"]:
            recent["ago_s"] = None if now_s is None else max(0.0, now_s - recent["at_s"])
        rows.append(row)
    return rows


async def _read(errors: dict[str, str], part: str, source: Callable[[], Any]) -> Any:
    try:
        value = source()
        return await value if inspect.isawaitable(value) else value
    except Exception as exc:  # one broken source must not blank the whole console
        log.warning("console_source_failed", part=part, error=type(exc).__name__, reason=str(exc))
        errors[part] = type(exc).__name__
        return None


def _encode_other(obj: Any) -> Any:
    # A snapshot may carry an enum, a path or a torch scalar; the console shows its text.
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)
