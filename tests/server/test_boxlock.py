"""The box lock: taken without waiting, refused while another holds it, and a process blocked
in flock -w on it seen in /proc/locks (Linux)."""

import fcntl
import os
import subprocess
import sys
import time

import pytest

from tandem.server.boxlock import BoxLock, lock_key, waiters_on

LOCKS = """1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146625 0 EOF
1: -> FLOCK  ADVISORY  WRITE 5579 fe:00:2146625 0 EOF
1: -> FLOCK  ADVISORY  WRITE 5580 fe:00:2146625 0 EOF
2: FLOCK  ADVISORY  WRITE 4242 fe:00:99 0 EOF
2: -> FLOCK  ADVISORY  WRITE 6000 fe:00:99 0 EOF
3: POSIX  ADVISORY  WRITE 4242 fe:00:77 0 EOF
"""


def test_the_waiters_are_the_arrow_lines_on_the_held_locks_device_and_inode():
    key = lock_key(LOCKS, 4242, 2146625)
    assert key == "fe:00:2146625"
    assert waiters_on(LOCKS, key) == 2
    assert waiters_on(LOCKS, lock_key(LOCKS, 4242, 99)) == 1
    assert lock_key(LOCKS, 4242, 77) is None  # a POSIX lock is not the box lock
    assert lock_key(LOCKS, 1, 2146625) is None


def test_another_holder_refuses_the_lock_and_its_release_frees_it(tmp_path):
    lock = BoxLock(tmp_path / "box.lock")
    fd = os.open(lock.path.parent / "box.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock.try_acquire() and not lock.held
    os.close(fd)
    assert lock.try_acquire() and lock.held and lock.waiters() == 0
    lock.release()
    assert not lock.held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="waiters: /proc/locks")
def test_a_process_waiting_in_flock_is_seen_and_gets_the_lock_once_it_is_released(tmp_path):
    lock = BoxLock(tmp_path / "box.lock")
    assert lock.try_acquire()
    waiter = subprocess.Popen(["flock", "-w", "30", str(lock.path), "true"])
    try:
        deadline = time.monotonic() + 10
        while lock.waiters() == 0:
            assert time.monotonic() < deadline, "the waiter never showed in /proc/locks"
            time.sleep(0.01)
        assert lock.waiters() == 1
        lock.release()
        assert waiter.wait(10) == 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
