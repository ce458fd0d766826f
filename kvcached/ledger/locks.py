"""The ledger's two lock primitives, every errno sorted.

* The **data lock** is a whole-file ``flock(2)`` lock, owned by
  :class:`kvcached.ledger.datalock.DataLock` (:func:`wait_flock` is its
  bounded slow path; the fast path, one non-blocking ``flock``, is
  :meth:`~kvcached.ledger.datalock.DataLock.acquire_fd` and, inline, a
  pool's grant). ``flock`` costs
  about half of an OFD ``fcntl`` lock per lock+unlock pair here (see
  ``benchmarks/ledger.py``), and Linux keeps flock and fcntl locks apart, so it
  never conflicts with the byte-range leases below.
* **Leases** (a pool's owner lease, the calibrator lease) are fcntl OFD
  byte-range locks (:class:`ByteLock`).

How long each user waits for the data lock is part of the protocol too
(:data:`GRANT_LOCK_WAIT_S`, :data:`CALIBRATE_LOCK_WAIT_S`, :data:`LOCK_WAIT_S`).

OFD ("open file description") locks, unlike classic POSIX ``fcntl`` locks,
belong to the open file description, not to the process: closing an unrelated
descriptor of the same file does not drop them, and two descriptions opened by
one process exclude each other. They are released when the last descriptor of
their description is closed, which includes the death of the process, so a
lock a process holds for its whole life tells every other process that it is
alive (LMDB's reader slots use the same idea). Two threads that use *one*
descriptor are not excluded from each other: callers serialise their threads.

Errors (after ``filelock``'s Unix lock):

* busy (``EAGAIN``, ``EACCES``, ``EWOULDBLOCK``) on a non-blocking attempt is an
  answer, ``False``, not an error;
* a filesystem or kernel without OFD locks (``EINVAL``, ``ENOSYS``,
  ``EOPNOTSUPP``) raises :class:`~kvcached.errors.LedgerError` saying where to
  put the ledger instead;
* ``EINTR`` is retried by Python itself (PEP 475); anything else is raised as it is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time

from kvcached.errors import LedgerError

#: Seconds a grant waits for the data lock before it counts as a miss (the
#: first grant of an episode; later ones in the same episode do not wait).
GRANT_LOCK_WAIT_S = 0.5
#: Seconds a calibration waits for the data lock before it gives up this tick.
CALIBRATE_LOCK_WAIT_S = 2.0
#: Seconds registration, limits, closing and snapshots wait by default.
LOCK_WAIT_S = 10.0

F_OFD_GETLK = 36
F_OFD_SETLK = 37
F_OFD_SETLKW = 38

# struct flock on Linux (LP64, x86_64 and aarch64 alike): short l_type, short
# l_whence, off_t l_start, off_t l_len, pid_t l_pid, padded to 32 bytes. l_pid
# must be 0 for the OFD commands.
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _pack(kind: int, start: int, length: int = 1) -> bytes:
    return _FLOCK.pack(kind, 0, start, length, 0)


def _unsupported(exc: OSError, what: str) -> LedgerError:
    return LedgerError(
        f"{what}: this filesystem or kernel does not support fcntl OFD byte-range "
        f"locks ({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}); the ledger "
        "needs a local Linux filesystem (Linux >= 3.15): set KVCACHED_LEDGER_DIR to a "
        "directory on one, e.g. /dev/shm"
    )


class ByteLock:
    """An exclusive OFD lock on one byte of an open file.

    The packed ``struct flock`` arguments are built once, so taking and
    dropping the lock costs two ``fcntl`` calls and nothing else.
    """

    __slots__ = ("fd", "start", "what", "_lock", "_unlock")

    def __init__(self, fd: int, start: int, what: str) -> None:
        self.fd = fd
        self.start = start
        self.what = what
        self._lock = _pack(fcntl.F_WRLCK, start)
        self._unlock = _pack(fcntl.F_UNLCK, start)

    def acquire(self, wait: bool = True) -> bool:
        """Take the lock; ``False`` only when ``wait`` is false and another
        description holds it."""
        try:
            fcntl.fcntl(self.fd, F_OFD_SETLKW if wait else F_OFD_SETLK, self._lock)
        except OSError as exc:
            if not wait and exc.errno in _BUSY:
                return False
            if exc.errno in _UNSUPPORTED:
                raise _unsupported(exc, self.what) from exc
            raise
        return True

    def release(self) -> None:
        fcntl.fcntl(self.fd, F_OFD_SETLKW, self._unlock)

    def held_elsewhere(self) -> bool:
        """Whether another open file description holds a lock on this byte
        (``F_OFD_GETLK``; our own description's locks do not count)."""
        try:
            answer = fcntl.fcntl(self.fd, F_OFD_GETLK, self._lock)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                raise _unsupported(exc, self.what) from exc
            raise
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


# The data lock's primitive and operations, bound once: the grant's hot path
# calls them through module globals.
flock = fcntl.flock
EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB
UN = fcntl.LOCK_UN


def wait_flock(fd: int, timeout: float) -> bool:
    """Take the whole-file flock lock on ``fd`` within ``timeout`` seconds.

    The slow path of the data lock, entered after a non-blocking attempt found
    it busy. A blocking ``flock`` cannot be given a deadline, so this polls:
    a few retries that yield the CPU (the lock is held for microseconds by a
    running holder), then sleeps doubling from 20 µs to 0.5 ms (a short cap: a
    poller notices a release late by at most that). ``False`` when the
    deadline passed: a holder that is stopped, traced or frozen, or one that
    a badly oversubscribed machine keeps descheduled while it holds the lock."""
    deadline = time.monotonic() + timeout
    spins = 0
    delay = 20e-6
    while True:
        try:
            flock(fd, EX_NB)
            return True
        except BlockingIOError:
            pass
        if spins < 32:
            spins += 1
            os.sched_yield()
            continue
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 5e-4)


def flock_holder(fd: int) -> int:
    """The pid that holds the whole-file flock lock of ``fd``'s file, from
    ``/proc/locks`` (the kernel records a flock lock's owner there; seen from
    another PID namespace it may be 0); 0 when none is listed or it cannot be read."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return 0
    for line in lines:
        parts = line.split()
        # "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"; waiters have a "->" field
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
            try:
                return int(parts[4])
            except ValueError:
                return 0
    return 0


def process_state(pid: int) -> str:
    """A word for the state of process ``pid`` (``running``, ``stopped``,
    ``traced``, ``gone``...), from ``/proc/PID/stat``; ``unknown`` if unreadable."""
    if pid <= 0:
        return "unknown"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    code = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode(errors="replace")
    return {
        "R": "running",
        "S": "sleeping",
        "D": "in uninterruptible wait",
        "T": "stopped",
        "t": "traced (stopped by a debugger)",
        "Z": "a zombie",
        "X": "gone",
        "I": "idle",
    }.get(code, code or "unknown")
