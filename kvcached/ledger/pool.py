"""One pool's account on the device ledger: what the memory layer calls.

:class:`PoolBudget` satisfies :class:`kvcached.memory.budget.PhysicalBudget`.
The memory layer calls :meth:`~PoolBudget.grant` before it creates physical
memory and :meth:`~PoolBudget.refund` after a release is confirmed.

A pool knows its ledger only through :class:`PoolLedger`, the part of
:class:`~kvcached.ledger.ledger.Ledger` it uses, so this module does not
import :mod:`kvcached.ledger.ledger` (which makes the pools).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from contextlib import AbstractContextManager
from typing import Protocol

from kvcached.errors import LedgerBusyError, LedgerError
from kvcached.ledger import _hooks, wants
from kvcached.ledger.layout import (
    H_BUDGET,
    H_HIGH_WATER,
    H_JOURNAL,
    H_WINDOW,
    H_WINDOW_GRANTED,
    i_limit,
    i_revision,
    p_charged,
    p_released,
)
from kvcached.ledger.locks import EX_NB as _EX_NB
from kvcached.ledger.locks import LOCK_WAIT_S
from kvcached.ledger.locks import UN as _UN
from kvcached.ledger.locks import flock as _flock
from kvcached.ledger.validate import corrupt
from kvcached.log import get_logger
from kvcached.units import MIB

log = get_logger("kvcached.ledger")

#: Refunds below this are batched in the pool; a handle this large (or a batch
#: that reaches it) is written to the ledger at once.
REFUND_FLUSH_BYTES = 64 * MIB


class PoolLedger(Protocol):
    """What a pool uses of its ledger (:class:`~kvcached.ledger.ledger.Ledger`
    is the one implementation; see it for each member).

    The mapped views (``i64``, ``u32``, ``u64``, ``charges``, ``tokens``) are
    the file's words; a pool writes only its own record's ``charged`` and
    ``released`` words and, in a calibration window, ``window_granted``, all
    but ``released`` under the data lock.
    """

    path: str
    total_bytes: int
    refusal: str | None
    closed: bool
    busy_since: float
    plain_lock: bool
    i64: memoryview
    u32: memoryview
    u64: memoryview
    charges: memoryview
    tokens: memoryview

    def room(self, instance_slot: int) -> int: ...

    def instance_charged(self, instance_slot: int) -> int: ...

    def lock_fd(self, fd: int, timeout: float | None = None) -> None: ...

    def locked_fd(self, fd: int) -> None: ...

    def unlock_fd(self, fd: int) -> None: ...

    def locked(self, timeout: float = LOCK_WAIT_S) -> AbstractContextManager[object]: ...

    def note_busy(self, exc: LedgerBusyError) -> None: ...

    def busy_over(self) -> None: ...

    def refuse(self, reason: str) -> None: ...

    def close_pool_locked(self, slot: int, token: int) -> int: ...

    def pool_closed(self, pool: PoolBudget, calibrated: bool) -> None: ...


def _bad_size(call: str, nbytes: object) -> ValueError:
    return ValueError(f"{call}(nbytes={nbytes!r}): must be an int number of bytes >= 0")


class PoolBudget:
    """The physical bytes one pool holds on one device, kept in the shared ledger.

    Invariants:

    * the pool's record in the ledger charges exactly ``charged`` bytes, and no
      other process writes it while this pool holds its owner lease;
    * a refund follows a confirmed release (the caller's promise; a failed
      release is not refunded), and ``pending_refund <= charged``;
    * refunds are batched below :data:`REFUND_FLUSH_BYTES` per pool (so per
      thread too); a refund of a handle of 64 MiB or more, or one that brings the
      batch to 64 MiB, is flushed at once; the batch's size is published in the
      record's ``released`` word (one store, no lock) for calibration;
    * a :meth:`grant` of no more than the batch re-uses it: the record already
      charges those bytes, so nothing is written and no lock is taken (the same
      budget and limit test is made on values read without the lock), unless
      a calibration window is open (then it goes to the ledger, to be counted
      in the window); a larger grant folds the batch into its own write under
      the data lock;
    * a flush that fails keeps its batch for the next attempt;
    * :meth:`grant` never raises for the ledger's state: a data lock that
      stays held (:data:`~kvcached.ledger.locks.GRANT_LOCK_WAIT_S`), a
      corrupt or replaced file are misses (``False``), logged once.

    :meth:`headroom` is a cached figure: the bytes :meth:`grant` would give,
    exact as of this pool's last grant, flush or refresh, plus the refunds it
    has batched since. It does not see other pools' grants and refunds or a new
    calibration until the next of those; the process' calibrator refreshes it
    on every tick, so it is at most ``KVCACHED_CALIBRATION_INTERVAL_S`` (1 s by
    default) plus one calibration behind the ledger. :meth:`grant` itself
    always decides on the ledger as it is.

    Thread-safe: one lock per pool, taken before the ledger's data lock.

    The grant keeps three hand-written copies for speed (the inline data lock
    and :meth:`Ledger.room` twice), each pinned to its original by
    ``tests/ledger/test_grant_paths.py``. Issue #36 folded them into calls and
    measured that against these copies (``benchmarks/ledger.py``, five
    interleaved runs each, ``benchmarks/results/hot-path-fold-host/``): a
    locked grant+refund pair took 1829 ns of CPU folded against 1567 kept, and
    the grow/shrink pattern fell from 1.070 to 0.977 of the flock design
    (median ratios; its target is 1.0), so they stay.
    """

    def __init__(
        self,
        ledger: PoolLedger,
        slot: int,
        fd: int,
        token: int,
        instance_slot: int,
        instance: str,
    ) -> None:
        self._ledger = ledger
        self.slot = slot
        self.token = token
        self.instance = instance
        self.instance_slot = instance_slot
        self._fd = fd  # holds the owner lease (an OFD lock on the record's first byte)
        self._ci = p_charged(slot)
        self._ri = p_released(slot)
        self._li = i_limit(instance_slot)
        self._lock = threading.Lock()
        self._charged = 0
        self._pending = 0
        self._room = 0
        self._closed = False
        self._uses_calibrator = False
        self._finalizer = weakref.finalize(self, _finalize, fd)
        # A grant takes the data lock inline where it is the ledger's own flock:
        # the two call frames it saves are ~3% of a locked grant's CPU (2508 ->
        # 2582 ns a grant+refund pair; with the two Ledger.room copies, the fold
        # measured in the class docstring); tests/ledger/test_grant_paths.py pins
        # the inline path to the called one.
        self._inline_lock = ledger.plain_lock

    # -- the PhysicalBudget protocol ----------------------------------------------------
    def grant(self, nbytes: int) -> bool:
        """Charge ``nbytes`` before creating them; ``False`` when the device's budget
        or the instance's limit would be passed (nothing is charged then), or
        when the ledger cannot be used now (see the class docstring)."""
        if type(nbytes) is not int or nbytes <= 0:
            if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes == 0:
                return True
            raise _bad_size("grant", nbytes)
        with self._lock:
            if self._closed:
                raise LedgerError(f"grant() on a closed pool ({self!r})")
            pending = self._pending
            if nbytes <= pending:
                led = self._ledger
                if not led.u32[H_WINDOW] and led.refusal is None:
                    # Re-use refunds batched here: the record already charges these
                    # bytes, so no charge changes and nothing is written. The ledger's
                    # test (Ledger.room) on words read without the lock, written out:
                    # the call cost ~4% of a grant+refund pair (1063 -> 1109 ns; the
                    # fold of all three copies: see the class docstring).
                    # tests/ledger/test_grant_paths.py pins this copy to Ledger.room.
                    i64 = led.i64
                    room = i64[H_BUDGET] - sum(led.charges[: led.u32[H_HIGH_WATER]])
                    limit = i64[self._li]
                    if limit:
                        room = min(room, limit - led.instance_charged(self.instance_slot))
                    room += pending
                    if nbytes <= room:
                        self._pending = pending - nbytes
                        i64[self._ri] = pending - nbytes
                        room -= nbytes
                        self._room = room if room > 0 else 0
                        return True
            return self._grant_locked(nbytes)

    def _grant_locked(self, nbytes: int) -> bool:
        """A grant decided and charged under the data lock (``self._lock`` held)."""
        led = self._ledger
        if led.refusal is not None:
            self._room = 0
            return False
        fd = self._fd
        # A grant's wait (lock_fd's default): the full bound once, none while a
        # busy episode lasts (quick misses).
        try:
            if self._inline_lock:
                _flock(fd, _EX_NB)  # Ledger.lock_fd's uncontended case, inline
                if led.u64[H_JOURNAL] or _hooks.point is not None:
                    led.locked_fd(fd)
            else:
                led.lock_fd(fd)
        except BlockingIOError:  # held: the bounded wait
            try:
                led.lock_fd(fd)
            except LedgerBusyError as exc:
                led.note_busy(exc)
                return False
        except LedgerBusyError as exc:
            led.note_busy(exc)
            return False
        try:
            i64 = led.i64
            pending = self._pending
            used = sum(led.charges[: led.u32[H_HIGH_WATER]])
            if not 0 <= used <= led.total_bytes:
                led.refuse(
                    str(
                        corrupt(
                            led.path,
                            f"the pools charge {used} bytes together "
                            f"on a device of {led.total_bytes}",
                        )
                    )
                )
                self._room = 0
                return False
            # Ledger.room, written out as in grant() (the call measured ~2.5% of a
            # locked grant+refund pair: ~70 ns of 2.7 us); test_grant_paths.py pins it.
            room = i64[H_BUDGET] - used
            limit = i64[self._li]
            if limit:
                room = min(room, limit - led.instance_charged(self.instance_slot))
            room += pending
            granted = nbytes <= room
            if _hooks.point is not None:
                _hooks.point("grant-decided")
            charged = self._charged - pending
            if granted:
                charged += nbytes
                room -= nbytes
                if led.u32[H_WINDOW]:  # growth the open calibration must not count twice
                    i64[H_WINDOW_GRANTED] += nbytes
            if pending:  # released first: a crash in between over-counts, never under
                i64[self._ri] = 0
                self._pending = 0
            if charged != self._charged:
                i64[self._ci] = charged
                self._charged = charged
            if granted and _hooks.point is not None:
                _hooks.point("grant-charged")
        finally:
            if self._inline_lock and _hooks.point is None:
                _flock(fd, _UN)
            else:
                led.unlock_fd(fd)
        if led.busy_since:
            led.busy_over()
        self._room = room if room > 0 else 0
        return granted

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` of one handle whose release was confirmed.

        Batched below 64 MiB; a failed flush is logged and its batch kept for
        the next grant or flush (the release already happened: the caller has
        nothing to undo)."""
        if type(nbytes) is not int or nbytes <= 0:
            if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes == 0:
                return
            raise _bad_size("refund", nbytes)
        with self._lock:
            if self._closed:
                raise LedgerError(f"refund() on a closed pool ({self!r})")
            if nbytes > self._charged - self._pending:
                raise ValueError(
                    f"refund(nbytes={nbytes}): pool {self.slot} of {self.instance!r} holds only "
                    f"{self._charged - self._pending} unrefunded bytes; refund only what was "
                    "granted, once, after its release succeeded"
                )
            self._pending += nbytes
            led = self._ledger
            self._room += nbytes
            if led.refusal is not None:
                return  # kept here: nothing is written to a corrupt or replaced file
            led.i64[self._ri] = self._pending  # published without the lock
            if self._pending >= REFUND_FLUSH_BYTES:
                try:
                    self._flush_locked(None)  # a grant's wait
                except LedgerBusyError as exc:  # the batch stays, published in `released`
                    led.note_busy(exc)
                except Exception as exc:  # the batch stays; the next grant or flush retries
                    log.warning(
                        "ledger refund flush failed, %d bytes kept for retry: %s",
                        self._pending,
                        exc,
                    )

    def headroom(self) -> int:
        """Bytes :meth:`grant` would give now (cached; see the class docstring)."""
        return self._room

    def flush(self) -> None:
        """Write batched refunds to the ledger now. On failure the batch is kept
        and the error raised."""
        with self._lock:
            if self._pending and not self._closed and self._ledger.refusal is None:
                self._flush_locked()

    def close(self) -> None:
        """Flush, retire this pool's record and drop its owner lease. Idempotent.

        Bytes still charged (handles whose release failed, or a pool closed
        without releasing) leave the sum and the budget alike, so no credit
        appears; a later calibration sees whatever memory is really free."""
        with self._lock:
            if self._closed:
                return
            led = self._ledger
            self._closed = True
            self._finalizer.detach()
            try:
                locked = False
                if led.refusal is not None:
                    # Nothing is written to a corrupt or replaced file; the dropped
                    # lease marks the record dead for whoever repairs the device.
                    log.warning("%s; pool %d closes without touching it", led.refusal, self.slot)
                elif not led.closed:
                    try:
                        led.lock_fd(self._fd, LOCK_WAIT_S)
                        locked = True
                    except LedgerBusyError as exc:
                        # Dropping the lease is enough: the record then reads as a dead
                        # owner's, retired (charge and budget alike) by the next
                        # registration or calibration.
                        log.warning(
                            "%s; pool %d closes without it, to be retired later", exc, self.slot
                        )
                if locked:
                    try:
                        if self._pending and led.tokens[self.slot] == self.token:
                            self._charged -= self._pending
                            led.i64[self._ri] = 0
                            led.i64[self._ci] = self._charged
                            self._pending = 0
                        left = led.close_pool_locked(self.slot, self.token)
                    finally:
                        led.unlock_fd(self._fd)
                    if left:
                        log.warning(
                            "ledger %s: pool %d of %r closed with %d bytes still charged "
                            "(never refunded); retired from the budget too, until a "
                            "calibration sees them free",
                            led.path,
                            self.slot,
                            self.instance,
                            left,
                        )
            finally:
                os.close(self._fd)  # drops the owner lease
                self._charged = self._pending = self._room = 0
        calibrated, self._uses_calibrator = self._uses_calibrator, False
        led.pool_closed(self, calibrated)

    # -- beyond the protocol ---------------------------------------------------------------
    def refresh(self, timeout: float = LOCK_WAIT_S) -> None:
        """Recompute :meth:`headroom` from the ledger (a short data-lock section;
        :class:`~kvcached.errors.LedgerBusyError` if it stays held ``timeout`` s)."""
        with self._lock:
            if self._closed:
                return
            led = self._ledger
            if led.refusal is not None:
                self._room = 0
                return
            led.lock_fd(self._fd, timeout)
            try:
                room = led.room(self.instance_slot)
            finally:
                led.unlock_fd(self._fd)
            room += self._pending
            self._room = room if room > 0 else 0

    @property
    def charged(self) -> int:
        """Bytes this pool's ledger record charges (batched refunds included)."""
        return self._charged

    @property
    def pending_refund(self) -> int:
        """Refunded bytes batched here, not yet written to the ledger."""
        return self._pending

    @property
    def ledger_path(self) -> str:
        """The ledger file this pool is charged to (``kvctl`` finds it through snapshots)."""
        return self._ledger.path

    @property
    def limit(self) -> int:
        """The instance's limit on this device now (0: unlimited); read without a lock."""
        return self._ledger.i64[self._li]

    @property
    def limit_revision(self) -> int:
        return self._ledger.u64[i_revision(self.instance_slot)]

    def post_want(self, nbytes: int) -> bool:
        """Call on the device's other instances for ``nbytes`` this pool lacked
        (:mod:`kvcached.ledger.wants`); ``False`` where that would not help."""
        return wants.post_want(self._ledger, self.slot, self.instance_slot, nbytes, self._pending)

    def neighbour_wants(self) -> list[wants.Want]:
        """The latest call of every other instance's pool on this device."""
        return wants.neighbour_wants(self._ledger, self.instance_slot)

    def device_room(self) -> int:
        """The device's budget less every pool's charge, read without the lock."""
        return wants.device_room(self._ledger)

    def instance_charged(self) -> int:
        """The sum of the charges of this instance's pools on this device."""
        with self._ledger.locked():
            return self._ledger.instance_charged(self.instance_slot)

    @property
    def closed(self) -> bool:
        return self._closed

    def _flush_locked(self, timeout: float | None = LOCK_WAIT_S) -> None:
        """Write the batch (``self._lock`` held); ``timeout`` as :meth:`PoolLedger.lock_fd`'s."""
        led = self._ledger
        led.lock_fd(self._fd, timeout)
        try:
            charged = self._charged - self._pending
            led.i64[self._ri] = 0
            led.i64[self._ci] = charged
            self._charged = charged
            self._pending = 0
            if _hooks.point is not None:
                _hooks.point("refund-flushed")
        finally:
            led.unlock_fd(self._fd)

    def _abandon(self) -> None:
        """Tests: die as a killed process would, dropping the lease and nothing else."""
        with self._lock:
            self._closed = True
            self._finalizer.detach()
            os.close(self._fd)
        self._ledger.pool_closed(self, False)

    def _detach_in_child(self) -> None:
        """After fork: the child drops its copy of the lease descriptor only."""
        self._closed = True
        self._finalizer.detach()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._lock = threading.Lock()

    def __enter__(self) -> PoolBudget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"charged={self._charged}"
        return f"<PoolBudget {self.instance!r} slot={self.slot} {state}>"


def _finalize(fd: int) -> None:
    """Last resort for a pool dropped without :meth:`PoolBudget.close`: drop the
    owner lease and nothing else, so the record reads as a dead owner's and the
    next registration or calibration retires it. (Taking the data lock here
    could deadlock: the garbage collector may run this on a thread that already
    holds it.)"""
    with contextlib.suppress(OSError):
        os.close(fd)
