"""The actor runtime (mailbox, ask/tell, supervision, trace) and one actor per tier or role."""

from tandem.actors.clock import Clock, SystemClock
from tandem.actors.mailbox import MailboxFull
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStatistics, ActorStopped, RecentMessage
from tandem.actors.supervisor import ActorGraph, GraphEdge, GraphNode, Supervisor
from tandem.actors.trace import Trace, TraceEntry

__all__ = [
    "Actor",
    "ActorGraph",
    "ActorStatistics",
    "ActorStopped",
    "Clock",
    "GraphEdge",
    "GraphNode",
    "MailboxFull",
    "Message",
    "RecentMessage",
    "Supervisor",
    "SystemClock",
    "Trace",
    "TraceEntry",
]
