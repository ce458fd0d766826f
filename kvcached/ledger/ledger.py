"""The per-GPU ledger: one mapped file that every process on a device shares.

Rules the ledger keeps (the seed PR #487's semantics; what they guarantee users,
and the tests that show it, is in docs/ledger.md). Each lives in one module:

* **Totals are sums** (here). The file stores each pool's charge and each
  instance's limit, never a total: the device's charges are the sum over pool
  records, an instance's the sum over its pools.
* **Grants never pass the budget, and the budget never passes the device.**
  A grant is checked and charged in one critical section under the data lock
  (:mod:`kvcached.ledger.pool`), so at every moment ``sum(charges) <= budget``
  holds unless the last calibration itself published a budget below the
  charges (then growth simply stops); and no budget is ever published above
  ``total - safety margin`` (:mod:`kvcached.ledger.calibration`).
* **The data lock is short, and so is every wait for it**
  (:mod:`kvcached.ledger.datalock`): a whole-file ``flock``, never held across
  a driver call or a sleep. A grant waits :data:`GRANT_LOCK_WAIT_S` and is then
  a miss (logged once per *busy episode*, which this class tracks),
  calibration gives up after :data:`CALIBRATE_LOCK_WAIT_S`, registration,
  limits and snapshots raise :class:`~kvcached.errors.LedgerBusyError` naming
  the holder. A pool takes it through its own descriptor, under the pool's
  lock; the ledger's other users share the ledger's descriptor.
* **A change of several words is journaled** in the header
  (:mod:`kvcached.ledger.journal`) and finished by the next holder of the data
  lock if its writer died.
* **What is read is checked.** The file is validated under the data lock when
  it is opened, at every registration and calibration and in every snapshot
  (:mod:`kvcached.ledger.validate`); a grant checks the sum it computes. A
  corrupt ledger is refused (grants become misses, nothing is written).
* **The file is the one at the path.** Registration and calibration check
  that the path still names this process' file; once it does not (unlinked or
  replaced), this process grants nothing more against it.
* **Liveness is a lock; retiring creates no credit** (:mod:`kvcached.ledger.registry`):
  each pool holds an OFD lease on its record for its whole life; a record whose
  lease can be taken is retired, its charge leaving the sum and the budget alike.
* **Calibration is coordinated only among calibrators**
  (:mod:`kvcached.ledger.calibration`; the thread: :mod:`kvcached.ledger.calibrator`).
* **Limits** are per instance records (:mod:`kvcached.ledger.limits`); a
  snapshot reads everything at once (:mod:`kvcached.ledger.snapshot`).
* **Calls for memory are advisory** (:mod:`kvcached.ledger.wants`): a pool's
  ``wanted`` words, written by its owner without the lock; nothing charged or
  refunded depends on them.

What is guaranteed: ``sum(charges) <= budget <= total - margin`` at every
moment, so kvcached's processes on a device never hold more than it has (less
the margin) through the ledger; and a published budget is at most what the
device had free at the sample, less the margin, plus the bytes that were
charged but not yet created (or released but not yet refunded) at that
moment. What remains an estimate (the seed's list): those in-flight bytes,
memory that other programs take after the sample, and driver overhead; the
safety margin absorbs them.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator

from kvcached.errors import LedgerBusyError, LedgerError, LedgerReplacedError
from kvcached.ledger import layout
from kvcached.ledger.calibration import BudgetCalibration, checked_sample
from kvcached.ledger.calibrator import Calibration, Calibrator, MemInfo
from kvcached.ledger.datalock import DataLock
from kvcached.ledger.file import Initial, LedgerFile, open_file
from kvcached.ledger.journal import HeaderJournal
from kvcached.ledger.layout import (
    H_BUDGET,
    H_HIGH_WATER,
    H_SEQ,
    i_limit,
    p_charged,
    p_instance,
    p_released,
    p_token,
)
from kvcached.ledger.limits import InstanceRecords, check_instance_name, check_limit_args
from kvcached.ledger.locks import CALIBRATE_LOCK_WAIT_S, GRANT_LOCK_WAIT_S, LOCK_WAIT_S, ByteLock
from kvcached.ledger.pool import PoolBudget
from kvcached.ledger.registry import PoolRegistry, process_start_time
from kvcached.ledger.snapshot import LedgerSnapshot, LimitStatus, take_snapshot
from kvcached.ledger.validate import check_image
from kvcached.log import get_logger

log = get_logger("kvcached.ledger")


class Ledger:
    """One device's ledger file, mapped into this process.

    Share one per device in a process (:func:`kvcached.ledger.open_ledger` does);
    every thread may use it. Pools are registered with :meth:`register_pool`;
    the accounting of one pool is :class:`~kvcached.ledger.pool.PoolBudget`,
    which uses only the members :class:`~kvcached.ledger.pool.PoolLedger`
    lists (the data lock through a pool's descriptor, the busy episode,
    :meth:`room`, refusal, retiring a closing pool).

    This class holds the mapping and the sums over it, and hands each other job
    to its part: :attr:`data_lock` (:class:`~kvcached.ledger.datalock.DataLock`),
    :attr:`journal` (:class:`~kvcached.ledger.journal.HeaderJournal`),
    :attr:`registry` (:class:`~kvcached.ledger.registry.PoolRegistry`),
    :attr:`instance_records` (:class:`~kvcached.ledger.limits.InstanceRecords`)
    and :attr:`calibration` (:class:`~kvcached.ledger.calibration.BudgetCalibration`).
    """

    #: The class :meth:`register_pool` makes; a subclass of Ledger may name a
    #: subclass of it (the benchmark's variants do).
    pool_class: type[PoolBudget] = PoolBudget

    def __init__(self, lfile: LedgerFile, sampler: MemInfo | None = None) -> None:
        self.file = lfile
        self.path = lfile.path
        self.sampler = sampler
        head = lfile.header()
        self.device_id = head.device_id.decode(errors="replace")
        self.total_bytes = head.total_bytes
        self.safety_margin = head.safety_margin
        #: Why this process grants nothing more on this file (corrupt, replaced), or None.
        self.refusal: str | None = None
        self.busy_since = 0.0  # monotonic start of a lock-busy episode (0: none)
        self._busy_misses = 0
        self._pools: weakref.WeakSet[PoolBudget] = weakref.WeakSet()
        self.start_time = process_start_time()
        #: Seconds between this process' calibrations (None: the default).
        self.calibration_interval_s: float | None = None
        # Hot-path views: every pool's charge, instance and token, by slot.
        i64, u32, u64 = lfile.i64, lfile.u32, lfile.u64
        self.i64, self.u32, self.u64 = i64, u32, u64
        n = layout.POOL_SLOTS
        self.charges = lfile.view(i64[p_charged(0) : p_charged(0) + 8 * n : 8])
        self.instances = lfile.view(u32[p_instance(0) : p_instance(0) + 16 * n : 16])
        self.tokens = lfile.view(u64[p_token(0) : p_token(0) + 8 * n : 8])
        self.released = lfile.view(i64[p_released(0) : p_released(0) + 8 * n : 8])
        w = layout.INSTANCE_WORDS
        self.limits = lfile.view(i64[i_limit(0) : i_limit(0) + w * layout.INSTANCE_SLOTS : w])
        self.journal = HeaderJournal(lfile, self.refuse)
        self.data_lock = DataLock(lfile.fd, self.path, self.journal)
        self.registry = PoolRegistry(self)
        self.instance_records = InstanceRecords(lfile, self.tokens, self.instances)
        self.calibration = BudgetCalibration(self)
        # A pool takes the data lock with a bare flock, inline in its grant, only
        # where the lock is this class's own: a subclass that replaces it (the
        # benchmark's baseline) is never bypassed.
        cls = type(self)
        self.plain_lock = cls.lock_fd is Ledger.lock_fd and cls.unlock_fd is Ledger.unlock_fd
        self.closed = False
        _LIVE.add(self)

    # -- opening --------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        device_id: str,
        sampler: MemInfo,
        *,
        directory: str | None = None,
        gpu_utilization: float | None = None,
        calibration_interval_s: float | None = None,
    ) -> Ledger:
        """Open the ledger of ``device_id`` (a PCI bus id; ``host-N`` for the host
        backend) in ``directory`` (the caller's ``KVCACHED_LEDGER_DIR``; unset:
        its documented default), creating it when missing from a sample of
        ``sampler.mem_info()``. This process' calibrator thread samples every
        ``calibration_interval_s`` (likewise).

        The safety margin is ``total x (1 - gpu_utilization)`` (the caller's
        ``KVCACHED_GPU_UTILIZATION``, likewise) and is fixed in the file by its
        creator while any live process has a pool in it: a process configured
        differently is then warned and follows the file; a file no live pool
        uses takes this process' margin
        (:meth:`~kvcached.ledger.calibration.BudgetCalibration.reconcile`).
        """
        from kvcached.config import defaults

        directory = defaults().ledger_dir if directory is None else directory
        util = defaults().gpu_utilization if gpu_utilization is None else gpu_utilization
        if not isinstance(device_id, str) or not device_id:
            raise ValueError(f"device_id={device_id!r}: must be the device's PCI bus id")
        if not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_utilization={util!r}: must be in (0, 1], e.g. 0.95")

        def initial() -> Initial:
            free, total = checked_sample(sampler, device_id)
            margin = round(total * (1.0 - util))
            return Initial(device_id, total, margin, min(max(0, free - margin), total - margin))

        ledger = cls(open_file(directory, device_id, initial), sampler)
        ledger.calibration_interval_s = calibration_interval_s
        try:
            with ledger.locked():
                ledger.validate_locked()
            ledger.calibration.reconcile(sampler, util)
        except BaseException:
            ledger.close()
            raise
        return ledger

    @classmethod
    def open_existing(cls, path: str) -> Ledger:
        """Open the ledger file at ``path`` to read it and set limits (``kvctl``):
        never creates one, needs no driver; :meth:`calibrate` is unavailable."""
        from kvcached.ledger.file import open_path

        return cls(open_path(path), None)

    # -- the data lock (kvcached.ledger.datalock) --------------------------------------
    def _lock_data(self, timeout: float = LOCK_WAIT_S) -> None:
        """Take the data lock through the ledger's descriptor (this process' threads
        queue for it) within ``timeout`` seconds, else raise :class:`LedgerBusyError`."""
        self.data_lock.acquire(timeout)

    def _unlock_data(self) -> None:
        self.data_lock.release()

    def lock_fd(self, fd: int, timeout: float | None = None) -> None:
        """Take the data lock through ``fd``, an open file description of the
        ledger that only one thread uses at a time (a pool's own, under the
        pool's lock). Waits ``timeout`` seconds, then raises
        :class:`LedgerBusyError`; ``None`` is a grant's wait:
        :data:`GRANT_LOCK_WAIT_S` once, then none while the busy episode lasts
        (each grant of a stalled ledger is a quick miss)."""
        if timeout is None:
            timeout = 0.0 if self.busy_since else GRANT_LOCK_WAIT_S
        self.data_lock.acquire_fd(fd, timeout)

    def locked_fd(self, fd: int) -> None:
        """What follows taking the data lock through ``fd`` (the journal, the test
        hook): a pool's inline grant, which takes the flock itself when
        :attr:`plain_lock`, calls it when there is a journal or a test hook."""
        self.data_lock.locked(fd)

    def unlock_fd(self, fd: int) -> None:
        self.data_lock.release_fd(fd)

    @contextlib.contextmanager
    def locked(self, timeout: float = LOCK_WAIT_S) -> Iterator[Ledger]:
        """The data lock as a context manager (not for the hot path)."""
        self._check_open()
        self._lock_data(timeout)
        try:
            yield self
        finally:
            self._unlock_data()

    def lock_holder(self) -> tuple[int, str]:
        """``(pid, state)`` of the process that holds the data lock, as the kernel
        lists it (``(0, "unknown")`` when it lists none)."""
        return self.data_lock.holder()

    def busy_error(self, waited: float, who: str | None = None) -> LedgerBusyError:
        """The error for a data lock not free within ``waited`` seconds, naming
        its holder (``who``, else as the kernel lists it)."""
        return self.data_lock.busy_error(waited, who)

    def note_busy(self, exc: LedgerBusyError) -> None:
        """Count a grant that missed because the data lock stayed busy; log once
        per episode (which :attr:`busy_since` then dates)."""
        self._busy_misses += 1
        if not self.busy_since:
            self.busy_since = time.monotonic()
            log.warning("%s. Grants are misses (requests wait) until it is free.", exc)

    def busy_over(self) -> None:
        """End the busy episode (the lock was taken again): log what it cost."""
        log.warning(
            "ledger %s: the data lock is free again after %.1f s; %d grant(s) were "
            "misses meanwhile",
            self.path,
            time.monotonic() - self.busy_since,
            self._busy_misses,
        )
        self.busy_since = 0.0
        self._busy_misses = 0

    # -- refusal: corrupt or replaced files -------------------------------------------------
    def refuse(self, reason: str) -> None:
        """Stop granting on this file, for ``reason`` (logged once)."""
        if self.refusal is None:
            self.refusal = reason
            if self.sampler is not None or self._pools:  # a reader (kvctl) says it itself
                log.error("%s; this process grants nothing more on it", reason)

    def validate_locked(self) -> None:
        """Check every record (under the data lock); a corrupt file is refused."""
        self.validate_image(self.file.mm)

    def validate_image(self, image, locked: bool = True) -> None:
        """Check every record of ``image``, a copy of the file taken under the data
        lock (``locked``) or not; a corrupt file is refused (and the error raised)."""
        try:
            check_image(image, self.path, locked=locked)
        except LedgerError as exc:
            self.refuse(str(exc))
            raise

    def check_identity(self) -> None:
        """Raise :class:`LedgerReplacedError` (and refuse further grants) if the
        ledger's path no longer names this process' file."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            now = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        if now == self.file.identity:
            return
        what = "was removed" if now is None else "now names another file"
        reason = (
            f"ledger {self.path} {what} while this process used it: granting against "
            "the old file would count this GPU twice. Restart every kvcached process "
            "of this device, and never remove a ledger file that is in use"
        )
        self.refuse(reason)
        raise LedgerReplacedError(reason)

    # -- sums (call under the data lock for an exact figure) ---------------------------------
    def charged_total(self) -> int:
        return sum(self.charges[: self.u32[H_HIGH_WATER]])

    def released_total(self) -> int:
        """Bytes released but still charged (refunds batched in their processes)."""
        return sum(self.released[: self.u32[H_HIGH_WATER]])

    def room(self, instance_slot: int) -> int:
        """The admission test: the bytes a pool of instance ``instance_slot`` may
        still be granted. The budget less every pool's charge, and no more than
        the instance's limit, if it has one, less its pools' charges. Negative
        when a calibration or a limit went below the charges.

        Exact under the data lock. Without it (a pool re-using its batch) each
        word is read once and at most a moment old, which is safe there: such a
        grant moves no charge. :meth:`PoolBudget.grant
        <kvcached.ledger.pool.PoolBudget.grant>` writes this out twice for
        speed; ``tests/ledger/test_grant_paths.py`` holds the copies to it."""
        room = self.i64[H_BUDGET] - sum(self.charges[: self.u32[H_HIGH_WATER]])
        limit = self.limits[instance_slot]
        if limit:
            return min(room, limit - self.instance_charged(instance_slot))
        return room

    def instance_charged(self, instance_slot: int) -> int:
        """The sum of the charges of instance ``instance_slot``'s pools."""
        ref = instance_slot + 1
        hw = self.u32[H_HIGH_WATER]
        return sum(
            c for c, i in zip(self.charges[:hw], self.instances[:hw], strict=True) if i == ref
        )

    @property
    def budget(self) -> int:
        return self.i64[H_BUDGET]

    @property
    def calibration_seq(self) -> int:
        return self.u64[H_SEQ]

    # -- pools (kvcached.ledger.registry) ----------------------------------------------------
    def register_pool(self, instance: str, *, calibrate: bool = False) -> PoolBudget:
        """Register a pool of ``instance`` on this device and take its owner lease.

        Retires the records of dead owners on the way. Raises
        :class:`LedgerFullError` when every pool record is held by a live pool.
        With ``calibrate`` this process' calibrator thread runs (if the ledger
        has a sampler) until the pool closes.
        """
        return self.registry.register(instance, calibrate=calibrate)

    def retire_dead(self, timeout: float = LOCK_WAIT_S) -> int:
        """Retire every pool whose owner died; returns how many. Candidates are
        found without the data lock and checked again under it (same owner
        token, lease still free) before anything is written."""
        return self.registry.retire_dead(timeout)

    def _lease(self, slot: int) -> ByteLock:
        """The owner lease of pool record ``slot``, probed through the ledger's descriptor."""
        return ByteLock(
            self.file.fd, layout.pool_offset(slot), f"owner lease {slot} of {self.path}"
        )

    def close_pool_locked(self, slot: int, token: int) -> int:
        """Retire the record of a pool of this process that is closing (under
        the data lock); returns the charge it still had."""
        if self.tokens[slot] != token:
            return 0  # already retired (a fork's child, or a finalizer after close)
        return self.registry.retire_locked(slot)

    def pool_closed(self, pool: PoolBudget, calibrated: bool) -> None:
        """Forget ``pool``, which is closed; ``calibrated``: it kept this
        process' calibrator thread running (:func:`kvcached.ledger.open_pool_budget`)."""
        self._pools.discard(pool)
        if calibrated:
            self.calibration.release_thread()

    def refresh_pools(self) -> None:
        """Refresh the cached headroom of every pool of this process."""
        for pool in list(self._pools):
            try:
                pool.refresh(CALIBRATE_LOCK_WAIT_S)
            except LedgerError as exc:  # busy or refused: the cached figure waits a tick
                log.debug("ledger %s: refreshing pool %d failed: %s", self.path, pool.slot, exc)

    # -- calibration (kvcached.ledger.calibration) -------------------------------------------
    def calibrate(self, sampler: MemInfo | None = None) -> Calibration:
        """Sample the device and publish a new budget, if no other process is calibrating.

        Checks first that the path still names this file (else
        :class:`LedgerReplacedError`); ``busy`` when another process or thread
        holds the calibrator lease, ``stale`` when a newer sample was published
        first, ``locked`` when the data lock stays held
        :data:`CALIBRATE_LOCK_WAIT_S`. The formula: :mod:`kvcached.ledger.calibration`.
        """
        return self.calibration.calibrate(sampler)

    def _publish(self, seq: int, free: int, retired: int = 0) -> Calibration:
        return self.calibration.publish(seq, free, retired)

    def calibrator(
        self, sampler: MemInfo | None = None, interval_s: float | None = None
    ) -> Calibrator:
        """A new :class:`~kvcached.ledger.calibrator.Calibrator` for this ledger
        (not started), every ``interval_s`` (default :attr:`calibration_interval_s`)."""
        return self.calibration.calibrator(sampler, interval_s)

    @property
    def _calibrator(self) -> Calibrator | None:
        """This process' shared calibrator thread, while a pool keeps it running."""
        return self.calibration.thread

    # -- limits (kvcached.ledger.limits) and snapshots (kvcached.ledger.snapshot) --------------
    def set_limit(
        self, instance: str, limit: int | None, revision: int, *, timeout: float = LOCK_WAIT_S
    ) -> LimitStatus:
        """Set ``instance``'s limit on this device (``None``/0: unlimited) at
        ``revision``: ``applied``, ``stale`` or ``conflict``, as
        :meth:`~kvcached.ledger.limits.InstanceRecords.set_limit_locked` says.
        Lowering a limit blocks new growth; it takes no page back by itself."""
        check_instance_name(instance)
        limit = check_limit_args(limit, revision)
        with self.locked(timeout):
            self.validate_locked()
            return self.instance_records.set_limit_locked(instance, limit, revision, self.device_id)

    def snapshot(self, timeout: float = LOCK_WAIT_S) -> LedgerSnapshot:
        """Everything in the file, validated, with each pool's liveness, read
        under the data lock (or, when it stays held ``timeout`` seconds, without
        it, naming the holder): :func:`~kvcached.ledger.snapshot.take_snapshot`."""
        return take_snapshot(self, timeout)

    # -- lifetime --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise LedgerError(f"ledger {self.path} is closed")

    def close(self) -> None:
        """Close every pool of this process on this ledger, then the file. Idempotent."""
        if self.closed:
            return
        self.calibration.stop_thread()
        for pool in list(self._pools):
            pool.close()
        self.closed = True
        _LIVE.discard(self)
        self.file.close()

    def _detach_in_child(self) -> None:
        """After ``fork``: drop the inherited descriptors (and with them any share of
        the parent's locks) without touching the file, and refuse further use."""
        self.data_lock.detach_in_child()
        self.calibration.detach_in_child()
        for pool in list(self._pools):
            pool._detach_in_child()
        self.closed = True
        try:
            self.file.close()
        except (OSError, BufferError) as exc:  # a view still exported, a closed fd
            log.debug("ledger %s: closing the copy inherited by fork failed: %r", self.path, exc)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Ledger {self.path}{' closed' if self.closed else ''}>"


_LIVE: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ledger in list(_LIVE):
        ledger._detach_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
