"""The actor: a bounded mailbox, tell / ask, lifecycle hooks and statistics.

An actor handles one message at a time, in mailbox order, in its own task owned by the
`Supervisor`. A subclass implements `handle` with `match`; what `handle` returns is the reply to
an `ask` (and is dropped for a `tell`).

A handler that starts long work (an actor's own I/O thread) and must keep its mailbox moving
returns `Deferred(future)`: the ask is answered with the future's result when it is done, and the
next message is handled meanwhile.

Invariant: once an actor has stopped (failure or shutdown), every pending ask to it has failed
with `ActorStopped`, and every later tell / ask fails the same way at once; nothing waits forever
(a deferred reply too).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from functools import partial
from typing import Literal

import msgspec

from tandem.actors.clock import SYSTEM_CLOCK, Clock
from tandem.actors.mailbox import Mailbox, MailboxClosed, MailboxFull
from tandem.actors.messages import Message
from tandem.actors.trace import Trace

__all__ = ["Actor", "ActorStatistics", "ActorStopped", "Deferred", "MailboxFull",
           "RecentMessage"]

State = Literal["created", "starting", "running", "stopped"]


class ActorStopped(Exception):
    """The actor a message was meant for has stopped; the message was not (or not fully) handled."""

    def __init__(self, name: str) -> None:
        super().__init__(f"actor {name} stopped")
        self.actor = name


class Deferred:
    """What a handler returns to answer its ask later: the reply is ``future``'s result once it
    is done (its exception, if it raised). The actor owns the work behind it; the handler's
    statistics time only the handler."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future


class Envelope(msgspec.Struct):
    """A message in a mailbox. Not a message itself: never encoded, never leaves the process."""

    message: Message
    sender: str | None
    correlation_id: int | None  # set for an ask; the key of its reply future


class RecentMessage(msgspec.Struct, frozen=True):
    type: str
    sender: str | None
    at_s: float  # the actor clock's monotonic seconds when handling finished
    handler_ms: float


class ActorStatistics(msgspec.Struct, frozen=True):
    name: str
    state: str
    mailbox_depth: int
    mailbox_capacity: int
    pending_asks: int
    handled_total: int
    handled_by_type: dict[str, int]
    handler_ms_total: float
    handler_ms_max: float
    last_messages: list[RecentMessage]


