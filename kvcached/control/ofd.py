"""Open-file-description byte-range locks (``F_OFD_SETLK`` and friends).

An OFD lock belongs to the open file, not the process: it is dropped when the
last descriptor of that open file closes, including when its process dies,
and it is never shared across ``fork``'s duplicated descriptors by accident of
pid. Busy is not an error (``wait=False`` returns ``False``); a filesystem
without OFD locks gets a message that says what to do.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

F_OFD_GETLK = 36
F_OFD_SETLK = 37
F_OFD_SETLKW = 38
# struct flock on Linux x86-64/aarch64: short type, short whence, off_t start, off_t len, pid_t pid
_FLOCK = struct.Struct("hhqqi4x")


def _flock(kind: int, start: int, length: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


def _unsupported(exc: OSError) -> OSError:
    return OSError(
        exc.errno,
        f"{exc.strerror}: this filesystem does not support OFD byte-range locks; put "
        "kvcached's files on a local Linux filesystem (tmpfs /dev/shm, ext4, xfs)",
    )


def lock(fd: int, start: int, length: int, *, exclusive: bool = True, wait: bool = True) -> bool:
    """Lock ``[start, start+length)`` of ``fd``. With ``wait=False`` returns
    ``False`` when another open file holds a conflicting lock."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, F_OFD_SETLKW if wait else F_OFD_SETLK, _flock(kind, start, length))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES) and not wait:
            return False
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOLCK):
            raise _unsupported(exc) from None
        raise
    return True


def unlock(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, F_OFD_SETLK, _flock(fcntl.F_UNLCK, start, length))


def is_locked(fd: int, start: int, length: int) -> bool:
    """Whether another open file holds a lock that would block a write lock."""
    try:
        result = fcntl.fcntl(fd, F_OFD_GETLK, _flock(fcntl.F_WRLCK, start, length))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS):
            raise _unsupported(exc) from None
        raise
    return _FLOCK.unpack(result)[0] != fcntl.F_UNLCK
