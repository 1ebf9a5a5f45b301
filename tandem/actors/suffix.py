"""The suffix store actor: owns the persistent suffix store (tandem/cache/suffix.py) and keeps its
suffix array current, off the engine's thread (spec: "Persistent suffix store").

Every change to the store (opening it, an append, a rebuild) runs on this actor's one worker
thread, in the order the messages came; a rebuilt index is swapped in whole, and the engine
thread's lookups read whichever index is current. An append the engine reports while a rebuild
runs waits behind it; one rebuild then covers every append before it.

A store that cannot be opened (another tokenizer's, inside the repository, unreadable) is
refused: the error is logged and reported on /health, and the server drafts from each request's
own tokens alone. It is never opened half-way nor overwritten.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import structlog

from tandem.actors.messages import Message
from tandem.actors.runtime import Actor
from tandem.cache.suffix import PersistentSuffixStore, SuffixStoreError
from tandem.torch_thread import one_openmp_thread_here

log = structlog.get_logger("tandem.suffix")

# Between two rebuilds the actor rests this many times the last one's time (so rebuilding
# takes at most a fifth of one core), unless that rest would be under REBUILD_REST_MIN_S.
REBUILD_REST = 4.0
REBUILD_REST_MIN_S = 0.5


class SuffixAppend(Message):
    """Sender: the engine, after a generation. Receiver: the suffix actor, which appends what
    the store keeps of it (deduplicated against the last requests) and rebuilds the index.
    Hidden tokens (a reasoning budget's phrase, rows the end alignment put back) are left out
    by the sender."""

    prompt_ids: list[int]
    output_ids: list[int]


class SuffixActor(Actor):
    def __init__(self, name: str = "suffix", *,
                 open_store: Callable[[], PersistentSuffixStore], **actor_options: Any) -> None:
        super().__init__(name, **actor_options)
        self._open_store = open_store
        self.store: PersistentSuffixStore | None = None
        self.refused: str | None = None  # why the store was not opened
        self.append_failures = 0  # appends whose file write failed (OSError), not kept
        self._executor: ThreadPoolExecutor | None = None
        self._rebuild: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}")
        # The sort's OpenMP regions on this thread alone (tandem/torch_thread.py).
        await self._on_worker(one_openmp_thread_here)
        try:
            self.store = await self._on_worker(self._open_store)
        except (SuffixStoreError, OSError) as e:
            self.refused = str(e)
            log.error("suffix_store_refused", error=type(e).__name__, reason=str(e))
            return
        self._schedule_rebuild()

    async def on_stop(self) -> None:
        if self._rebuild is not None:
            self._rebuild.cancel()
            await asyncio.gather(self._rebuild, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case SuffixAppend():
                if self.store is not None:
                    try:
                        await self._on_worker(self.store.add_request, msg.prompt_ids,
                                              msg.output_ids)
                    except ValueError:
                        # ids the store cannot hold: that request's text is not drafted from;
                        # the store and every other request go on.
                        log.warning("suffix_append_refused", tokens=len(msg.prompt_ids)
                                    + len(msg.output_ids))
                        return None
                    except OSError as e:
                        # its file could not be written (a full disk, its folder gone): that
                        # request's text is not kept, and the store and the server go on
                        self.append_failures += 1
                        log.warning("suffix_append_failed", error=type(e).__name__,
                                    errno=e.errno)
                        return None
                    self._schedule_rebuild()
                return None
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")

    async def _on_worker(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _schedule_rebuild(self) -> None:
        if self._rebuild is None or self._rebuild.done():
            self._rebuild = asyncio.get_running_loop().create_task(self._rebuild_while_stale())

    async def _rebuild_while_stale(self) -> None:
        """Rebuild until the index covers every append, resting ``REBUILD_REST`` times the last
        build between two: a store of tens of millions of tokens takes seconds to sort, and an
        agent's turns would otherwise keep a core sorting beside the engine. The newest turns
        are drafted from the request's own tokens meanwhile."""
        store = self.store
        while store.needs_rebuild:
            t0 = self.clock.monotonic()
            index = await self._on_worker(store.build_index)
            took_s = self.clock.monotonic() - t0
            store.swap(index, took_s * 1000.0)
            if store.needs_rebuild and took_s * REBUILD_REST > REBUILD_REST_MIN_S:
                await self.clock.sleep(took_s * REBUILD_REST)

    async def wait_indexed(self) -> None:
        """Until the index covers every append handled so far (tests, benchmarks)."""
        while self._rebuild is not None and not self._rebuild.done():
            await asyncio.shield(self._rebuild)

    def report(self) -> dict[str, Any]:
        """For /health: open, refused (and why) or off, with the store's counters."""
        if self.store is None:
            return {"state": "refused" if self.refused else "off", "reason": self.refused}
        stats = self.store.statistics()
        return {"state": "readonly" if self.store.readonly else "open",
                "rebuilding": self._rebuild is not None and not self._rebuild.done(),
                "append_failures": self.append_failures,
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}}
