"""The per-GPU ledger: one mapped file that every process on a device shares.

Rules the ledger keeps (the seed PR #487's semantics, see DESIGN.md):

* **Totals are sums.** The file stores each pool's charge and each instance's
  limit, never a total: the device's charges are the sum over pool records,
  an instance's the sum over its pools.
* **Grants never pass the budget.** A grant is checked and charged in one
  critical section under the data lock (an OFD lock on byte 0), so at every
  moment ``sum(charges) <= budget`` holds unless the last calibration itself
  published a budget below the charges (then growth simply stops).
* **The data lock is short.** No driver call, no sleep and no wait on another
  lock runs under it; it covers a handful of reads and writes of the mapping.
  Threads of one process are serialised on it by a ``threading.Lock`` because
  they share one descriptor, and an OFD lock does not exclude its own holder.
* **Liveness is a lock.** Each pool holds an OFD lock on its record's first
  byte (its owner lease) through a descriptor of its own for its whole life. A
  record whose lease can be taken belongs to a dead process; registration and
  calibration retire it, after checking again under the data lock.
* **Retiring creates no credit.** A retired record's charge leaves the sum and
  the budget alike; memory the dead process really gave back is recovered by a
  later calibration sample. Retirement is journaled in the header, so a process
  killed halfway leaves it to be finished, exactly once, by the next process
  that takes the data lock.
* **Calibration is coordinated only among calibrators.** A non-blocking lease
  (byte 1) lets one process at a time sample the driver, outside the data lock,
  then publish ``budget = max(0, charges now - released + sampled free -
  safety margin)`` under it; the calibration sequence keeps an older sample
  from overwriting a newer one. Grants and refunds go on meanwhile.
  ``released`` (the seed has no such term) is what pools have released but
  not yet refunded: each owner publishes its batch in its record without the
  lock, so that memory, which the driver already reports as free, is not
  counted twice.

The budget is an estimate (the seed's list of error sources applies: grants
not yet materialised, a refund or re-use between its driver call and its
ledger write, the delay between sample and publication, allocations outside
kvcached); the safety margin absorbs it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvcached.errors import InstanceNotFoundError, LedgerError, LedgerFullError
from kvcached.ledger import _hooks, layout
from kvcached.ledger.file import Initial, LedgerFile, open_file
from kvcached.ledger.layout import Header, InstanceRecord, PoolRecord
from kvcached.ledger.locks import ByteLock
from kvcached.ledger.snapshot import (
    HeaderView,
    InstanceView,
    LedgerSnapshot,
    LimitStatus,
    PoolView,
)
from kvcached.log import get_logger

if TYPE_CHECKING:
    from kvcached.ledger.pool import PoolBudget

log = get_logger("kvcached.ledger")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")

# Word indices into the file's typed views (see kvcached.ledger.file.LedgerFile).
H_MARGIN = Header.safety_margin.offset // 8
H_BUDGET = Header.budget.offset // 8
H_SEQ = Header.calibration_seq.offset // 8
H_CAL_TIME = Header.calibration_time_ns.offset // 8
H_CAL_FREE = Header.calibration_free.offset // 8
H_HIGH_WATER = Header.pool_high_water.offset // 4
H_RETIRE_INSTANCE = Header.retire_instance.offset // 4
H_RETIRE_BUDGET = Header.retire_budget.offset // 8
H_RETIRE_SLOT = Header.retire_slot.offset // 4


def p_token(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.token.offset) // 8


def p_charged(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.charged.offset) // 8


def p_released(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.released.offset) // 8


def p_pid(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.pid.offset) // 4


def p_instance(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.instance.offset) // 4


def p_start_time(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.start_time.offset) // 8


def p_registered(slot: int) -> int:
    return (layout.pool_offset(slot) + PoolRecord.registered_ns.offset) // 8


def i_token(slot: int) -> int:
    return (layout.instance_offset(slot) + InstanceRecord.token.offset) // 8


def i_limit(slot: int) -> int:
    return (layout.instance_offset(slot) + InstanceRecord.limit.offset) // 8


def i_revision(slot: int) -> int:
    return (layout.instance_offset(slot) + InstanceRecord.revision.offset) // 8


def _i_name(slot: int) -> slice:
    start = layout.instance_offset(slot) + InstanceRecord.name.offset
    return slice(start, start + layout.NAME_BYTES)


class MemInfo(Protocol):
    """Anything that reports a device's free memory: every :class:`~kvcached.driver.Driver`."""

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes."""
        ...


def check_instance_name(name: object) -> str:
    """``name`` if it is a valid instance name (``KVCACHED_IPC_NAME`` rules), else raise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"instance name {name!r} is not valid: 1 to 48 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (see KVCACHED_IPC_NAME)"
        )
    return name


