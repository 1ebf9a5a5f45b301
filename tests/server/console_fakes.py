"""A small system for the console tests: three actors, a fake engine, journal and cache stats
(with a resident tier).

    server --Work--> frontend --Lookup (ask)--> backend
                     frontend --Done--> recorder
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tandem.actors import Actor, Message
from tandem.actors.harness import Harness
from tandem.server.console import add_console_routes
from tandem.server.keys import CACHE_STATS, ENGINE, JOURNAL, SUPERVISOR

ACTOR_NAMES = ("frontend", "backend", "recorder")


class Work(Message):
    """Sender: the test, as "server". Receiver: Frontend. Ownership: none."""

    n: int


class Lookup(Message):
    """Sender: Frontend (an ask). Receiver: Backend, which answers with `Found`. Ownership: none."""

    n: int


class Found(Message):
    """Sender: Backend, as the reply to Lookup. Receiver: Frontend. Ownership: none."""

    n: int


class Done(Message):
    """Sender: Frontend, after a Work. Receiver: Recorder. Ownership: none."""

    n: int


class Backend(Actor):
    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Lookup(n=n):
                return Found(n)
        raise TypeError(f"backend takes no {type(msg).__name__}")


class Frontend(Actor):
    def __init__(self, name: str, backend: Actor, recorder: Actor, **options: Any) -> None:
        super().__init__(name, **options)
        self.backend = backend
        self.recorder = recorder

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Work(n=n):
                found = await self.backend.ask(Lookup(n), 1.0, sender=self)
                assert isinstance(found, Found)
                await self.recorder.tell(Done(found.n), sender=self)
                return None
        raise TypeError(f"frontend takes no {type(msg).__name__}")


class FakeEngine:
    def __init__(self) -> None:
        self.rows_in_place = 3000
        self.request: dict[str, Any] | None = {
            "id": "req-7",
            "phase": "decode",
            "prompt_tokens": 2900,
            "generated": 100,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "rows_in_place": self.rows_in_place,
            "window": 8192,
            "prefix_chunk": 512,
            "num_threads": 2,
            "taint": 2900,
            "request": self.request,
        }


class FakeCacheStats:
    """app[CACHE_STATS]: {"tiers": {...}} with a resident tier shaped like
    ResidentPrefix.statistics() (tandem/cache/resident.py), in step with FakeEngine (rows 3000,
    taint 2900, prefix_chunk 512). Tests change `resident` in place; None sends no tier at all,
    as a server from before the resident prefix did."""

    def __init__(self, *, resident: bool = True) -> None:
        self.resident: dict[str, Any] | None = None
        if resident:
            self.resident = {
                "rows_in_place": 3000,
                "anchors": [512, 1024, 1536, 2048, 2560],
                "anchor_bytes": 5 * 1_048_576,
                "anchors_taken": 5,
                "evictions": 0,
                "hits": 4,
                "cold": 1,
                "end": 3000,
                "ends": 2,
                "end_hits": 1,
                "taint": 2900,
                "guests": 0,
                "guest_refused": 0,
                "stash_bytes": 0,
                "pinned": 1024,
                "pinned_anchors": [512, 1024],
                "pins": 1,
                "pin_hits": 0,
                "pin_bytes": 3 * 1_048_576,
                "parked": {"head": 1024, "rows": 5200, "end": 5200},
                "parks": 1,
                "park_hits": 0,
                "park_bytes": 9 * 1_048_576,
            }

    def __call__(self) -> dict[str, Any]:
        if self.resident is None:
            return {"tiers": {}}
        return {"tiers": {"resident": dict(self.resident)}}


class FakeJournal:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = [
            {
                "request_id": f"req-{i}",
                "t": 1_700_000_000.0 + i,
                "session": "5f2c9a",
                "route": "/v1/chat/completions",
                "prompt_tokens": 1000 + i,
                "completion_tokens": 50,
                "cached_tokens": 512 * (i % 2),
                "reread_tokens": 0,
                "cache_source": "resident" if i % 2 else "none",
                "ttft_ms": 12.5,
                "decode_tok_s": 41.0,
                "finish_reason": "stop",
                "status": 200,
            }
            for i in range(25)
        ]

    def tail(self, n: int) -> list[dict[str, Any]]:
        return self.rows[-n:]


def build_system(harness: Harness) -> None:
    backend = harness.add(Backend("backend", clock=harness.clock))
    recorder = harness.probe("recorder")
    harness.add(Frontend("frontend", backend, recorder, clock=harness.clock))


def console_app(
    harness: Harness, *, engine: FakeEngine | None = None, journal: FakeJournal | None = None,
    cache: FakeCacheStats | None = None, clock: Any = None,
) -> web.Application:
    """With a journal and no `cache`, the cache stats are a default FakeCacheStats()."""
    app = web.Application()
    app[SUPERVISOR] = harness.supervisor
    if engine is not None:
        app[ENGINE] = engine
    if journal is not None:
        app[JOURNAL] = journal
        if cache is None:
            cache = FakeCacheStats()
    if cache is not None:
        app[CACHE_STATS] = cache
    add_console_routes(app, clock=clock)
    return app
