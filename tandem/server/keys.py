"""Typed keys of the aiohttp application's state, shared by the routes and the console.

- SUPERVISOR: the tandem.actors.Supervisor that owns every actor (its ``graph()`` and
  ``statistics()`` feed /v1/actors and the console).
- ENGINE: the engine actor; ``snapshot() -> dict`` gives rows_in_place, window, prefix_chunk,
  num_threads, taint and the current request (id, phase, prompt_tokens, generated) or None
  (the one started last), ``requests`` (every running one, the same fields), ``slots`` and
  ``decode_batches`` (decode forwards run, by how many sequences each took), from the frozen
  view the loop publishes (EngineView: the rows and taint as the last generation left them,
  the tokens counted as the loop delivered them).
- JOURNAL: the journal; ``tail(n) -> list[dict]`` gives its last rows, newest last.
- CONFIG: the tandem.config.Config the server runs with.
- MODEL_NAME: the id /v1/models lists.
- CACHE_STATS: a coroutine function returning the /v1/cache/stats document (tiers, each with
  counters), each tier's asked of its actor (a plain function returning it is read as well).
- MEMORY: a coroutine function returning the memory governor actor's report (limits, held,
  levels, sheds), asked of it; absent when no governor runs.
- SUFFIX: the suffix store actor (``report() -> dict`` for /health), or None when there is none.
- DISK_WRITER: the disk tier's writer actor (asked for its stats and a clear), or None when the
  tier is off.
- SPILL_WRITER: the session spill's writer actor (asked for its stats, a clear and the drain;
  ``report()`` for /metrics), or None when the spill is off.
- PREPARED: the compaction preparer's answers (tandem.cache.prepared.PreparedAnswers: the chat
  route notes agent sessions and compaction instructions in it and looks answers up), or None
  when no preparer runs.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web

SUPERVISOR: web.AppKey[Any] = web.AppKey("supervisor", object)
ENGINE: web.AppKey[Any] = web.AppKey("engine", object)
JOURNAL: web.AppKey[Any] = web.AppKey("journal", object)
CONFIG: web.AppKey[Any] = web.AppKey("config", object)
MODEL_NAME: web.AppKey[str] = web.AppKey("model_name", str)
CACHE_STATS: web.AppKey[Callable[[], Any]] = web.AppKey("cache_stats", object)
MEMORY: web.AppKey[Callable[[], Any]] = web.AppKey("memory", object)
SUFFIX: web.AppKey[Any] = web.AppKey("suffix", object)
DISK_WRITER: web.AppKey[Any] = web.AppKey("disk_writer", object)
SPILL_WRITER: web.AppKey[Any] = web.AppKey("spill_writer", object)
PREPARED: web.AppKey[Any] = web.AppKey("prepared", object)
