"""The ledger's data lock: a whole-file ``flock`` with a bounded wait.

Rules it keeps (the ledger's, :mod:`kvcached.ledger.ledger`):

* **Short, and so is every wait for it.** It covers a handful of reads and
  writes of the mapping: no driver call, no sleep, no wait on another lock runs
  under it. Nobody waits without a bound: :meth:`DataLock.acquire` and
  :meth:`DataLock.acquire_fd` give up after their ``timeout`` with
  :class:`~kvcached.errors.LedgerBusyError` naming the holder, as the kernel
  lists it in ``/proc/locks``.
* **One description, one holder.** flock excludes every other open file
  description, in this process too, but not the holder's own: the ledger's own
  descriptor is shared by this process' threads, which a ``threading.Lock``
  serialises (:meth:`DataLock.acquire`); a pool takes the lock through a
  descriptor of its own under its own lock (:meth:`DataLock.acquire_fd`).
* **A journal left by the dead is finished first.** Whoever takes the lock
  replays the header journal (:mod:`kvcached.ledger.journal`) if a change is
  pending, before anything else, so a change that a process killed under the
  lock left halfway is completed exactly once.

Errors, sorted as in ``filelock``'s Unix lock: busy (``EWOULDBLOCK``, which
Python raises as :class:`BlockingIOError`) is not an error, it is waited for
(:func:`~kvcached.ledger.locks.wait_flock`) and becomes
:class:`~kvcached.errors.LedgerBusyError` at the deadline; ``EINTR`` is retried
by Python itself (PEP 475); anything else (``ENOLCK``: the kernel is out of
locks, ``EBADF``) is raised as it is, and the thread lock is released with it.

A pool's grant takes the uncontended lock inline (one ``flock`` call, no call
frame: :mod:`kvcached.ledger.pool`) where the ledger's lock is this one; the
tests in ``tests/ledger/test_grant_paths.py`` hold that copy to this class.
"""

from __future__ import annotations

import threading

from kvcached.errors import LedgerBusyError
from kvcached.ledger import _hooks
from kvcached.ledger.journal import HeaderJournal
from kvcached.ledger.layout import H_JOURNAL
from kvcached.ledger.locks import EX_NB as _EX_NB
from kvcached.ledger.locks import LOCK_WAIT_S, flock_holder, process_state, wait_flock
from kvcached.ledger.locks import UN as _UN
from kvcached.ledger.locks import flock as _flock


class DataLock:
    """The data lock of one ledger file (see the module docstring).

    ``fd`` is the ledger's own descriptor, ``path`` names the file in errors,
    ``journal`` is the file's header journal, replayed right after an
    acquisition that finds it pending (if that raises, the lock is released and
    the error propagates). Use it as ``with lock:`` (the default
    wait), or :meth:`acquire` / :meth:`release`; a pool uses :meth:`acquire_fd`
    / :meth:`release_fd` with its own descriptor.
    """

    def __init__(self, fd: int, path: str, journal: HeaderJournal) -> None:
        self.fd = fd
        self.path = path
        self.journal = journal
        self._words = journal.u64
        self._tlock = threading.Lock()

    # -- through the ledger's descriptor, shared by this process' threads ----------------
    def acquire(self, timeout: float = LOCK_WAIT_S) -> None:
        """Take the lock within ``timeout`` seconds (threads first queue on the
        thread lock, within the same bound), else raise :class:`LedgerBusyError`."""
        tlock = self._tlock
        if not tlock.acquire(False) and not tlock.acquire(True, timeout):
            raise self.busy_error(timeout, "another thread of this process")
        try:
            self.acquire_fd(self.fd, timeout)
        except BaseException:
            tlock.release()
            raise

    def release(self) -> None:
        try:
            self.release_fd(self.fd)
        finally:
            self._tlock.release()

    def __enter__(self) -> DataLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- through a descriptor that one thread uses at a time ---------------------------------
    def acquire_fd(self, fd: int, timeout: float) -> None:
        """Take the lock through ``fd`` (an open description of the ledger file
        that only one thread uses at a time) within ``timeout`` seconds, else
        raise :class:`LedgerBusyError`; then run :meth:`locked`."""
        try:
            _flock(fd, _EX_NB)
        except BlockingIOError:
            if not wait_flock(fd, timeout):
                raise self.busy_error(timeout) from None
        if self._words[H_JOURNAL] or _hooks.point is not None:
            self.locked(fd)

    def locked(self, fd: int) -> None:
        """What follows taking the lock through ``fd``: the journal's replay if a
        change is pending, then the test hook. A pool's inline grant calls it
        only when the journal is pending or a test hook is set."""
        if self._words[H_JOURNAL]:
            try:
                self.journal.replay()  # a process died halfway through a journaled change
            except BaseException:
                self.release_fd(fd)
                raise
        if _hooks.point is not None:
            _hooks.point("data-locked")

    def release_fd(self, fd: int) -> None:
        if _hooks.point is not None:
            _hooks.point("data-unlocking")
        _flock(fd, _UN)

    # -- who holds it ------------------------------------------------------------------------
    def holder(self) -> tuple[int, str]:
        """``(pid, state)`` of the process that holds the lock, as the kernel lists
        it (``(0, "unknown")`` when it lists none)."""
        pid = flock_holder(self.fd)
        return pid, process_state(pid) if pid > 0 else "unknown"

    def busy_error(self, waited: float, who: str | None = None) -> LedgerBusyError:
        """The error for a lock not free within ``waited`` seconds, naming its
        holder (``who``, else as the kernel lists it)."""
        pid, state = self.holder() if who is None else (0, who)
        holder = (
            f"pid {pid} ({state})"
            if pid > 0
            else who or "a process /proc/locks does not name (another PID namespace?)"
        )
        return LedgerBusyError(
            f"ledger {self.path}: the data lock is held by {holder} and was not free "
            f"within {waited:g} s; a process stopped (SIGSTOP, a debugger, a frozen cgroup) "
            "while holding it stalls this GPU's accounting until it continues or dies",
            pid,
            waited,
        )

    def detach_in_child(self) -> None:
        """After ``fork``: a fresh thread lock (the parent's may have been held)."""
        self._tlock = threading.Lock()