def _process_start_time() -> int:
    """This process' start time in clock ticks since boot (``/proc/self/stat`` field 22)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _new_token() -> int:
    return secrets.randbits(63) | 1


@dataclass(frozen=True)
class Calibration:
    """What one :meth:`Ledger.calibrate` call did."""

    published: bool
    reason: str  #: "published", "busy" (another calibrator holds the lease) or "stale"
    retired: int = 0
    budget: int = 0
    free: int = 0
    charged: int = 0
    seq: int = 0


class Ledger:
    """One device's ledger file, mapped into this process.

    Share one per device in a process (:func:`kvcached.ledger.open_ledger` does);
    every thread may use it. Pools are registered with :meth:`register_pool`;
    the accounting of one pool is :class:`~kvcached.ledger.pool.PoolBudget`.
    """

    def __init__(self, lfile: LedgerFile, sampler: MemInfo | None = None) -> None:
        self.file = lfile
        self.path = lfile.path
        self.sampler = sampler
        head = lfile.header()
        self.device_id = head.device_id.decode(errors="replace")
        self.total_bytes = head.total_bytes
        self.safety_margin = head.safety_margin
        self._tlock = threading.Lock()
        self._data = ByteLock(lfile.fd, layout.DATA_LOCK_BYTE, f"data lock of {self.path}")
        self._calib_lease = ByteLock(lfile.fd, layout.CALIBRATOR_LEASE_BYTE,
                                     f"calibrator lease of {self.path}")
        self._calib_tlock = threading.Lock()
        self._pools: weakref.WeakSet[PoolBudget] = weakref.WeakSet()
        self._calibrator = None
        self._calibrator_users = 0
        self._users_lock = threading.Lock()
        self.start_time = _process_start_time()
        # Hot-path views: every pool's charge, instance and token, by slot.
        i64, u32, u64 = lfile.i64, lfile.u32, lfile.u64
        self.i64, self.u32, self.u64 = i64, u32, u64
        n = layout.POOL_SLOTS
        self.charges = lfile.view(i64[p_charged(0) : p_charged(0) + 8 * n : 8])
        self.instances = lfile.view(u32[p_instance(0) : p_instance(0) + 16 * n : 16])
        self.tokens = lfile.view(u64[p_token(0) : p_token(0) + 8 * n : 8])
        self.released = lfile.view(i64[p_released(0) : p_released(0) + 8 * n : 8])
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
    ) -> Ledger:
        """Open the ledger of ``device_id`` (a PCI bus id; ``host-N`` for the host
        backend) in ``directory`` (default ``KVCACHED_LEDGER_DIR``), creating it
        when missing from a sample of ``sampler.mem_info()``.

        The safety margin is ``total x (1 - gpu_utilization)`` (default
        ``KVCACHED_GPU_UTILIZATION``) and is fixed in the file by its creator; a
        process configured differently is warned and follows the file.
        """
        from kvcached.config import get_config

        config = get_config()
        directory = config.ledger_dir if directory is None else directory
        util = config.gpu_utilization if gpu_utilization is None else gpu_utilization
        if not isinstance(device_id, str) or not device_id:
            raise ValueError(f"device_id={device_id!r}: must be the device's PCI bus id")
        if not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_utilization={util!r}: must be in (0, 1], e.g. 0.95")

        def initial() -> Initial:
            free, total = sampler.mem_info()
            margin = round(total * (1.0 - util))
            return Initial(device_id, total, margin, max(0, free - margin))

        ledger = cls(open_file(directory, device_id, initial), sampler)
        free, total = sampler.mem_info()
        wanted = round(total * (1.0 - util))
        if wanted != ledger.safety_margin:
            log.warning(
                "ledger %s keeps its creator's safety margin of %d bytes; this process' "
                "KVCACHED_GPU_UTILIZATION=%s would give %d (total %d). Use one value on a GPU.",
                ledger.path, ledger.safety_margin, util, wanted, total,
            )
        return ledger

    @classmethod
    def open_existing(cls, path: str) -> Ledger:
        """Open the ledger file at ``path`` to read it and set limits (``kvctl``):
        never creates one, needs no driver; :meth:`calibrate` is unavailable."""
        from kvcached.ledger.file import open_path

        return cls(open_path(path), None)

    # -- the data lock ----------------------------------------------------------------
    def _lock_data(self) -> None:
        self._tlock.acquire()
        try:
            self._data.acquire()
        except BaseException:
            self._tlock.release()
            raise
        if self.u32[H_RETIRE_SLOT]:
            self._apply_retire()  # a process died halfway through a retirement
        if _hooks.point is not None:
            _hooks.point("data-locked")

    def _unlock_data(self) -> None:
        if _hooks.point is not None:
            _hooks.point("data-unlocking")
        try:
            self._data.release()
        finally:
            self._tlock.release()

    @contextlib.contextmanager
    def locked(self):
        """The data lock as a context manager (not for the hot path)."""
        self._check_open()
        self._lock_data()
        try:
            yield self
        finally:
            self._unlock_data()

    # -- sums (call under the data lock for an exact figure) ---------------------------------
    def charged_total(self) -> int:
        return sum(self.charges[: self.u32[H_HIGH_WATER]])

    def released_total(self) -> int:
        """Bytes released but still charged (refunds batched in their processes)."""
        return sum(self.released[: self.u32[H_HIGH_WATER]])

    def instance_charged(self, instance_slot: int) -> int:
        ref = instance_slot + 1
        hw = self.u32[H_HIGH_WATER]
        return sum(c for c, i in zip(self.charges[:hw], self.instances[:hw], strict=True) if i == ref)

    @property
    def budget(self) -> int:
        return self.i64[H_BUDGET]

    @property
    def calibration_seq(self) -> int:
        return self.u64[H_SEQ]

    # -- retirement ----------------------------------------------------------------------
    def _lease(self, slot: int) -> ByteLock:
        return ByteLock(self.file.fd, layout.pool_offset(slot), f"owner lease {slot} of {self.path}")

    def _retire_locked(self, slot: int) -> int:
        """Retire pool record ``slot`` (in use, owner dead or closing). Under the data lock.

        Journaled: the header records the slot, the instance to free and the
        budget after, *then* the slot marker (the commit); :meth:`_apply_retire`
        does the writes and clears the marker. A crash before the marker changes
        nothing; after it, the next holder of the data lock redoes the writes,
        which are absolute and so idempotent. Returns the charge retired.
        """
        i64, u32 = self.i64, self.u32
        assert not u32[H_RETIRE_SLOT], "invariant: one retirement at a time, under the data lock"
        assert self.tokens[slot], f"invariant: retiring pool slot {slot} which is not in use"
        charge = i64[p_charged(slot)]
        ref = u32[p_instance(slot)]
        hw = u32[H_HIGH_WATER]
        shared = any(
            j != slot and self.tokens[j] and self.instances[j] == ref for j in range(hw)
        )
        i64[H_RETIRE_BUDGET] = max(0, i64[H_BUDGET] - charge)
        u32[H_RETIRE_INSTANCE] = 0 if shared else ref
        u32[H_RETIRE_SLOT] = slot + 1
        if _hooks.point is not None:
            _hooks.point("retire-journaled")
        self._apply_retire()
        return charge

    def _apply_retire(self) -> None:
        i64, u32 = self.i64, self.u32
        slot = u32[H_RETIRE_SLOT] - 1
        i64[H_BUDGET] = i64[H_RETIRE_BUDGET]
        self.u64[p_token(slot)] = 0  # identity first: the record stops looking live
        if _hooks.point is not None:
            _hooks.point("retire-applying")
        i64[p_charged(slot)] = 0
        i64[p_released(slot)] = 0
        u32[p_instance(slot)] = 0
        ref = u32[H_RETIRE_INSTANCE]
        if ref:
            self.u64[i_token(ref - 1)] = 0
        u32[H_RETIRE_INSTANCE] = 0
        u32[H_RETIRE_SLOT] = 0

    def _dead_slots(self) -> list[tuple[int, int]]:
        """``(slot, token)`` of records in use whose owner lease is free (not locked)."""
        dead = []
        for slot in range(self.u32[H_HIGH_WATER]):
            token = self.tokens[slot]
            if token and not self._lease(slot).held_elsewhere():
                dead.append((slot, token))
        return dead

    def retire_dead(self) -> int:
        """Retire every pool whose owner died; returns how many. Candidates are
        found without the data lock and checked again under it (same owner
        token, lease still free) before anything is written."""
        self._check_open()
        candidates = self._dead_slots()
        if not candidates:
            return 0
        retired = 0
        self._lock_data()
        try:
            for slot, token in candidates:
                if self.tokens[slot] == token and not self._lease(slot).held_elsewhere():
                    charge = self._retire_locked(slot)
                    retired += 1
                    log.info("ledger %s: retired pool %d of a dead process (%d bytes charged)",
                             self.path, slot, charge)
        finally:
            self._unlock_data()
        return retired

    # -- registration --------------------------------------------------------------------
    def _find_instance_locked(self, name: str) -> int | None:
        encoded = name.encode()
        raw = self.file.raw
        for slot in range(layout.INSTANCE_SLOTS):
            if self.u64[i_token(slot)] and bytes(raw[_i_name(slot)]).rstrip(b"\0") == encoded:
                return slot
        return None

    def _instance_in_use_locked(self, slot: int) -> bool:
        ref = slot + 1
        hw = self.u32[H_HIGH_WATER]
        return any(self.tokens[j] and self.instances[j] == ref for j in range(hw))

    def _create_instance_locked(self, name: str) -> int:
        free = [s for s in range(layout.INSTANCE_SLOTS) if not self.u64[i_token(s)]]
        if not free:
            # An instance record no pool refers to was left by a process that died
            # between creating it and writing its pool: reclaim those.
            free = [s for s in range(layout.INSTANCE_SLOTS)
                    if not self._instance_in_use_locked(s)]
            for s in free:
                self.u64[i_token(s)] = 0
        if not free:
            raise LedgerFullError(
                f"{self.path}: all {layout.INSTANCE_SLOTS} instance records are in use by live "
                "pools; stop an instance on this device or use fewer KVCACHED_IPC_NAMEs"
            )
        slot = free[0]
        i64, u64 = self.i64, self.u64
        i64[i_limit(slot)] = 0
        u64[i_revision(slot)] = 0
        self.file.i32[(layout.instance_offset(slot) + InstanceRecord.pid.offset) // 4] = os.getpid()
        u64[(layout.instance_offset(slot) + InstanceRecord.start_time.offset) // 8] = self.start_time
        u64[(layout.instance_offset(slot) + InstanceRecord.created_ns.offset) // 8] = time.time_ns()
        u64[(layout.instance_offset(slot) + InstanceRecord.limit_set_ns.offset) // 8] = 0
        encoded = name.encode()
        self.file.raw[_i_name(slot)] = encoded + bytes(layout.NAME_BYTES - len(encoded))
        u64[i_token(slot)] = _new_token()  # identity last
        return slot

    def register_pool(self, instance: str) -> PoolBudget:
        """Register a pool of ``instance`` on this device and take its owner lease.

        Retires the records of dead owners on the way. Raises
        :class:`LedgerFullError` when every pool record is held by a live pool.
        """
        from kvcached.ledger.pool import PoolBudget

        check_instance_name(instance)
        self._check_open()
        fd = self.file.open_again()
        try:
            self._lock_data()
            try:
                for slot, token in self._dead_slots():
                    if self.tokens[slot] == token:
                        charge = self._retire_locked(slot)
                        log.info("ledger %s: retired pool %d of a dead process (%d bytes)",
                                 self.path, slot, charge)
                slot = self._claim_slot_locked(fd)
                inst = self._find_instance_locked(instance)
                if inst is None:
                    inst = self._create_instance_locked(instance)
                token = _new_token()
                self.i64[p_charged(slot)] = 0
                self.i64[p_released(slot)] = 0
                self.file.i32[p_pid(slot)] = os.getpid()
                self.u32[p_instance(slot)] = inst + 1
                self.u64[p_start_time(slot)] = self.start_time
                self.u64[p_registered(slot)] = time.time_ns()
                if self.u32[H_HIGH_WATER] <= slot:
                    self.u32[H_HIGH_WATER] = slot + 1
                if _hooks.point is not None:
                    _hooks.point("register-leased")
                self.u64[p_token(slot)] = token  # identity last
                if _hooks.point is not None:
                    _hooks.point("register-written")
                pool = PoolBudget(self, slot, fd, token, inst, instance)
            finally:
                self._unlock_data()
        except BaseException:
            os.close(fd)
            raise
        self._pools.add(pool)
        pool.refresh()
        return pool

    def _claim_slot_locked(self, fd: int) -> int:
        for slot in range(layout.POOL_SLOTS):
            if self.tokens[slot]:
                continue
            lease = ByteLock(fd, layout.pool_offset(slot), f"owner lease {slot} of {self.path}")
            if lease.acquire(wait=False):  # held: a pool is closing there right now
                return slot
        raise LedgerFullError(
            f"{self.path}: all {layout.POOL_SLOTS} pool records are held by live processes"
        )

    def _close_pool_locked(self, slot: int, token: int) -> int:
        """Retire the record of a pool of this process that is closing."""
        if self.tokens[slot] != token:
            return 0  # already retired (a fork's child, or a finalizer after close)
        return self._retire_locked(slot)

    # -- calibration -----------------------------------------------------------------------
    def calibrate(self, sampler: MemInfo | None = None) -> Calibration:
        """Sample the device and publish a new budget, if no other process is calibrating.

        Takes the calibrator lease without waiting (``busy`` if another process
        or thread holds it), retires dead pools, samples ``sampler.mem_info()``
        *outside* the data lock, then under it publishes
        ``budget = max(0, sum(charges) - sum(released) + free - safety_margin)``
        unless another sample was published since this one's sequence was read
        (``stale``). ``released`` is memory whose release is confirmed but whose
        refund is still batched in its process: the driver already counts it as
        free, so it is subtracted once from the charges.
        """
        self._check_open()
        sampler = sampler or self.sampler
        if sampler is None:
            raise ValueError("calibrate(): no sampler; pass the device's driver")
        if not self._calib_tlock.acquire(blocking=False):
            return Calibration(False, "busy")
        try:
            if not self._calib_lease.acquire(wait=False):
                return Calibration(False, "busy")
            try:
                retired = self.retire_dead()
                seq = self.u64[H_SEQ]
                free, _total = sampler.mem_info()
                if _hooks.point is not None:
                    _hooks.point("calibrate-sampled")
                return self._publish(seq, int(free), retired)
            finally:
                self._calib_lease.release()
        finally:
            self._calib_tlock.release()

    def _publish(self, seq: int, free: int, retired: int = 0) -> Calibration:
        self._lock_data()
        try:
            if self.u64[H_SEQ] != seq:
                return Calibration(False, "stale", retired, self.i64[H_BUDGET], free, 0,
                                   self.u64[H_SEQ])
            charged = self.charged_total()
            # Memory released but not yet refunded is in `free` and in `charged`:
            # count it once.
            budget = max(0, charged - self.released_total() + free - self.i64[H_MARGIN])
            self.i64[H_BUDGET] = budget
            self.i64[H_CAL_FREE] = free
            self.u64[H_CAL_TIME] = time.time_ns()
            self.u64[H_SEQ] = seq + 1
            if _hooks.point is not None:
                _hooks.point("calibrate-published")
        finally:
            self._unlock_data()
        self.refresh_pools()
        return Calibration(True, "published", retired, budget, free, charged, seq + 1)

    def refresh_pools(self) -> None:
        """Refresh the cached headroom of every pool of this process."""
        for pool in list(self._pools):
            with contextlib.suppress(LedgerError):
                pool.refresh()

    def calibrator(self, sampler: MemInfo | None = None, interval_s: float | None = None):
        """A new :class:`~kvcached.ledger.calibrator.Calibrator` for this ledger (not started)."""
        from kvcached.ledger.calibrator import Calibrator

        return Calibrator(self, sampler or self.sampler, interval_s)

    def _acquire_calibrator(self) -> None:
        """Start this process' shared calibrator thread if it is not running (refcounted)."""
        with self._users_lock:
            self._calibrator_users += 1
            if self._calibrator is None and self.sampler is not None:
                self._calibrator = self.calibrator()
                self._calibrator.start()

    def _release_calibrator(self) -> None:
        with self._users_lock:
            self._calibrator_users -= 1
            if self._calibrator_users <= 0 and self._calibrator is not None:
                calibrator, self._calibrator = self._calibrator, None
                calibrator.stop()

    # -- limits ------------------------------------------------------------------------------
    def set_limit(self, instance: str, limit: int | None, revision: int) -> LimitStatus:
        """Set ``instance``'s limit on this device (``None``/0: unlimited) at ``revision``.

        ``revision`` above the stored one: applied. Equal to it: applied if the
        limit is the same (a retry), else a ``conflict`` (another writer used that
        revision for another value). Below it: ``stale``. Only ``applied`` writes.
        Lowering a limit blocks new growth; it takes no page back by itself.
        Raises :class:`InstanceNotFoundError` when no pool of ``instance`` is
        registered on this device.
        """
        check_instance_name(instance)
        limit = 0 if limit is None else limit
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit={limit!r}: must be a byte count >= 0 (0 or None: unlimited)")
        if not isinstance(revision, int) or not 0 < revision < 1 << 64:
            raise ValueError(f"revision={revision!r}: must be an int >= 1 (below 2**64)")
        self._check_open()
        self._lock_data()
        try:
            slot = self._find_instance_locked(instance)
            if slot is None:
                names = self._instance_names_locked()
                raise InstanceNotFoundError(
                    f"no kvcached instance named {instance!r} has a pool on {self.device_id} "
                    f"(ledger {self.path}); instances there: {names or 'none'}"
                )
            stored = self.u64[i_revision(slot)]
            if revision < stored:
                return LimitStatus.STALE
            if revision == stored:
                same = self.i64[i_limit(slot)] == limit
                return LimitStatus.APPLIED if same else LimitStatus.CONFLICT
            self.i64[i_limit(slot)] = limit
            self.u64[(layout.instance_offset(slot) + InstanceRecord.limit_set_ns.offset) // 8] = (
                time.time_ns()
            )
            if _hooks.point is not None:
                _hooks.point("limit-written")
            self.u64[i_revision(slot)] = revision  # last: a torn write reads as the old revision
            return LimitStatus.APPLIED
        finally:
            self._unlock_data()

    def _instance_names_locked(self) -> list[str]:
        return [
            bytes(self.file.raw[_i_name(s)]).rstrip(b"\0").decode(errors="replace")
            for s in range(layout.INSTANCE_SLOTS)
            if self.u64[i_token(s)]
        ]

    # -- snapshot ------------------------------------------------------------------------------
    def snapshot(self) -> LedgerSnapshot:
        """Everything in the file, copied under the data lock; liveness is probed after."""
        self._check_open()
        self._lock_data()
        try:
            image = bytes(self.file.mm[: layout.FILE_SIZE])
        finally:
            self._unlock_data()
        head = Header.from_buffer_copy(image)
        inst_names: dict[int, str] = {}
        inst_raw: dict[int, InstanceRecord] = {}
        for s in range(layout.INSTANCE_SLOTS):
            rec = InstanceRecord.from_buffer_copy(image, layout.instance_offset(s))
            if rec.token:
                inst_raw[s] = rec
                inst_names[s] = rec.name.decode(errors="replace")
        pools = []
        for s in range(head.pool_high_water):
            rec = PoolRecord.from_buffer_copy(image, layout.pool_offset(s))
            if not rec.token:
                continue
            pools.append(PoolView(
                slot=s, token=rec.token, pid=rec.pid, start_time=rec.start_time,
                instance=inst_names.get(rec.instance - 1, ""), charged=rec.charged,
                registered_ns=rec.registered_ns, released=rec.released,
                alive=self._lease(s).held_elsewhere(),
            ))
        instances = []
        for s, rec in inst_raw.items():
            mine = [p for p in pools if p.instance == inst_names[s]]
            instances.append(InstanceView(
                slot=s, name=inst_names[s], limit=rec.limit, revision=rec.revision,
                pid=rec.pid, start_time=rec.start_time, created_ns=rec.created_ns,
                limit_set_ns=rec.limit_set_ns, charged=sum(p.charged for p in mine),
                pools=len(mine),
            ))
        header = HeaderView(
            path=self.path, device_id=head.device_id.decode(errors="replace"),
            layout_version=head.layout_version, total_bytes=head.total_bytes,
            safety_margin=head.safety_margin, budget=head.budget,
            calibration_seq=head.calibration_seq, calibration_time_ns=head.calibration_time_ns,
            calibration_free=head.calibration_free, created_ns=head.created_ns,
            charged=sum(p.charged for p in pools), released=sum(p.released for p in pools),
        )
        return LedgerSnapshot(header, tuple(pools), tuple(instances))

    # -- lifetime --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise LedgerError(f"ledger {self.path} is closed")

    def close(self) -> None:
        """Close every pool of this process on this ledger, then the file. Idempotent."""
        if self.closed:
            return
        if self._calibrator is not None:
            self._calibrator.stop()
            self._calibrator = None
        for pool in list(self._pools):
            pool.close()
        self.closed = True
        _LIVE.discard(self)
        self.file.close()

    def _detach_in_child(self) -> None:
        """After ``fork``: drop the inherited descriptors (and with them any share of
        the parent's locks) without touching the file, and refuse further use."""
        self._tlock = threading.Lock()
        self._calib_tlock = threading.Lock()
        self._users_lock = threading.Lock()
        self._calibrator = None
        for pool in list(self._pools):
            pool._detach_in_child()
        self.closed = True
        with contextlib.suppress(Exception):
            self.file.close()

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
