"""The state store actor: owns the store's core (tandem/cache/store.py::StoreCore) and runs
every step of it in its own mailbox's order (spec: "State store").

The engine thread is the store's only client: it decides what to snapshot, clones the engine's
buffers and restores them, and asks this actor for the rest through ``StoreActorPort`` (the
``StorePort`` the engine's ``StateStore`` holds): an offer for a prompt (the entry comes back
leased), room for a snapshot before it is cloned, the clone handed over, a lease given back, a
decline said, the governor's shed. Each is an ask the engine thread waits on (tens of
microseconds); the actor never waits on the engine, so the two cannot deadlock. Ownership: a
snapshot's tensors move to the actor with ``StoreInsert`` (the engine keeps no reference); an
offered entry is lent to the engine until ``StoreRelease``, and no eviction drops it meanwhile.

When the actor has stopped (a shutdown) the port answers as an empty store would: no offer, no
room, nothing shed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from tandem.actors.governor import TierHeld
from tandem.actors.messages import Message
from tandem.actors.mailbox import MailboxFull
from tandem.actors.runtime import Actor, ActorStopped
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.store import StoreCore, StoreEntry

log = structlog.get_logger("tandem.store")

ASK_TIMEOUT_S = 30.0


class StoreOffer(Message):
    """Sender: the engine thread, before a prefill. Receiver: the store; replies
    `StoreOffered` with the longest entry that starts the prompt, lent until `StoreRelease`
    (a prompt with none is counted as a miss there: one ask, not two). Only entries of the
    request's ``namespace`` are offered."""

    prompt_ids: list[int]
    namespace: str = SHARED  # tandem.cache.namespace: a digest, never the client's salt
    # A peek (POST /v1/cache/peek): the start alone, no entry lent, nothing counted.
    peek: bool = False


class StoreOffered(Message):
    """Reply to `StoreOffer`: ``start`` 0 and no entry when none starts the prompt."""

    start: int
    entry: Any = None  # a StoreEntry (sections and rows: torch tensors), lent to the engine


class StoreRelease(Message):
    """Sender: the engine thread. The lent entry comes back; ``hit``: it was restored."""

    entry: Any  # the StoreEntry of a StoreOffered
    hit: bool


class StoreHolds(Message):
    """Sender: the engine thread (the end alignment, before it serves a client's copy as the
    rows of a stored session). Replies `StoreHeld`."""

    key_ids: list[int]
    namespace: str = SHARED


class StoreHeld(Message):
    held: bool


class StoreAdmit(Message):
    """Sender: the engine thread, before it clones a snapshot. Receiver: the store, which makes
    room (evicting least recently used entries) and replies `StoreAdmitted`."""

    key_ids: list[int]
    kind: str  # "prefix" or "session"
    nbytes: int
    namespace: str = SHARED


class StoreAdmitted(Message):
    """Reply to `StoreAdmit`: "reserved" (clone, then `StoreInsert` or `StoreCancel`), "held"
    (the same tokens are held already) or "refused"."""

    verdict: str


class StoreInsert(Message):
    """Sender: the engine thread: the snapshot cloned into the room reserved. Ownership: the
    entry's tensors move to the store; the engine keeps no reference."""

    entry: Any  # a StoreEntry


class StoreCancel(Message):
    """Sender: the engine thread: a reserved snapshot that was not cloned after all."""

    nbytes: int


class StoreDecline(Message):
    """Sender: the engine thread: a session put declined before anything was cloned."""

    reason: str  # "short" or "big"
    who: str  # the conversation, or a hash of its head: the reason is said once for each
    conversation: str | None
    detail: str


class StoreShed(Message):
    """Sender: the memory governor's core, on the engine thread. Receiver: the store, which
    drops least recently used entries until ``nbytes`` are freed; replies `StoreShedDone`."""

    nbytes: int


class StoreShedDone(Message):
    freed: int


class ClearStore(Message):
    """Sender: the server (POST /v1/cache/clear?tier=all, behind the admin token). Receiver:
    the store, which drops every entry the engine does not hold on lease (a leased one stays,
    to go by the usual eviction once it is back). Replies `StoreCleared`."""


class StoreCleared(Message):
    dropped: dict[str, int]  # entries, nbytes; leased: entries kept because they were lent


class GetStoreStats(Message):
    """Sender: the engine thread (the cache stats it publishes). Replies `StoreStats`."""


class StoreStatsReport(Message):
    stats: dict[str, Any]


class CheckStoreInvariants(Message):
    """Sender: the engine thread, after a generation (the planner's invariant check);
    ``alone``: no other generation runs (no room may be left reserved)."""

    alone: bool = True


