"""The box lock: a file lock another program takes to borrow the machine (spec: "Compaction as
a continuation"; a "hold").

tandem's idle work (the compaction preparer) takes it with ``flock(LOCK_EX | LOCK_NB)`` for as
long as it writes, and starts nothing while another process holds it. While it holds the lock
it looks for waiters: a process blocked in ``flock -w`` on the same file is listed in the
kernel's ``/proc/locks`` as a line with ``->`` and the lock's device and inode; the preparer
then stops and lets go, so the waiter gets the lock in about one poll (0.5 s) instead of the
summary's minute. A program that polls with ``flock -n`` never waits in the kernel and is not
seen this way: it should wait with ``flock -w``.

Linux only for the waiters: elsewhere ``waiters()`` is always 0 (no waiter detection), and
where ``fcntl`` is missing (Windows) the lock is never held and never busy.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

PROC_LOCKS = Path("/proc/locks")


def lock_key(text: str, pid: int, inode: int) -> str | None:
    """The ``MAJOR:MINOR:INODE`` field of the FLOCK that ``pid`` holds on ``inode``, from the
    text of /proc/locks (None: none listed). The device is taken from the kernel's own line,
    since a stat through an overlay file system may name another device."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        key = fields[5]
        if fields[4] == str(pid) and key.rsplit(":", 1)[-1] == str(inode):
            return key
    return None


def waiters_on(text: str, key: str) -> int:
    """How many processes wait (``->`` lines) for the lock at ``key`` in /proc/locks."""
    count = 0
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 7 and fields[1] == "->" and fields[2] == "FLOCK" \
                and fields[6] == key:
            count += 1
    return count


class BoxLock:
    """The lock file at ``path`` (created, mode 0600). Not thread-safe: one owner (the
    preparer's actor) calls it from the loop; every call is a few syscalls."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        if self._fd is not None:
            return True
        if fcntl is None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._key = None
        return True

    def release(self) -> None:
        fd, self._fd, self._key = self._fd, None, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    def waiters(self) -> int:
        """Processes blocked in flock on the lock this one holds (0 when it holds none, or
        off Linux)."""
        if self._fd is None or not PROC_LOCKS.exists():
            return 0
        try:
            text = PROC_LOCKS.read_text()
        except OSError:
            return 0
        if self._key is None:
            self._key = lock_key(text, os.getpid(), os.fstat(self._fd).st_ino)
            if self._key is None:
                return 0
        return waiters_on(text, self._key)
