"""Messages of the disk writer actor (tandem/actors/disk_writer.py).

The plan and the restore are no messages: the engine's plan calls ``DiskTier.plan`` and
``DiskTier.offer`` on the loop, and the engine thread calls ``DiskTier.restore`` into its own
slot's buffers.
"""

from __future__ import annotations

from typing import Any

from tandem.actors.messages import Message


class DiskJob(Message):
    """Sender: the engine, once a prefill with a non-empty ``DiskPlan`` passed its lines (its
    first token is out). Receiver: the disk writer, which copies the plan's chunk rows out of
    ``views`` under the capture lock and writes them and the anchors while the request decodes.

    Ownership: ``staged`` (line -> SectionsCopy: the anchors' sections, copied as the prefill
    passed each line) moves to the writer. ``views`` (the slot's live ``CacheState.views``) is
    lent: the writer reads rows ``[line - grid, line)`` of each chunk line from it, under the
    capture lock, until a `Fence` of ``slot`` closes the window above the fence's row."""

    job_id: str
    slot: int
    plan: Any  # a tandem.io.admission.DiskPlan
    staged: dict[int, Any]  # line -> tandem.cache.copies.SectionsCopy (host or device tensors)
    views: Any  # dict[str, tandem.models.base.View]: the slot's live buffers
    token_ids: list[int]  # the prompt's, at least up to the plan's highest line


class Fence(Message):
    """Sender: the engine's plan, before any request writes rows ``>= from_row`` in ``slot``.
    Receiver: the disk writer; replies `Fenced` once no copy of that slot's rows at or above
    ``from_row`` will happen any more (a copy under way is waited for, at most one chunk's).
    Chunks not copied by then that reach ``from_row`` are dropped: the admission is told they
    failed (so a later plan admits them again) and ``disk_window_closed`` is logged."""

    slot: int
    from_row: int


class Fenced(Message):
    """Reply to `Fence`: ``dropped`` chunk entries of that slot's jobs were never copied."""

    slot: int
    dropped: int


class GetDiskStats(Message):
    """Sender: the server (/v1/cache/stats, /metrics, the console). Replies `DiskStats`."""


class DiskStats(Message):
    stats: dict[str, Any]  # DiskTier.statistics() and the writer's queue


class ClearDisk(Message):
    """Sender: the server (POST /v1/cache/clear?tier=disk|all, behind the admin token).
    Receiver: the disk writer, which deletes every file and count after the writes before it
    (a write queued after it is written as usual). Replies `DiskCleared`."""


class DiskCleared(Message):
    dropped: dict[str, int]  # files, nbytes, lines (the counts)


class DrainDisk(Message):
    """Sender: the server at shutdown, once the engine plans no more. Replies `DiskDrained`
    once every job told before it is written (or dropped) and the counts are saved."""


class DiskDrained(Message):
    pass


class DiskWriterFaulted(Message):
    """Sender: the disk writer to itself, when its worker raised something that is no I/O
    error (a bug); handling it re-raises that, so the supervisor stops the system."""

    error: str
