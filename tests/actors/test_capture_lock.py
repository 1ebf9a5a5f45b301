"""The capture lock's FIFO on its own: arrival order, one holder, and misuse refused."""

import pytest

from tandem.actors.capture_lock import CaptureLockFifo, CaptureLockMisuse


class Holder:
    def __init__(self, name: str) -> None:
        self.name = name


def test_holders_take_the_lock_in_arrival_order_one_at_a_time():
    lock = CaptureLockFifo()
    a, b, c = Holder("a"), Holder("b"), Holder("c")
    for h in (a, b, c):
        lock.enqueue(h)
    assert lock.grant_next() is a
    assert lock.grant_next() is None  # held: nobody else gets it
    lock.check_invariants()
    lock.release(a)
    assert lock.grant_next() is b
    assert list(lock.waiting()) == [c]
    lock.release(b)
    assert lock.grant_next() is c
    lock.release(c)
    assert lock.holder is None and lock.grant_next() is None


def test_a_withdrawn_holder_never_gets_the_lock():
    lock = CaptureLockFifo()
    a, b, c = Holder("a"), Holder("b"), Holder("c")
    for h in (a, b, c):
        lock.enqueue(h)
    for h in lock.waiting():  # withdrawing while walking the line is safe
        if h is not c:
            lock.withdraw(h)
    assert lock.grant_next() is c


def test_misuse_is_refused_rather_than_corrupting_the_line():
    lock = CaptureLockFifo()
    a, b = Holder("a"), Holder("b")
    lock.enqueue(a)
    with pytest.raises(CaptureLockMisuse):
        lock.enqueue(a)  # twice
    assert lock.grant_next() is a
    with pytest.raises(CaptureLockMisuse):
        lock.enqueue(a)  # the holder queued again
    with pytest.raises(CaptureLockMisuse):
        lock.release(b)  # released by one who does not hold it
    with pytest.raises(CaptureLockMisuse):
        lock.withdraw(b)  # never waited
    lock.check_invariants()
    assert lock.holder is a
