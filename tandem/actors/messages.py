"""The base of every message between actors.

A message is a frozen, tagged `msgspec.Struct`, dispatched in `Actor.handle` with `match`. Each
subclass's docstring says who sends it, who receives it, and what ownership moves with it
(e.g. "the engine hands the copy of rows 0..n to the tier; the engine keeps no reference").

Tensors pass by reference inside the process; a message is encoded only at a boundary (the
trace, disk, HTTP). A tensor field is annotated `Any` with a comment naming shape and dtype, so
that every message type still round-trips through msgspec (tests/actors/test_harness.py).
Message modules import no actors, so two actors that talk both ways need no import cycle. A message is defined next to the actor that receives it.
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, tag=True):
    """Base of all messages. The tag (the class name) is written as "type" when encoded.

    Sender: any actor or the outside (server, harness). Receiver: the actor it is told or asked
    to. Ownership: none by itself; subclasses say what they move.
    """
