"""The supervisor: owns every actor and every background task of the process.

Actors start in the order they were added, each after the previous one is ready. Every task runs
inside one asyncio.TaskGroup, so nothing outlives the supervisor. An unhandled exception in an
actor or an owned task is logged (`actor_failed` / `task_failed`: names and types, never message
content) and stops the whole system: owned tasks are cancelled, then the actors stop in reverse
order, and every pending ask fails with `ActorStopped`. The first such exception is the cause
(`exception`).
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Coroutine, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import msgspec
import structlog

from tandem.actors.runtime import Actor, ActorStatistics, ActorStopped
from tandem.actors.trace import Trace

log = structlog.get_logger("tandem.actors")

A = TypeVar("A", bound=Actor)


class GraphNode(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "actor", or "external" for a sender that is not an actor (server, harness)
    state: str | None
    mailbox_depth: int
    mailbox_capacity: int


class GraphEdge(msgspec.Struct, frozen=True):
    sender: str
    receiver: str
    messages: int  # handled by the receiver so far


class ActorGraph(msgspec.Struct, frozen=True):
    nodes: list[GraphNode]
    edges: list[GraphEdge]


class Supervisor:
    def __init__(
        self,
        *,
        ready_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        trace: Trace | None = None,
    ) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.trace = trace if trace is not None else Trace()
        self._actors: dict[str, Actor] = {}
        self._actor_tasks: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._task_group: asyncio.TaskGroup | None = None
        self._main: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        self._exception: BaseException | None = None

    # -- building ----------------------------------------------------------------------------

    def add(self, actor: A) -> A:
        if self._main is not None:
            raise RuntimeError("actors are added before start")
        if actor.name in self._actors:
            raise ValueError(f"duplicate actor name {actor.name!r}")
        actor._trace = self.trace
        self._actors[actor.name] = actor
        return actor

    @property
    def actors(self) -> Mapping[str, Actor]:
        """Name to actor, in start order."""
        return MappingProxyType(self._actors)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every actor in order. Raises the cause if one fails or is not ready in time."""
        if self._main is not None:
            raise RuntimeError("supervisor already started")
        started = asyncio.get_running_loop().create_future()
        self._main = asyncio.create_task(self._run(started), name="supervisor")
        try:
            await started
        except asyncio.CancelledError:
            self.request_stop()  # the caller gave up; the system must not run on unowned
            raise
        if self._stop_requested.is_set() or self._main.done():
            await self.stop()  # re-raises a bug in the supervisor itself
            if self._exception is not None:
                raise self._exception

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a background task owned by the supervisor; if it raises, the system stops."""
        if self._task_group is None or self._stop_requested.is_set():
            coro.close()
            raise RuntimeError(f"cannot spawn {name!r}: the supervisor is not running")
        task = self._task_group.create_task(self._guard_task(coro, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def request_stop(self) -> None:
        """Ask for a clean shutdown without waiting for it (e.g. from inside a handler)."""
        self._stop_requested.set()

    async def stop(self) -> None:
        """Stop everything and wait until it has stopped. Safe to call more than once."""
        self.request_stop()
        if self._main is None:
            for actor in self._actors.values():
                actor._close()
            return
        await self.wait()

    async def wait(self) -> None:
        """Wait until the system has stopped (after `stop`, or a failure)."""
        if self._main is None:
            raise RuntimeError("supervisor not started")
        await asyncio.wait([self._main])
        if not self._main.cancelled() and self._main.exception() is not None:
            raise self._main.exception()  # a bug in the supervisor itself, never hidden

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._main is not None and not self._main.done()

    @property
    def failed(self) -> bool:
        return self._exception is not None

    @property
    def exception(self) -> BaseException | None:
        """The first unhandled exception, the cause of the stop; None after a clean stop."""
        return self._exception

    # -- console -----------------------------------------------------------------------------

    def statistics(self) -> list[ActorStatistics]:
        return [actor.statistics() for actor in self._actors.values()]

    def graph(self) -> ActorGraph:
        nodes = []
        for actor in self._actors.values():
            stats = actor.statistics()
            nodes.append(
                GraphNode(
                    actor.name, "actor", actor.state, stats.mailbox_depth, stats.mailbox_capacity
                )
            )
        edges = [
            GraphEdge(sender, actor.name, count)
            for actor in self._actors.values()
            for sender, count in sorted(actor.senders.items())
        ]
        external = sorted({e.sender for e in edges} - self._actors.keys())
        nodes += [GraphNode(name, "external", None, 0, 0) for name in external]
        return ActorGraph(nodes, edges)

    # -- inside ------------------------------------------------------------------------------

    async def _run(self, started: asyncio.Future[None]) -> None:
        try:
            async with asyncio.TaskGroup() as task_group:
                self._task_group = task_group
                await self._start_actors(task_group)
                started.set_result(None)
                await self._stop_requested.wait()
                await self._stop_all()
        finally:
            self._task_group = None
            # Actors never started (startup aborted) still fail whatever was sent to them.
            for actor in self._actors.values():
                actor._close()
            if not started.done():
                started.set_result(None)

    async def _start_actors(self, task_group: asyncio.TaskGroup) -> None:
        for actor in self._actors.values():
            if self._stop_requested.is_set():
                return
            task = task_group.create_task(self._guard_actor(actor), name=f"actor:{actor.name}")
            self._actor_tasks[actor.name] = task
            if not await self._until_ready(actor):
                return

    async def _until_ready(self, actor: Actor) -> bool:
        waiters = {
            asyncio.create_task(actor.ready.wait()),
            asyncio.create_task(self._stop_requested.wait()),
        }
        try:
            await asyncio.wait(
                waiters, timeout=self.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait(waiters)
        if actor.ready.is_set():
            return True
        if not self._stop_requested.is_set():
            error = TimeoutError(f"actor {actor.name} not ready after {self.ready_timeout_s} s")
            log.error("actor_not_ready", actor=actor.name, ready_timeout_s=self.ready_timeout_s)
            self._fail(error)
        return False

    async def _stop_all(self) -> None:
        log.info("system_stopping", failed=self.failed)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for actor in reversed(self._actors.values()):
            # Close first so that its pending asks fail now, not after on_stop.
            actor._close()
            task = self._actor_tasks.get(actor.name)
            if task is None:
                continue
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=self.stop_timeout_s)
            if not done:
                timeout_s = self.stop_timeout_s
                log.error("actor_stop_timeout", actor=actor.name, stop_timeout_s=timeout_s)
                self._fail(TimeoutError(f"actor {actor.name} did not stop in {timeout_s} s"))
                task.cancel()
                await asyncio.wait([task])
        log.info("system_stopped", failed=self.failed)

    async def _guard_actor(self, actor: Actor) -> None:
        try:
            await actor._run()
        except Exception as exc:
            log.error(
                "actor_failed",
                actor=actor.name,
                error=type(exc).__name__,
                reason=str(exc),
                message_type=actor.current_message_type,
                during_shutdown=self._stop_requested.is_set(),
                traceback=_traceback(exc),
            )
            self._fail(exc)

    async def _guard_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await coro
        except Exception as exc:
            log.error(
                "task_failed",
                task=name,
                error=type(exc).__name__,
                reason=str(exc),
                during_shutdown=self._stop_requested.is_set(),
                traceback=_traceback(exc),
            )
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        # During a shutdown, a handler that finds its peer already stopped is expected, not a
        # cause; anything else that fails is.
        expected = self._stop_requested.is_set() and isinstance(exc, ActorStopped)
        if self._exception is None and not expected:
            self._exception = exc
        self._stop_requested.set()


def _traceback(exc: BaseException) -> str:
    # Formatted here, not passed as exc_info: a renderer that shows a frame's locals (structlog's
    # default with rich) would print the message being handled, and user text never reaches a log.
    return "".join(traceback.format_exception(exc))