class Actor:
    def __init__(
        self,
        name: str,
        *,
        mailbox_capacity: int = 64,
        clock: Clock | None = None,
        recent_capacity: int = 16,
    ) -> None:
        self.name = name
        self.clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self.ready = asyncio.Event()  # set once on_start has returned
        self.state: State = "created"
        self._mailbox: Mailbox[Envelope] = Mailbox(mailbox_capacity)
        self._pending: dict[int, asyncio.Future[object]] = {}
        self._correlation_ids = itertools.count(1)
        self._trace: Trace | None = None  # the supervisor's, bound by Supervisor.add
        # Set while a handler runs and left set when it raises, so the supervisor can name the
        # message type that failed (never its content).
        self.current_message_type: str | None = None
        self.current_sender: str | None = None  # of the message being handled
        self._stop_cause: BaseException | None = None
        self._handled_by_type: Counter[str] = Counter()
        self._senders: Counter[str] = Counter()
        self._handler_ms_total = 0.0
        self._handler_ms_max = 0.0
        self._recent: deque[RecentMessage] = deque(maxlen=recent_capacity)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.state}>"

    # -- what a subclass writes ------------------------------------------------------------

    async def handle(self, msg: Message) -> object | None:
        raise NotImplementedError(f"{type(self).__name__} handles no messages")

    async def on_start(self) -> None:
        """Acquire what the actor owns. The next actor starts only after this returns."""

    async def on_stop(self) -> None:
        """Release what the actor owns. Runs after the last message, also after a failure."""

    # -- sending ---------------------------------------------------------------------------

    async def tell(self, msg: Message, sender: Actor | str | None = None) -> None:
        """Queue a message, waiting for room in the mailbox."""
        self._check_open(msg)
        try:
            await self._mailbox.put(Envelope(msg, _sender_name(sender), None))
        except MailboxClosed:
            raise self._stopped_error() from None

    def try_tell(self, msg: Message, sender: Actor | str | None = None) -> None:
        """Queue a message now or raise `MailboxFull`; for senders that must not wait."""
        self._check_open(msg)
        try:
            self._mailbox.put_nowait(Envelope(msg, _sender_name(sender), None))
        except MailboxClosed:
            raise self._stopped_error() from None

    async def ask(
        self, msg: Message, timeout_s: float, sender: Actor | str | None = None
    ) -> object | None:
        """Send a message and await `handle`'s return value.

        Raises TimeoutError after `timeout_s` (waiting for room counts), `ActorStopped` at once
        when the actor stops before replying.
        """
        self._check_open(msg)
        correlation_id = next(self._correlation_ids)
        reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = reply
        try:
            async with asyncio.timeout(timeout_s):
                await self._mailbox.put(Envelope(msg, _sender_name(sender), correlation_id))
                return await reply
        except MailboxClosed:
            raise self._stopped_error() from None
        finally:
            # After a timeout, a reply that comes later finds no future and is dropped.
            self._pending.pop(correlation_id, None)

    # -- introspection ---------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.state == "stopped"

    @property
    def senders(self) -> dict[str, int]:
        """Messages handled, by sender name: the edges into this actor in the actor graph."""
        return dict(self._senders)

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(
            name=self.name,
            state=self.state,
            mailbox_depth=len(self._mailbox),
            mailbox_capacity=self._mailbox.capacity,
            pending_asks=len(self._pending),
            handled_total=sum(self._handled_by_type.values()),
            handled_by_type=dict(self._handled_by_type),
            handler_ms_total=self._handler_ms_total,
            handler_ms_max=self._handler_ms_max,
            last_messages=list(self._recent),
        )

    # -- driven by the Supervisor ----------------------------------------------------------

    async def _run(self) -> None:
        """The actor's task body: start, signal ready, serve until cancelled or failed, stop.

        on_stop runs only when on_start has completed: a half-started actor cleans up in its own
        on_start.
        """
        self.state = "starting"
        try:
            await self.on_start()
        except BaseException as exc:
            self._close(None if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        self.state = "running"
        self.ready.set()
        try:
            while True:
                envelope = await self._mailbox.get()
                await self._deliver(envelope)
        except BaseException as exc:
            self._close(None if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        finally:
            await self.on_stop()

    async def _deliver(self, envelope: Envelope) -> None:
        msg = envelope.message
        type_name = type(msg).__name__
        self.current_message_type = type_name
        self.current_sender = envelope.sender
        started_s = self.clock.monotonic()
        result = await self.handle(msg)
        handler_ms = (self.clock.monotonic() - started_s) * 1000.0
        self.current_message_type = None
        self.current_sender = None

        if isinstance(result, Deferred):
            if envelope.correlation_id is not None:
                # Left in _pending, so that a stop fails it like any other pending ask.
                reply = self._pending.get(envelope.correlation_id)
                if reply is not None:
                    result.future.add_done_callback(partial(_answer_later, reply))
        elif envelope.correlation_id is not None:
            reply = self._pending.pop(envelope.correlation_id, None)
            if reply is not None and not reply.done():
                reply.set_result(result)

        self._handled_by_type[type_name] += 1
        if envelope.sender is not None:
            self._senders[envelope.sender] += 1
        self._handler_ms_total += handler_ms
        self._handler_ms_max = max(self._handler_ms_max, handler_ms)
        self._recent.append(
            RecentMessage(type_name, envelope.sender, self.clock.monotonic(), handler_ms)
        )
        if self._trace is not None:
            self._trace.record(
                msg,
                sender=envelope.sender,
                receiver=self.name,
                wall_time_s=self.clock.wall_time(),
                handler_ms=handler_ms,
                correlation_id=envelope.correlation_id,
            )

    def _close(self, cause: BaseException | None = None) -> None:
        """Stop taking messages and fail every pending ask. Idempotent."""
        if self.state == "stopped":
            return
        self.state = "stopped"
        self._stop_cause = cause
        self._mailbox.close()  # queued tells are dropped with the actor
        pending, self._pending = self._pending, {}
        for reply in pending.values():
            if not reply.done():
                reply.set_exception(self._stopped_error())

    # -- helpers ---------------------------------------------------------------------------

    def _check_open(self, msg: object) -> None:
        if not isinstance(msg, Message):
            raise TypeError(f"actors take Message structs, not {type(msg).__name__}")
        if self.state == "stopped":
            raise self._stopped_error()

    def _stopped_error(self) -> ActorStopped:
        error = ActorStopped(self.name)
        error.__cause__ = self._stop_cause
        return error


def _answer_later(reply: asyncio.Future, done: asyncio.Future) -> None:
    if reply.done():  # the ask timed out, or the actor stopped
        return
    if done.cancelled():
        reply.cancel()
    elif done.exception() is not None:
        reply.set_exception(done.exception())
    else:
        reply.set_result(done.result())


def _sender_name(sender: Actor | str | None) -> str | None:
    return sender.name if isinstance(sender, Actor) else sender
