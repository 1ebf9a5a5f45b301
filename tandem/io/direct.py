"""Disk I/O that keeps out of the page cache: O_DIRECT where the file system takes it, fadvise
where it refuses, aligned buffers, and a private folder whose entries are never symlinks.

Every transfer here is a whole number of ``ALIGN`` blocks at an ``ALIGN``-aligned offset from an
``ALIGN``-aligned buffer, which is what O_DIRECT asks of Linux's file systems (4 KiB covers a
logical block of 512 B or 4 KiB). A file system that refuses O_DIRECT (tmpfs, some FUSE ones)
answers EINVAL at open or at the first transfer; the file is then read or written through the
page cache and its pages dropped after (``posix_fadvise(DONTNEED)``, after the fsync for a write,
since dirty pages cannot be dropped).

Names are opened relative to a folder's descriptor with O_NOFOLLOW, so no symlink is followed at
any component below the tier's root, and the root itself is opened once, with O_NOFOLLOW too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import numpy as np

ALIGN = 4096
FOLDER_MODE = 0o700
FILE_MODE = 0o600

_DIRECT = getattr(os, "O_DIRECT", 0)
_NOFOLLOW = os.O_NOFOLLOW
_CLOEXEC = os.O_CLOEXEC


class RefusedEntry(OSError):
    """A name in the tier's folder that is not what it should be: a symlink, another kind of
    file, or one another user owns. Nothing behind it is read."""


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned(nbytes: int, *, pinned: bool | None = None) -> np.ndarray:
    """A zeroed uint8 buffer of ``nbytes`` whose address is a multiple of ``ALIGN``; pinned
    (page-locked, from torch's pinned allocator, which the array keeps alive) once an engine
    of this process runs on CUDA (tandem.devices.pin_staging): the staging of device rows.
    ``pinned=False``: a buffer whose bytes never meet the device (a write's bounce buffer of
    host copies, compressed frames), grown on a writer's thread, where a pinned allocation
    would be a CUDA call outside the capture lock."""
    from tandem import devices

    if devices.staging_pinned() if pinned is None else pinned:
        import torch

        raw = torch.zeros(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True).numpy()
    else:
        raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + nbytes]


def open_folder(path: str | os.PathLike, *, dir_fd: int | None = None,
                create: bool = True) -> int:
    """A descriptor of the folder ``path`` (created 0700 when missing), refusing a symlink or a
    folder another user owns, and narrowing its mode to 0700."""
    if create:
        try:
            os.mkdir(path, FOLDER_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RefusedEntry(exc.errno, "not a folder (a symlink?)", str(path)) from exc
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RefusedEntry(errno.EPERM, "a folder another user owns", str(path))
        if stat.S_IMODE(st.st_mode) != FOLDER_MODE:
            os.fchmod(fd, FOLDER_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(fd: int, name: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RefusedEntry(errno.EINVAL, "not a regular file", name)
    if st.st_uid != os.geteuid():
        raise RefusedEntry(errno.EPERM, "a file another user owns", name)
    return st


class DirectFile:
    """One open file in a folder, O_DIRECT where the file system allows it.

    ``pread_into``/``pwrite_from`` move whole aligned spans; ``finish`` fsyncs a written file and
    drops the page cache's copy where O_DIRECT was refused.
    """

    def __init__(self, fd: int, name: str, direct: bool):
        self.fd = fd
        self.name = name
        self.direct = direct
        self.size = _check_regular(fd, name).st_size

    @classmethod
    def open_read(cls, dir_fd: int, name: str, direct: bool = True) -> "DirectFile":
        # O_NONBLOCK: a FIFO put in a file's place would block the open; it is refused after.
        flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK
        return cls._open(dir_fd, name, flags, 0, direct)

    @classmethod
    def create(cls, dir_fd: int, name: str, direct: bool = True) -> "DirectFile":
        """A new file, 0600 (a umask may only narrow it); an old one at ``name`` (a crashed
        write's temp, or a symlink put there) is unlinked first, never written through."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        try:
            f = cls._open(dir_fd, name, flags, FILE_MODE, direct)
        except FileExistsError:
            os.unlink(name, dir_fd=dir_fd)
            f = cls._open(dir_fd, name, flags, FILE_MODE, direct)
        return f

    @classmethod
    def _open(cls, dir_fd: int, name: str, flags: int, mode: int, direct: bool) -> "DirectFile":
        fd = -1
        if direct and _DIRECT:
            try:
                fd = os.open(name, flags | _DIRECT, mode, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise _refused(exc, name)
                direct = False
        else:
            direct = False
        if fd < 0:
            try:
                fd = os.open(name, flags, mode, dir_fd=dir_fd)
            except OSError as exc:
                raise _refused(exc, name)
        try:
            return cls(fd, name, direct)
        except BaseException:
            os.close(fd)
            raise

    def _drop_direct(self) -> None:
        """The file system took O_DIRECT at open and refused the transfer: go buffered."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_DIRECT)
        self.direct = False

    def pwrite_from(self, buf: np.ndarray, offset: int) -> None:
        assert offset % ALIGN == 0 and buf.nbytes % ALIGN == 0, (offset, buf.nbytes)
        view = memoryview(buf)
        done = 0
        while done < len(view):
            try:
                n = os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct and done == 0:
                    self._drop_direct()
                    continue
                raise
            done += n

    def pread_into(self, buf: np.ndarray, offset: int) -> int:
        """Read up to ``buf.nbytes`` at ``offset``; fewer only at the end of the file."""
        assert offset % ALIGN == 0 and buf.nbytes % ALIGN == 0, (offset, buf.nbytes)
        view = memoryview(buf)
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct and done == 0:
                    self._drop_direct()
                    continue
                raise
            if n == 0:
                break
            done += n
        return done

    def finish_write(self) -> None:
        os.fsync(self.fd)
        if not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            if not self.direct:
                try:  # a read through the page cache leaves no pages behind either
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refused(exc: OSError, name: str) -> OSError:
    # O_NOFOLLOW on a symlink answers ELOOP (Linux); on some systems EMLINK or EFTYPE.
    if exc.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)):
        return RefusedEntry(exc.errno, "a symlink", name)
    return exc


def fsync_folder(dir_fd: int) -> None:
    os.fsync(dir_fd)


def write_atomic_at(dir_fd: int, name: str, data: bytes, tmp_suffix: str = ".tmp") -> None:
    """Replace ``name`` in the folder ``dir_fd`` with ``data``: written to ``name + tmp_suffix``
    (0600, no symlink followed), fsynced, renamed over it, and the folder fsynced, so a crash
    leaves the old file or the new one, and at most the temp, which a failure deletes."""
    tmp = name + tmp_suffix
    f = DirectFile.create(dir_fd, tmp, direct=False)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(f.fd, view):]
        f.finish_write()
    except BaseException:
        f.close()
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    f.close()
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    fsync_folder(dir_fd)