class StoreActor(Actor):
    def __init__(self, name: str = "store", *, core: StoreCore, governor: Actor | None = None,
                 **actor_options: Any) -> None:
        super().__init__(name, **actor_options)
        self.core = core
        self.governor = governor  # told what the store holds whenever it changed (TierHeld)
        self._told: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._report_held()

    def _report_held(self) -> None:
        held = self.core.memory.held["store"]
        if self.governor is None or held == self._told:
            return
        try:
            self.governor.try_tell(TierHeld(self.name, {"store": held}), sender=self)
            self._told = held
        except (MailboxFull, ActorStopped):
            log.warning("tier_held_dropped", tier=self.name)

    async def handle(self, msg: Message) -> object | None:
        try:
            return self._handle(msg)
        finally:
            self._report_held()

    def port(self, timeout_s: float = ASK_TIMEOUT_S) -> "StoreActorPort":
        """The engine thread's way to this actor (after it started)."""
        assert self._loop is not None, "the store actor has not started"
        return StoreActorPort(self, self._loop, timeout_s)

    def _handle(self, msg: Message) -> object | None:
        core = self.core
        match msg:
            case StoreOffer(peek=True):
                return StoreOffered(core.peek(msg.prompt_ids, Namespace(msg.namespace)))
            case StoreOffer():
                start, entry = core.offer(msg.prompt_ids, Namespace(msg.namespace))
                return StoreOffered(start, entry)
            case StoreRelease():
                core.release(msg.entry, msg.hit)
            case StoreHolds():
                return StoreHeld(core.holds(msg.key_ids, Namespace(msg.namespace)))
            case StoreAdmit():
                return StoreAdmitted(core.admit(msg.key_ids, msg.kind, msg.nbytes,
                                                Namespace(msg.namespace)))
            case StoreInsert():
                core.insert(msg.entry)
            case StoreCancel():
                core.cancel(msg.nbytes)
            case StoreDecline():
                core.decline(msg.reason, msg.who, msg.conversation, msg.detail)
            case StoreShed():
                return StoreShedDone(core.shed(msg.nbytes))
            case ClearStore():
                entries, held = len(core), core.memory.held["store"]
                core.clear()
                return StoreCleared({"entries": entries - len(core),
                                     "nbytes": held - core.memory.held["store"],
                                     "leased": len(core)})
            case GetStoreStats():
                return StoreStatsReport(core.statistics())
            case CheckStoreInvariants(alone=alone):
                core.check_invariants(alone)
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None


class StoreActorPort:
    """``StorePort`` over the store actor, for the engine thread. What hands something to the
    store (a lease back, an inserted snapshot, a cancelled room, a decline, an invariant check)
    is a tell: the thread never waits on the loop for it, and a prefill asks nothing (its
    lines were admitted on the loop, in the plan). What needs an answer (the session put's
    admission after the decode, the governor's shed) is an ask. Both go to the loop in the
    order the thread made them (``call_soon_threadsafe``), so the actor sees that order."""

    def __init__(self, actor: StoreActor, loop: asyncio.AbstractEventLoop,
                 timeout_s: float) -> None:
        self.actor = actor
        self.loop = loop
        self.timeout_s = timeout_s

    def _tell(self, msg: Message) -> None:
        def deliver() -> None:
            try:
                self.actor.try_tell(msg, sender="engine")
            except MailboxFull:
                self.loop.create_task(self._tell_later(msg))
            except ActorStopped:
                log.warning("store_unreachable", message_type=type(msg).__name__,
                            error="ActorStopped")

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            log.warning("store_unreachable", message_type=type(msg).__name__,
                        error="RuntimeError")

    async def _tell_later(self, msg: Message) -> None:
        try:
            await self.actor.tell(msg, sender="engine")
        except ActorStopped:
            pass  # a shutdown: the store takes nothing more

    def _ask(self, msg: Message) -> Any:
        try:
            future = asyncio.run_coroutine_threadsafe(
                self.actor.ask(msg, self.timeout_s, sender="engine"), self.loop)
            return future.result()
        except (ActorStopped, TimeoutError, RuntimeError) as e:
            # Stopped (a shutdown), a loop that closed, or no answer in time: the store is
            # taken as empty, never as an answer.
            log.warning("store_unreachable", message_type=type(msg).__name__,
                        error=type(e).__name__)
            return None

    def offer(self, prompt_ids: list[int],
              namespace: Namespace = SHARED) -> tuple[int, StoreEntry | None]:
        reply = self._ask(StoreOffer(list(prompt_ids), namespace))
        return (reply.start, reply.entry) if reply is not None else (0, None)

    def release(self, entry: StoreEntry, hit: bool) -> None:
        self._tell(StoreRelease(entry, hit))

    def holds(self, key_ids: list[int], namespace: Namespace = SHARED) -> bool:
        reply = self._ask(StoreHolds(list(key_ids), namespace))
        return reply is not None and reply.held

    def admit(self, key_ids: list[int], kind: str, nbytes: int,
              namespace: Namespace = SHARED) -> str:
        reply = self._ask(StoreAdmit(list(key_ids), kind, nbytes, namespace))
        return reply.verdict if reply is not None else "refused"

    def insert(self, entry: StoreEntry) -> None:
        self._tell(StoreInsert(entry))

    def cancel(self, nbytes: int) -> None:
        self._tell(StoreCancel(nbytes))

    def decline(self, reason: str, who: str, conversation: str | None, detail: str) -> None:
        self._tell(StoreDecline(reason, who, conversation, detail))

    def shed(self, need_nbytes: int) -> int:
        reply = self._ask(StoreShed(need_nbytes))
        return reply.freed if reply is not None else 0

    def statistics(self) -> dict:
        reply = self._ask(GetStoreStats())
        return reply.stats if reply is not None else {}

    def check_invariants(self, alone: bool = True) -> None:
        self._tell(CheckStoreInvariants(alone))
