"""Calibration: how a ledger's budget follows the device's free memory.

The thread that runs it on a cadence is :class:`~kvcached.ledger.calibrator.Calibrator`;
what it does on one ledger is :class:`BudgetCalibration`, the rules:

* **Calibration is coordinated only among calibrators.** A non-blocking lease
  (byte 1 of the file) lets one process at a time sample the driver, outside
  the data lock, then publish ::

      budget = min(total - margin,
                   max(0, charges now - released + sampled free - margin - granted in the window))

  under it; the calibration sequence keeps an older sample from overwriting a
  newer one. Grants and refunds go on meanwhile.
* ``released`` (the seed has no such term) is what pools have released but not
  yet refunded: each owner publishes its batch in its record without the lock,
  so that memory, which the driver already reports as free, is not counted twice.
* *The window* (not in the seed either) opens under the data lock before the
  sample and closes at publication; every grant made while it is open adds its
  bytes to ``window_granted``. Those bytes are in "charges now" and, when they
  were materialised after the sample, still in "sampled free": subtracting them
  counts them once whatever the interleaving (growth materialised before the
  sample is then under-counted until the next calibration, which is safe).
* Publication is journaled (:mod:`kvcached.ledger.journal`), so budget and
  sequence change together even if the calibrator dies in between.
* **The safety margin** is ``total x (1 - gpu_utilization)``, fixed in the file
  by its creator while any live process has a pool in it; a file no live pool
  uses takes the margin of the next process that opens it
  (:meth:`BudgetCalibration.reconcile`).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Protocol

from kvcached.errors import LedgerBusyError, LedgerError
from kvcached.ledger import _hooks, layout
from kvcached.ledger.calibrator import Calibration, Calibrator, MemInfo
from kvcached.ledger.file import LedgerFile
from kvcached.ledger.journal import HeaderJournal
from kvcached.ledger.layout import (
    H_BUDGET,
    H_HIGH_WATER,
    H_MARGIN,
    H_SEQ,
    H_TOTAL,
    H_WINDOW,
    H_WINDOW_GRANTED,
)
from kvcached.ledger.locks import CALIBRATE_LOCK_WAIT_S, ByteLock
from kvcached.ledger.validate import MAX_TOTAL_BYTES, corrupt
from kvcached.log import get_logger

log = get_logger("kvcached.ledger")


def checked_sample(sampler: MemInfo, device_id: str) -> tuple[int, int]:
    """``sampler.mem_info()`` if it describes a possible device, else raise
    :class:`LedgerError` (a ledger is never created for an absurd total)."""
    free, total = sampler.mem_info()
    free, total = int(free), int(total)
    if not 0 < total <= MAX_TOTAL_BYTES or free < 0:
        hint = " (KVCACHED_HOST_CAPACITY)" if device_id.startswith("host-") else ""
        raise LedgerError(
            f"device {device_id} reports {free} bytes free of {total}{hint}; a ledger needs "
            f"a total of 1 byte to 8 PiB and free memory of 0 or more"
        )
    return min(free, total), total


class CalibratedLedger(Protocol):
    """What calibration uses of its ledger (:class:`~kvcached.ledger.ledger.Ledger`)."""

    path: str
    device_id: str
    file: LedgerFile
    journal: HeaderJournal
    sampler: MemInfo | None
    safety_margin: int
    total_bytes: int
    calibration_interval_s: float | None
    i64: memoryview
    u32: memoryview
    u64: memoryview
    tokens: memoryview

    def _check_open(self) -> None: ...
    def _lock_data(self, timeout: float) -> None: ...
    def _unlock_data(self) -> None: ...
    def locked(self) -> AbstractContextManager[object]: ...
    def check_identity(self) -> None: ...
    def retire_dead(self, timeout: float = ...) -> int: ...
    def validate_image(self, image: bytes, locked: bool = True) -> None: ...
    def charged_total(self) -> int: ...
    def released_total(self) -> int: ...
    def refuse(self, reason: str) -> None: ...
    def refresh_pools(self) -> None: ...


class BudgetCalibration:
    """Calibration of one ledger in this process (see the module docstring), and
    the process' calibrator thread for it, which runs while any pool that asked
    for it is open (:meth:`acquire_thread`, refcounted)."""

    def __init__(self, ledger: CalibratedLedger) -> None:
        self._ledger = ledger
        self._lease = ByteLock(
            ledger.file.fd, layout.CALIBRATOR_LEASE_BYTE, f"calibrator lease of {ledger.path}"
        )
        self._tlock = threading.Lock()
        self.thread: Calibrator | None = None
        self._users = 0
        self._users_lock = threading.Lock()

    def calibrate(self, sampler: MemInfo | None = None) -> Calibration:
        """See :meth:`kvcached.ledger.ledger.Ledger.calibrate`."""
        led = self._ledger
        led._check_open()
        sampler = sampler or led.sampler
        if sampler is None:
            raise ValueError("calibrate(): no sampler; pass the device's driver")
        if not self._tlock.acquire(blocking=False):
            return Calibration(False, "busy")
        try:
            if not self._lease.acquire(wait=False):
                return Calibration(False, "busy")
            try:
                led.check_identity()
                try:
                    retired = led.retire_dead(CALIBRATE_LOCK_WAIT_S)
                    led._lock_data(CALIBRATE_LOCK_WAIT_S)
                except LedgerBusyError:
                    return Calibration(False, "locked")
                try:
                    seq = led.u64[H_SEQ]
                    led.i64[H_WINDOW_GRANTED] = 0
                    led.u32[H_WINDOW] = 1
                    image = bytes(led.file.mm[: layout.FILE_SIZE])
                finally:
                    led._unlock_data()
                led.validate_image(image)  # a consistent copy, checked outside the lock
                free, _total = sampler.mem_info()
                if _hooks.point is not None:
                    _hooks.point("calibrate-sampled")
                return self.publish(seq, int(free), retired)
            finally:
                self._lease.release()
        finally:
            self._tlock.release()

    def publish(self, seq: int, free: int, retired: int = 0) -> Calibration:
        """Publish the budget from a sample of ``free`` bytes taken at sequence
        ``seq``, unless a newer one was published meanwhile (``stale``)."""
        led = self._ledger
        try:
            led._lock_data(CALIBRATE_LOCK_WAIT_S)
        except LedgerBusyError:
            return Calibration(False, "locked", retired)
        try:
            if led.u64[H_SEQ] != seq:
                return Calibration(
                    False, "stale", retired, led.i64[H_BUDGET], free, 0, led.u64[H_SEQ]
                )
            charged = led.charged_total()
            released = led.released_total()
            total, margin = led.i64[H_TOTAL], led.i64[H_MARGIN]
            if not 0 <= released <= charged <= total:  # the records were checked at the window
                error = corrupt(
                    led.path,
                    f"the pools charge {charged} bytes ({released} "
                    f"released) on a device of {total}",
                )
                led.refuse(str(error))
                raise error
            free = min(max(0, free), total)
            # Released but not refunded: in `free` and in `charged`. Granted in the
            # window: in `charged`, and in `free` unless created before the sample.
            # Count each once; and never more than the device can hold.
            budget = charged - released + free - margin - led.i64[H_WINDOW_GRANTED]
            budget = min(max(0, budget), total - margin)
            led.journal.publish(budget, free, seq + 1)
            if _hooks.point is not None:
                _hooks.point("calibrate-published")
        finally:
            led._unlock_data()
        led.refresh_pools()
        return Calibration(True, "published", retired, budget, free, charged, seq + 1)

    # -- the safety margin -----------------------------------------------------------------
    def reconcile(self, sampler: MemInfo, util: float) -> None:
        """At open: compare the file's total and margin with this process' view
        (``sampler``, ``util``): a total that differs is warned about and kept;
        a margin that differs is adopted if no live pool uses the file, else
        warned about and kept."""
        led = self._ledger
        _free, total = checked_sample(sampler, led.device_id)
        wanted = round(total * (1.0 - util))
        if total != led.total_bytes:
            variable = (
                "KVCACHED_HOST_CAPACITY"
                if led.device_id.startswith("host-")
                else "the device's total memory (another device behind this bus id?)"
            )
            log.warning(
                "ledger %s was created for a device of %d bytes; this process sees %d. "
                "What differs is %s: use one value for every process on a device. The "
                "ledger's total and margin are kept.",
                led.path,
                led.total_bytes,
                total,
                variable,
            )
            return
        if wanted == led.safety_margin:
            return
        was = led.safety_margin
        if self.adopt_margin_if_unused(wanted):
            log.info(
                "ledger %s: no live process uses it; its safety margin is now this "
                "process' %d bytes (KVCACHED_GPU_UTILIZATION=%s), was %d",
                led.path,
                wanted,
                util,
                was,
            )
            return
        log.warning(
            "ledger %s keeps the safety margin of %d bytes that it was created "
            "with while other processes use it; this process' "
            "KVCACHED_GPU_UTILIZATION=%s would give %d (total %d). Use one value "
            "on a GPU.",
            led.path,
            led.safety_margin,
            util,
            wanted,
            total,
        )

    def adopt_margin_if_unused(self, margin: int) -> bool:
        """Give the ledger the safety margin ``margin`` if pools have used it and
        none is in use once dead owners' are retired (a file outlives its
        processes in /dev/shm, and a later run configured differently must not
        inherit a margin that no running process asked for); the budget is
        re-sampled with it. False, and nothing written, while a live pool uses
        the file or none ever has (its creator is likely about to register)."""
        led = self._ledger
        led.retire_dead()
        with led.locked():
            high_water = led.u32[H_HIGH_WATER]
            if not high_water or any(led.tokens[:high_water]):
                return False
            free, total = checked_sample(led.sampler, led.device_id)
            if total != led.i64[H_TOTAL]:
                return False
            # Each write alone leaves a valid ledger: the next calibration
            # re-derives the budget from whichever margin is in the header.
            led.i64[H_BUDGET] = min(max(0, free - margin), total - margin)
            led.i64[H_MARGIN] = margin
            led.safety_margin = margin
            return True

    # -- this process' calibrator thread -------------------------------------------------
    def calibrator(self, sampler: MemInfo | None = None, interval_s: float | None = None):
        """A new :class:`Calibrator` for the ledger (not started)."""
        led = self._ledger
        if interval_s is None:
            interval_s = led.calibration_interval_s
        return Calibrator(led, sampler or led.sampler, interval_s)

    def acquire_thread(self) -> None:
        """Start this process' calibrator thread if it is not running (refcounted)."""
        with self._users_lock:
            self._users += 1
            if self.thread is None and self._ledger.sampler is not None:
                self.thread = self.calibrator()
                self.thread.start()

    def release_thread(self) -> None:
        with self._users_lock:
            self._users -= 1
            if self._users <= 0 and self.thread is not None:
                thread, self.thread = self.thread, None
                thread.stop()

    def stop_thread(self) -> None:
        """Stop the thread whoever still uses it (the ledger closes)."""
        if self.thread is not None:
            self.thread.stop()
            self.thread = None

    def detach_in_child(self) -> None:
        """After ``fork``: no thread, fresh locks (the parent's may have been held)."""
        self._tlock = threading.Lock()
        self._users_lock = threading.Lock()
        self.thread = None
