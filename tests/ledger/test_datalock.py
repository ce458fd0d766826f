"""The data lock on its own: a bounded wait, the holder named, errors sorted,
and the journal replayed by whoever takes the lock."""

from __future__ import annotations

import errno
import fcntl
import os
import time

import pytest

from kvcached.errors import LedgerBusyError
from kvcached.ledger import datalock as datalock_module
from kvcached.ledger.datalock import DataLock
from kvcached.ledger.layout import H_JOURNAL


class _Journal:
    """A journal with nothing pending unless a test says so."""

    def __init__(self) -> None:
        self.u64 = memoryview(bytearray(4096)).cast("Q")
        self.replays = 0
        self.fail = False

    def replay(self) -> None:
        self.replays += 1
        if self.fail:
            raise RuntimeError("replay failed")
        self.u64[H_JOURNAL] = 0


@pytest.fixture
def lockfile(tmp_path):
    path = str(tmp_path / "ledger")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    fds = [os.open(path, os.O_RDWR) for _ in range(2)]
    yield path, fds
    for fd in fds:
        os.close(fd)


def test_acquire_release_and_a_second_description_waits_its_bound(lockfile):
    path, (mine, other) = lockfile
    lock = DataLock(mine, path, _Journal())
    with lock, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
    t0 = time.monotonic()
    with pytest.raises(LedgerBusyError, match=rf"held by pid {os.getpid()} .*within 0.05 s") as err:
        lock.acquire(0.05)
    assert 0.05 <= time.monotonic() - t0 < 2.0
    assert err.value.holder == os.getpid() and err.value.waited_s == 0.05
    fcntl.flock(other, fcntl.LOCK_UN)
    lock.acquire(0.05)  # the failed wait left the thread lock free
    lock.release()


def test_an_error_other_than_busy_is_raised_as_it_is_and_frees_the_thread_lock(
    lockfile, monkeypatch
):
    path, (mine, _other) = lockfile
    lock = DataLock(mine, path, _Journal())

    def enolck(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    with monkeypatch.context() as m:
        m.setattr(datalock_module, "_flock", enolck)
        with pytest.raises(OSError) as err:
            lock.acquire(0.05)
        assert err.value.errno == errno.ENOLCK and not isinstance(err.value, LedgerBusyError)
    lock.acquire(0.05)
    lock.release()


def test_a_pending_journal_is_replayed_first_and_a_failed_replay_unlocks(lockfile):
    path, (mine, other) = lockfile
    journal = _Journal()
    lock = DataLock(mine, path, journal)
    with lock:
        assert journal.replays == 0  # nothing pending: not even called
    journal.u64[H_JOURNAL] = 1  # a retirement committed by a dead holder
    journal.fail = True
    with pytest.raises(RuntimeError, match="replay failed"):
        lock.acquire(0.05)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the flock was released
    fcntl.flock(other, fcntl.LOCK_UN)
    journal.fail = False
    with lock:
        assert journal.replays == 2
    assert not journal.u64[H_JOURNAL]
