"""The memory governor actor: the owner of the machine's three memory limits (spec: "Memory").

Its core (tandem/cache/governor.py::MemoryGovernor) decides; the engine thread executes. The
caches live on the engine thread, so shedding must happen there: the engine actor holds the
same core and calls it synchronously, before each prefill (``before_prefill``: shed cheapest
first, or refuse with a 503) and at every reserve (the accountant's gate), and the core calls the
tiers' shedders right there. A message round trip per prefill would block the engine thread on
the event loop and could only relay the same decision. What goes through this actor is what
comes from outside: an edit of the limits (`SetMemoryLimits`, from POST /v1/memory/limits) and
the report (`GetMemoryReport`). Limits are one immutable object the core swaps whole, so the
engine thread sees either the old limits or the new ones.

The counters are this actor's: what the core counts on the engine thread comes here as a
`GovernorObserved` tell (posted to the loop with ``call_soon_threadsafe``, never waited on), and
only ``handle`` writes ``stats``, which the report reads. A refusal's count is posted before its
exception leaves the core, so it is in the mailbox ahead of any later ask for the report.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from tandem.actors.mailbox import MailboxFull
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStopped
from tandem.cache.governor import GovernorDelta, GovernorStats, MemoryGovernor, MemoryLimits

log = structlog.get_logger("tandem.governor")


class SetMemoryLimits(Message):
    """Sender: the server (POST /v1/memory/limits). Receiver: the governor, which replaces the
    limits whole and replies `MemoryReport`; a value left None keeps its limit. A set that
    breaks 0 <= slack < ceiling <= peak <= the machine's memory, or holds anything but finite
    numbers, changes nothing: the reply carries the error."""

    mem_ceiling_gib: float | None = None
    mem_peak_gib: float | None = None
    reserve_slack_gib: float | None = None


class GetMemoryReport(Message):
    """Sender: the server (GET /v1/memory, the console). Receiver: the governor; replies
    `MemoryReport`."""


class MemoryReport(Message):
    """Reply: the limits, what is held, per level, and the shed counters."""

    report: dict[str, Any]
    error: str | None = None  # why a SetMemoryLimits was refused


class GovernorObserved(Message):
    """Sender: the governor's core, on the engine thread (tell, posted to the loop). What one
    of its calls counted: sheds per level, refused growth, refusals, prefills, reserve
    releases, the workspace raised, the most held in a prefill and the last prefill."""

    delta: GovernorDelta


class TierHeld(Message):
    """Sender: an actor that holds copies at memory levels (the resident, the park, the store),
    whenever what it holds may have changed (a tell). Receiver: the governor, whose report
    shows the latest of each owner: no one reads another owner's accountant."""

    owner: str
    levels: dict[str, int]


class GovernorActor(Actor):
    def __init__(self, name: str = "governor", *, core: MemoryGovernor,
                 mailbox_capacity: int = 256, **actor_options: Any) -> None:
        super().__init__(name, mailbox_capacity=mailbox_capacity, **actor_options)
        self.core = core
        # Written by handle alone, on the loop (GovernorObserved); read by report.
        self.stats = GovernorStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        # What each owner last said it holds (TierHeld); None until one says: the report
        # then reads the core's attached accountant (a core used alone).
        self.held: dict[str, dict[str, int]] | None = None

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.stats = self.core.report_to(self._observed)

    def _observed(self, delta: GovernorDelta) -> None:
        """Any thread (the engine's, or the loop's when a store reserve asks the gate)."""
        try:
            self._loop.call_soon_threadsafe(self._tell, delta)
        except RuntimeError:
            pass  # the loop has closed: nobody is left to read the report

    def _tell(self, delta: GovernorDelta) -> None:
        try:
            self.try_tell(GovernorObserved(delta), sender="engine")
        except ActorStopped:
            pass  # a shutdown: nobody asks for the report any more
        except MailboxFull:
            log.warning("governor_observation_dropped")

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case GovernorObserved(delta=delta):
                self.stats.apply(delta)
            case TierHeld(owner=owner, levels=levels):
                if self.held is None:
                    self.held = {}
                self.held[owner] = dict(levels)
            case SetMemoryLimits():
                current = self.core.limits.to_gib()
                wanted = {k: v if v is not None else current[k] for k, v in (
                    ("mem_ceiling_gib", msg.mem_ceiling_gib),
                    ("mem_peak_gib", msg.mem_peak_gib),
                    ("reserve_slack_gib", msg.reserve_slack_gib))}
                try:
                    limits = MemoryLimits.gib(wanted["mem_ceiling_gib"], wanted["mem_peak_gib"],
                                              wanted["reserve_slack_gib"],
                                              total_nbytes=self.core.allocator.total_nbytes())
                except ValueError as e:
                    return MemoryReport(self.report(), error=str(e))
                except Exception as e:  # whatever an edit holds, it never stops this actor
                    log.warning("memory_limits_refused", error=type(e).__name__)
                    return MemoryReport(self.report(), error="the limits are not valid")
                self.core.set_limits(limits)
                return MemoryReport(self.report())
            case GetMemoryReport():
                return MemoryReport(self.report())
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")

    def report(self) -> dict[str, Any]:
        """On the loop: the core's limits and readings, this actor's counters."""
        report = self.core.statistics(self.stats)
        if self.held is not None:
            levels = {level: 0 for level in report["levels"]}
            for held in self.held.values():
                levels.update(held)
            report["levels"] = levels
        return report
