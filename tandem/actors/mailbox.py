"""A bounded FIFO mailbox that can be closed while senders wait on it.

asyncio.Queue is not used because a closed queue cannot release the senders blocked in `put`:
an actor that stops must fail every waiting `tell` at once, never leave it hanging.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class MailboxFull(Exception):
    """`try_tell` found the mailbox at capacity."""


class MailboxClosed(Exception):
    """The mailbox's actor has stopped; nothing more goes in or comes out."""


class Mailbox(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._closed = False
        # Every waiter is woken on any change and re-checks its condition; mailboxes are small
        # and contention rare, and waking all cannot lose a wakeup to a cancelled waiter.
        self._room_waiters: set[asyncio.Future[None]] = set()
        self._item_waiters: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def full(self) -> bool:
        return len(self._items) >= self.capacity

    def put_nowait(self, item: T) -> None:
        if self._closed:
            raise MailboxClosed
        if self.full():
            raise MailboxFull(f"mailbox at capacity {self.capacity}")
        self._items.append(item)
        _wake_all(self._item_waiters)

    async def put(self, item: T) -> None:
        while self.full() and not self._closed:
            await _wait_on(self._room_waiters)
        self.put_nowait(item)

    async def get(self) -> T:
        while not self._items:
            if self._closed:
                raise MailboxClosed
            await _wait_on(self._item_waiters)
        item = self._items.popleft()
        _wake_all(self._room_waiters)
        return item

    def close(self) -> list[T]:
        """Refuse everything from now on; return what was still queued so its owner can fail it."""
        self._closed = True
        left = list(self._items)
        self._items.clear()
        _wake_all(self._room_waiters)
        _wake_all(self._item_waiters)
        return left


async def _wait_on(waiters: set[asyncio.Future[None]]) -> None:
    waiter = asyncio.get_running_loop().create_future()
    waiters.add(waiter)
    try:
        await waiter
    finally:
        waiters.discard(waiter)


def _wake_all(waiters: set[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
