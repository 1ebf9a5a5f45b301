"""The memory governor over HTTP: GET /v1/memory (its report), POST /v1/memory/limits (edit the
three limits live) and its two metric families on /metrics.

    POST /v1/memory/limits {"mem_ceiling_gib": 60, "mem_peak_gib": 70, "reserve_slack_gib": 2}

Any subset of the three keys; the rest keep their values. A value that is not a finite number of
GiB >= 0, or a set that breaks 0 <= slack < ceiling <= peak <= the machine's memory, is a 400 and
changes nothing. An admin route (tandem/server/guard.py). The edit goes to the governor actor,
which swaps the limits whole; the engine thread holds to them from its next reserve or prefill.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.actors import ActorStopped
from tandem.actors.governor import GetMemoryReport, MemoryReport, SetMemoryLimits
from tandem.cache.governor import gib_nbytes
from tandem.server.body import read_json
from tandem.server.errors import ApiError, bad_request
from tandem.server.guard import admin_route
from tandem.server.keys import CONFIG, SUPERVISOR

LIMIT_KEYS = ("mem_ceiling_gib", "mem_peak_gib", "reserve_slack_gib")


class _MemoryCollector:
    """tandem_memory_bytes{level} (each cache level, and "engine": what is measured held) and
    tandem_memory_shed_total{level}, from the governor actor's report when scraped: a scrape is
    synchronous, so it reads the report on the loop, the thread whose handler alone writes its
    counters, instead of asking."""

    def __init__(self, governor: Any) -> None:
        self.governor = governor  # the GovernorActor

    def collect(self):
        report = self.governor.report()
        held = GaugeMetricFamily("tandem_memory_bytes",
                                 "Bytes each cache level holds; level=engine: what the engine "
                                 "holds as measured (allocated plus the allocator's reserve).",
                                 labels=["level"])
        for level, nbytes in report["levels"].items():
            held.add_metric([level], nbytes)
        held.add_metric(["engine"], report["held_bytes"])
        yield held
        shed = CounterMetricFamily("tandem_memory_shed",
                                   "Times the governor shed a cache level to make room.",
                                   labels=["level"])
        for level, count in report["shed_total"].items():
            shed.add_metric([level], count)
        yield shed
        limits = GaugeMetricFamily("tandem_memory_limit_bytes",
                                   "The governor's limits: ceiling, peak and slack.",
                                   labels=["limit"])
        for name, nbytes in report["limits_bytes"].items():
            limits.add_metric([name], nbytes)
        yield limits


def add_memory(*, app_metrics: Any, governor: Any) -> None:
    app_metrics.registry.register(_MemoryCollector(governor))


def add_memory_routes(app: web.Application) -> None:
    app.router.add_get("/v1/memory", memory_report)
    app.router.add_post("/v1/memory/limits", set_memory_limits)


def _governor(request: web.Request):
    supervisor = request.app.get(SUPERVISOR)
    actor = supervisor.actors.get("governor") if supervisor is not None else None
    if actor is None:
        raise ApiError(404, "no memory governor runs in this server", code="no_governor")
    return actor


async def _ask(governor, msg):
    """The governor's reply; a governor that stopped or does not answer is a 503."""
    try:
        return await governor.ask(msg, 5.0, sender="server")
    except ActorStopped:
        raise ApiError(503, "the memory governor has stopped", code="governor_stopped") from None
    except TimeoutError:
        raise ApiError(503, "the memory governor did not answer in time", code="governor_busy",
                       retry_after_s=5.0) from None


async def memory_report(request: web.Request) -> web.Response:
    reply = await _ask(_governor(request), GetMemoryReport())
    return web.json_response(reply.report)


@admin_route
async def set_memory_limits(request: web.Request) -> web.Response:
    governor = _governor(request)
    server = request.app[CONFIG].server
    body = await read_json(request, server.max_body_bytes, server.request_read_timeout_s)
    if not isinstance(body, dict) or not set(body) <= set(LIMIT_KEYS) or not body:
        raise bad_request(f"the body must be an object with some of {list(LIMIT_KEYS)}",
                          code="invalid_limits")
    for key, value in body.items():
        try:
            gib_nbytes(key, value)  # the governor checks the set again, and against the machine
        except ValueError as e:
            raise bad_request(str(e), param=key, code="invalid_limits") from None
    reply: MemoryReport = await _ask(governor, SetMemoryLimits(**body))
    if reply.error is not None:
        raise bad_request(reply.error, code="invalid_limits")
    return web.json_response(reply.report)
