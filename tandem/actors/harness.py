"""Test harness: a system of real and fake actors, a fake clock, and event-based expectations.

    harness = Harness()
    tier = harness.probe("tier")
    engine = harness.add(EngineActor("engine", tier=tier, clock=harness.clock))
    async with harness:
        await harness.inject("engine", PrefillPlan(...))
        anchor = await tier.expect(AnchorReady, timeout_s=1.0)

Every wait has a timeout and wakes on an event; nothing polls with sleep.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from tandem.actors.messages import Message
from tandem.actors.runtime import Actor
from tandem.actors.supervisor import Supervisor
from tandem.actors.trace import Trace

M = TypeVar("M", bound=Message)
A = TypeVar("A", bound=Actor)


class FakeClock:
    """A clock that moves only when the test calls `advance`; `sleep` ends when advanced past."""

    def __init__(self, start_s: float = 0.0, epoch_s: float = 1_700_000_000.0) -> None:
        self._now_s = start_s
        self._epoch_s = epoch_s
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []  # a heap by deadline
        self._order = itertools.count()
        self._sleepers_changed = asyncio.Event()

    def monotonic(self) -> float:
        return self._now_s

    def wall_time(self) -> float:
        return self._epoch_s + self._now_s

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        sleeper = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now_s + seconds, next(self._order), sleeper))
        self._sleepers_changed.set()
        await sleeper

    def advance(self, seconds: float) -> int:
        """Move time forward; wake every sleeper now due. Returns how many were woken."""
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self._now_s += seconds
        woken = 0
        while self._sleepers and self._sleepers[0][0] <= self._now_s:
            _, _, sleeper = heapq.heappop(self._sleepers)
            if not sleeper.done():  # a cancelled sleep stays in the heap until due
                sleeper.set_result(None)
                woken += 1
        return woken

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, sleeper in self._sleepers if not sleeper.done())

    async def until_sleeping(self, count: int = 1, timeout_s: float = 1.0) -> None:
        """Wait until at least `count` sleeps are pending, so that an advance reaches them."""
        async with asyncio.timeout(timeout_s):
            while self.sleepers < count:
                self._sleepers_changed.clear()
                await self._sleepers_changed.wait()


class Received(msgspec.Struct, frozen=True):
    message: Message
    sender: str | None


class Probe(Actor):
    """A fake actor that records what it receives and answers asks from a table of replies."""

    def __init__(
        self,
        name: str,
        *,
        replies: Mapping[type[Message], Callable[[Any], object]] | None = None,
        **actor_options: Any,
    ) -> None:
        super().__init__(name, **actor_options)
        self.replies = dict(replies or {})
        self.received: list[Received] = []  # everything, in order of handling
        self._unread: list[Received] = []  # what no expect() has taken yet
        self._arrived = asyncio.Event()

    async def handle(self, msg: Message) -> object | None:
        record = Received(msg, self.current_sender)
        self.received.append(record)
        self._unread.append(record)
        self._arrived.set()
        answer = self.replies.get(type(msg))
        return answer(msg) if answer is not None else None

    @property
    def unread(self) -> list[Received]:
        return list(self._unread)

    async def expect(
        self, msg_type: type[M], timeout_s: float = 1.0, *, sender: str | None = None
    ) -> M:
        """Take the oldest unread message of this type (and sender), waiting for one to come."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    for i, record in enumerate(self._unread):
                        if isinstance(record.message, msg_type) and (
                            sender is None or record.sender == sender
                        ):
                            del self._unread[i]
                            return record.message
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            unread = [type(r.message).__name__ for r in self._unread]
            wanted = (" or ".join(t.__name__ for t in msg_type) if isinstance(msg_type, tuple)
                      else msg_type.__name__)
            raise TimeoutError(
                f"{self.name} got no {wanted} in {timeout_s} s; unread: {unread}"
            ) from None


FakeActor = Probe


class Harness:
    def __init__(
        self,
        *actors: Actor,
        clock: FakeClock | None = None,
        ready_timeout_s: float = 1.0,
        stop_timeout_s: float = 1.0,
        trace_capacity: int = 1024,
        check_failures: bool = True,
    ) -> None:
        """`check_failures`: leaving the `async with` raises if an actor failed unexpectedly."""
        self.clock = clock if clock is not None else FakeClock()
        self.supervisor = Supervisor(
            ready_timeout_s=ready_timeout_s,
            stop_timeout_s=stop_timeout_s,
            trace=Trace(trace_capacity),
        )
        self.check_failures = check_failures
        for actor in actors:
            self.add(actor)

    def add(self, actor: A) -> A:
        return self.supervisor.add(actor)

    def probe(
        self,
        name: str,
        *,
        replies: Mapping[type[Message], Callable[[Any], object]] | None = None,
        mailbox_capacity: int = 64,
    ) -> Probe:
        return self.add(
            Probe(name, replies=replies, mailbox_capacity=mailbox_capacity, clock=self.clock)
        )

    def __getitem__(self, name: str) -> Actor:
        return self.supervisor.actors[name]

    @property
    def trace(self) -> Trace:
        return self.supervisor.trace

    async def inject(
        self, actor_name: str, msg: Message, *, sender: str | None = "harness"
    ) -> None:
        """Put a message into any actor's mailbox, as if `sender` had told it."""
        await self[actor_name].tell(msg, sender=sender)

    async def ask(
        self,
        actor_name: str,
        msg: Message,
        timeout_s: float = 1.0,
        *,
        sender: str | None = "harness",
    ) -> object | None:
        return await self[actor_name].ask(msg, timeout_s, sender=sender)

    async def until_stopped(self, timeout_s: float = 1.0) -> None:
        """Wait for the system to stop by itself (after a failure)."""
        async with asyncio.timeout(timeout_s):
            await self.supervisor.wait()

    async def start(self) -> None:
        await self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()

    async def __aenter__(self) -> Harness:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        await self.stop()
        failure = self.supervisor.exception
        if self.check_failures and exc_type is None and failure is not None:
            raise AssertionError(f"an actor failed during the test: {failure!r}") from failure


def example(type_: Any) -> Any:
    """A value of a msgspec-describable type, for round-trip tests of message types."""
    return _example(mi.type_info(type_))


def _example(info: mi.Type) -> Any:
    match info:
        case mi.StructType():
            return info.cls(**{f.name: _example(f.type) for f in info.fields})
        case mi.BoolType():
            return True
        case mi.IntType():
            return max(1, info.ge or 0, (info.gt or 0) + 1)
        case mi.FloatType():
            return 1.5
        case mi.StrType():
            return "s" * max(1, info.min_length or 0)
        case mi.BytesType() | mi.ByteArrayType():
            return b"b"
        case mi.NoneType() | mi.AnyType():
            return None
        case mi.LiteralType():
            return info.values[0]
        case mi.EnumType():
            cls: type[enum.Enum] = info.cls
            return next(iter(cls))
        case mi.ListType():
            return [_example(info.item_type)]
        case mi.SetType():
            return {_example(info.item_type)}
        case mi.FrozenSetType():
            return frozenset({_example(info.item_type)})
        case mi.VarTupleType():
            return (_example(info.item_type),)
        case mi.TupleType():
            return tuple(_example(t) for t in info.item_types)
        case mi.DictType():
            return {_example(info.key_type): _example(info.value_type)}
        case mi.UnionType():
            chosen = [t for t in info.types if not isinstance(t, mi.NoneType)]
            return _example(chosen[0] if chosen else info.types[0])
        case _:
            raise NotImplementedError(
                f"no example for {type(info).__name__}; extend harness.example"
            )
