"""The per-GPU ledger: one mapped file that every process on a device shares.

Rules the ledger keeps (the seed PR #487's semantics; what they guarantee users,
and the tests that show it, is in docs/ledger.md):

* **Totals are sums.** The file stores each pool's charge and each instance's
  limit, never a total: the device's charges are the sum over pool records,
  an instance's the sum over its pools.
* **Grants never pass the budget, and the budget never passes the device.**
  A grant is checked and charged in one critical section under the data lock,
  so at every moment ``sum(charges) <= budget`` holds unless the last
  calibration itself published a budget below the charges (then growth simply
  stops); and no budget is ever published above ``total - safety margin``.
* **The data lock is short, and so is every wait for it.** It is a whole-file
  ``flock`` lock on the ledger file (cheaper than an OFD lock; see
  :mod:`kvcached.ledger.locks`). No driver call, no sleep and no wait on
  another lock runs under it; it covers a handful of reads and writes of the
  mapping. The kernel names its holder (``/proc/locks``). Nobody waits for it
  without a bound: a grant waits :data:`GRANT_LOCK_WAIT_S` and
  is then a miss (logged once per episode), calibration gives up after
  :data:`CALIBRATE_LOCK_WAIT_S`, registration, limits and snapshots raise
  :class:`~kvcached.errors.LedgerBusyError` naming the holder. A pool takes it
  through its own descriptor (the one that holds its lease: a description of
  its own, which flock excludes like another process's), under the pool's
  lock; the ledger's other users share the ledger's descriptor and are
  serialised by a ``threading.Lock``, since flock does not exclude its own
  holder.
* **What is read is checked.** The file is validated under the data lock when
  it is opened, at every registration and calibration and in every snapshot
  (:mod:`kvcached.ledger.validate`); a grant checks the sum it computes. A
  corrupt ledger is refused (grants become misses, nothing is written).
* **The file is the one at the path.** Registration and calibration check
  that the path still names this process' file; once it does not (unlinked or
  replaced), this process grants nothing more against it.
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
  then publish ``budget = min(total - margin, max(0, charges now - released +
  sampled free - safety margin - granted in the window))`` under it; the
  calibration sequence keeps an older sample from overwriting a newer one.
  Grants and refunds go on meanwhile. ``released`` (the seed has no such
  term) is what pools have released but not yet refunded: each owner
  publishes its batch in its record without the lock, so that memory, which
  the driver already reports as free, is not counted twice. *The window*
  (not in the seed either) opens under the data lock before the sample and
  closes at publication; every grant made while it is open adds its bytes to
  ``window_granted``. Those bytes are in "charges now" and, when they were
  materialised after the sample, still in "sampled free": subtracting them
  counts them once whatever the interleaving (growth materialised before the
  sample is then under-counted until the next calibration, which is safe).
  Publication is journaled like retirement, so budget and sequence change
  together even if the calibrator dies in between.

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
import re
import secrets
import threading
import time
import weakref

from kvcached.errors import (
    InstanceNotFoundError,
    LedgerBusyError,
    LedgerError,
    LedgerFullError,
    LedgerReplacedError,
)
from kvcached.ledger import _hooks, layout
from kvcached.ledger.calibrator import Calibration, Calibrator, MemInfo
from kvcached.ledger.file import Initial, LedgerFile, open_file
from kvcached.ledger.layout import (
    H_BUDGET,
    H_CAL_FREE,
    H_CAL_TIME,
    H_HIGH_WATER,
    H_JOURNAL,
    H_MARGIN,
    H_PUB_BUDGET,
    H_PUB_FREE,
    H_PUB_PENDING,
    H_PUB_SEQ,
    H_PUB_TIME,
    H_RETIRE_BUDGET,
    H_RETIRE_INSTANCE,
    H_RETIRE_SLOT,
    H_SEQ,
    H_TOTAL,
    H_WINDOW,
    H_WINDOW_GRANTED,
    Header,
    InstanceRecord,
    PoolRecord,
    i_limit,
    i_name,
    i_revision,
    i_token,
    p_charged,
    p_instance,
    p_pid,
    p_registered,
    p_released,
    p_start_time,
    p_token,
)
from kvcached.ledger.locks import (
    CALIBRATE_LOCK_WAIT_S,
    GRANT_LOCK_WAIT_S,
    LOCK_WAIT_S,
    ByteLock,
    flock_holder,
    process_state,
    wait_flock,
)
from kvcached.ledger.locks import EX_NB as _EX_NB
from kvcached.ledger.locks import UN as _UN
from kvcached.ledger.locks import flock as _flock
from kvcached.ledger.pool import PoolBudget
from kvcached.ledger.snapshot import (
    HeaderView,
    InstanceView,
    LedgerSnapshot,
    LimitStatus,
    PoolView,
)
from kvcached.ledger.validate import MAX_TOTAL_BYTES, check_image, corrupt
from kvcached.log import get_logger

log = get_logger("kvcached.ledger")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")


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


def _checked_sample(sampler: MemInfo, device_id: str) -> tuple[int, int]:
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


class Ledger:
    """One device's ledger file, mapped into this process.

    Share one per device in a process (:func:`kvcached.ledger.open_ledger` does);
    every thread may use it. Pools are registered with :meth:`register_pool`;
    the accounting of one pool is :class:`~kvcached.ledger.pool.PoolBudget`,
    which uses only the members :class:`~kvcached.ledger.pool.PoolLedger`
    lists (the data lock through a pool's descriptor, the busy episode,
    :meth:`room`, refusal, retiring a closing pool).
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
        self._tlock = threading.Lock()
        self._fd = lfile.fd  # the data lock is a flock lock on this descriptor
        #: Why this process grants nothing more on this file (corrupt, replaced), or None.
        self.refusal: str | None = None
        self.busy_since = 0.0  # monotonic start of a lock-busy episode (0: none)
        self._busy_misses = 0
        self._calib_lease = ByteLock(
            lfile.fd, layout.CALIBRATOR_LEASE_BYTE, f"calibrator lease of {self.path}"
        )
        self._calib_tlock = threading.Lock()
        self._pools: weakref.WeakSet[PoolBudget] = weakref.WeakSet()
        self._calibrator = None
        self._calibrator_users = 0
        self._users_lock = threading.Lock()
        self.start_time = _process_start_time()
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
        ``KVCACHED_GPU_UTILIZATION``, likewise) and is fixed in the file by its creator while
        any live process has a pool in it: a process configured differently is then
        warned and follows the file; a file no live pool uses takes this process'
        margin.
        """
        from kvcached.config import defaults

        directory = defaults().ledger_dir if directory is None else directory
        util = defaults().gpu_utilization if gpu_utilization is None else gpu_utilization
        if not isinstance(device_id, str) or not device_id:
            raise ValueError(f"device_id={device_id!r}: must be the device's PCI bus id")
        if not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_utilization={util!r}: must be in (0, 1], e.g. 0.95")

        def initial() -> Initial:
            free, total = _checked_sample(sampler, device_id)
            margin = round(total * (1.0 - util))
            return Initial(device_id, total, margin, min(max(0, free - margin), total - margin))

        ledger = cls(open_file(directory, device_id, initial), sampler)
        ledger.calibration_interval_s = calibration_interval_s
        try:
            with ledger.locked():
                ledger.validate_locked()
        except BaseException:
            ledger.close()
            raise
        _free, total = _checked_sample(sampler, device_id)
        wanted = round(total * (1.0 - util))
        if total != ledger.total_bytes:
            variable = (
                "KVCACHED_HOST_CAPACITY"
                if device_id.startswith("host-")
                else "the device's total memory (another device behind this bus id?)"
            )
            log.warning(
                "ledger %s was created for a device of %d bytes; this process sees %d. "
                "What differs is %s: use one value for every process on a device. The "
                "ledger's total and margin are kept.",
                ledger.path,
                ledger.total_bytes,
                total,
                variable,
            )
        elif wanted != ledger.safety_margin:
            try:
                was = ledger.safety_margin
                adopted = ledger._adopt_margin_if_unused(wanted)
            except BaseException:
                ledger.close()
                raise
            if adopted:
                log.info(
                    "ledger %s: no live process uses it; its safety margin is now this "
                    "process' %d bytes (KVCACHED_GPU_UTILIZATION=%s), was %d",
                    ledger.path,
                    wanted,
                    util,
                    was,
                )
            else:
                log.warning(
                    "ledger %s keeps the safety margin of %d bytes that it was created "
                    "with while other processes use it; this process' "
                    "KVCACHED_GPU_UTILIZATION=%s would give %d (total %d). Use one value "
                    "on a GPU.",
                    ledger.path,
                    ledger.safety_margin,
                    util,
                    wanted,
                    total,
                )
        return ledger

    def _adopt_margin_if_unused(self, margin: int) -> bool:
        """Give the ledger the safety margin ``margin`` if pools have used it and
        none is in use once dead owners' are retired (a file outlives its
        processes in /dev/shm, and a later run configured differently must not
        inherit a margin that no running process asked for); the budget is
        re-sampled with it. False, and nothing written, while a live pool uses
        the file or none ever has (its creator is likely about to register)."""
        self.retire_dead()
        with self.locked():
            high_water = self.u32[H_HIGH_WATER]
            if not high_water or any(self.tokens[:high_water]):
                return False
            free, total = _checked_sample(self.sampler, self.device_id)
            if total != self.i64[H_TOTAL]:
                return False
            # Each write alone leaves a valid ledger: the next calibration
            # re-derives the budget from whichever margin is in the header.
            self.i64[H_BUDGET] = min(max(0, free - margin), total - margin)
            self.i64[H_MARGIN] = margin
            self.safety_margin = margin
            return True

    @classmethod
    def open_existing(cls, path: str) -> Ledger:
        """Open the ledger file at ``path`` to read it and set limits (``kvctl``):
        never creates one, needs no driver; :meth:`calibrate` is unavailable."""
        from kvcached.ledger.file import open_path

        return cls(open_path(path), None)

    # -- the data lock ----------------------------------------------------------------
    def _lock_data(self, timeout: float = LOCK_WAIT_S) -> None:
        """Take the data lock through the ledger's descriptor within ``timeout``
        seconds, else raise :class:`LedgerBusyError` naming the holder. Its
        threads are serialised by ``_tlock`` (they share the description)."""
        tlock = self._tlock
        if not tlock.acquire(False) and not tlock.acquire(True, timeout):
            raise self.busy_error(timeout, "another thread of this process")
        try:
            self.lock_fd(self._fd, timeout)
        except BaseException:
            tlock.release()
            raise

    def _unlock_data(self) -> None:
        try:
            self.unlock_fd(self._fd)
        finally:
            self._tlock.release()

    def lock_fd(self, fd: int, timeout: float | None = None) -> None:
        """Take the data lock through ``fd``, an open file description of the
        ledger that only one thread uses at a time (a pool's own, under the
        pool's lock; or the ledger's, under ``_tlock``): flock excludes every
        other description, in this process too. Finishes a journal that a
        process killed under the lock left pending.

        Waits ``timeout`` seconds, then raises :class:`LedgerBusyError`;
        ``None`` is a grant's wait: :data:`GRANT_LOCK_WAIT_S` once, then none
        while the busy episode lasts (each grant of a stalled ledger is a
        quick miss)."""
        if timeout is None:
            timeout = 0.0 if self.busy_since else GRANT_LOCK_WAIT_S
        try:
            _flock(fd, _EX_NB)
        except BlockingIOError:
            if not wait_flock(fd, timeout):
                raise self.busy_error(timeout) from None
        self.locked_fd(fd)

    def locked_fd(self, fd: int) -> None:
        """What follows taking the data lock through ``fd`` (a pool's inline
        grant path, which takes the flock itself when :attr:`plain_lock`,
        calls it when there is a journal or a test hook)."""
        if self.u64[H_JOURNAL]:
            try:
                self._apply_journal()  # a process died halfway through a journaled change
            except BaseException:
                self.unlock_fd(fd)
                raise
        if _hooks.point is not None:
            _hooks.point("data-locked")

    def unlock_fd(self, fd: int) -> None:
        if _hooks.point is not None:
            _hooks.point("data-unlocking")
        _flock(fd, _UN)

    @contextlib.contextmanager
    def locked(self, timeout: float = LOCK_WAIT_S):
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
        pid = flock_holder(self._fd)
        return pid, process_state(pid) if pid > 0 else "unknown"

    def busy_error(self, waited: float, who: str | None = None) -> LedgerBusyError:
        """The error for a data lock not free within ``waited`` seconds, naming
        its holder (``who``, else as the kernel lists it)."""
        pid, state = self.lock_holder() if who is None else (0, who)
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

    def note_busy(self, exc: LedgerBusyError) -> None:
        """Count a miss caused by a busy data lock; log once per episode (which
        :attr:`busy_since` then dates)."""
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

    # -- retirement ----------------------------------------------------------------------
    def _lease(self, slot: int) -> ByteLock:
        return ByteLock(
            self.file.fd, layout.pool_offset(slot), f"owner lease {slot} of {self.path}"
        )

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
        shared = any(j != slot and self.tokens[j] and self.instances[j] == ref for j in range(hw))
        i64[H_RETIRE_BUDGET] = max(0, i64[H_BUDGET] - charge)
        u32[H_RETIRE_INSTANCE] = 0 if shared else ref
        u32[H_RETIRE_SLOT] = slot + 1
        if _hooks.point is not None:
            _hooks.point("retire-journaled")
        self._apply_retire()
        return charge

    def _apply_journal(self) -> None:
        u32 = self.u32
        slot, pending = u32[H_RETIRE_SLOT], u32[H_PUB_PENDING]
        if slot > layout.POOL_SLOTS or pending > 1:
            reason = corrupt(
                self.path, f"journal words retire_slot={slot}, publish_pending={pending}"
            )
            self.refuse(str(reason))
            raise reason
        if slot:
            self._apply_retire()
        if pending:
            self._apply_publish()

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

    def retire_dead(self, timeout: float = LOCK_WAIT_S) -> int:
        """Retire every pool whose owner died; returns how many. Candidates are
        found without the data lock and checked again under it (same owner
        token, lease still free) before anything is written."""
        self._check_open()
        candidates = self._dead_slots()
        if not candidates:
            return 0
        retired = 0
        self._lock_data(timeout)
        try:
            for slot, token in candidates:
                if self.tokens[slot] == token and not self._lease(slot).held_elsewhere():
                    charge = self._retire_locked(slot)
                    retired += 1
                    log.info(
                        "ledger %s: retired pool %d of a dead process (%d bytes charged)",
                        self.path,
                        slot,
                        charge,
                    )
        finally:
            self._unlock_data()
        return retired

    # -- registration --------------------------------------------------------------------
    def _find_instance_locked(self, name: str) -> int | None:
        encoded = name.encode()
        raw = self.file.raw
        for slot in range(layout.INSTANCE_SLOTS):
            if self.u64[i_token(slot)] and bytes(raw[i_name(slot)]).rstrip(b"\0") == encoded:
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
            free = [s for s in range(layout.INSTANCE_SLOTS) if not self._instance_in_use_locked(s)]
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
        u64[(layout.instance_offset(slot) + InstanceRecord.start_time.offset) // 8] = (
            self.start_time
        )
        u64[(layout.instance_offset(slot) + InstanceRecord.created_ns.offset) // 8] = time.time_ns()
        u64[(layout.instance_offset(slot) + InstanceRecord.limit_set_ns.offset) // 8] = 0
        encoded = name.encode()
        self.file.raw[i_name(slot)] = encoded + bytes(layout.NAME_BYTES - len(encoded))
        u64[i_token(slot)] = _new_token()  # identity last
        return slot

    def register_pool(self, instance: str, *, calibrate: bool = False) -> PoolBudget:
        """Register a pool of ``instance`` on this device and take its owner lease.

        Retires the records of dead owners on the way. Raises
        :class:`LedgerFullError` when every pool record is held by a live pool.
        With ``calibrate`` this process' calibrator thread runs (if the ledger
        has a sampler) until the pool closes.
        """
        check_instance_name(instance)
        self._check_open()
        self.check_identity()
        if self.refusal is not None:
            raise LedgerError(self.refusal)
        fd = self.file.open_again()
        try:
            self._lock_data()
            try:
                self.validate_locked()
                for slot, token in self._dead_slots():
                    if self.tokens[slot] == token:
                        charge = self._retire_locked(slot)
                        log.info(
                            "ledger %s: retired pool %d of a dead process (%d bytes)",
                            self.path,
                            slot,
                            charge,
                        )
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
                pool = self.pool_class(self, slot, fd, token, inst, instance)
            finally:
                self._unlock_data()
        except BaseException:
            os.close(fd)
            raise
        self._pools.add(pool)
        pool.refresh()
        if calibrate:
            self._acquire_calibrator()
            pool._uses_calibrator = True
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

    def close_pool_locked(self, slot: int, token: int) -> int:
        """Retire the record of a pool of this process that is closing (under
        the data lock); returns the charge it still had."""
        if self.tokens[slot] != token:
            return 0  # already retired (a fork's child, or a finalizer after close)
        return self._retire_locked(slot)

    def pool_closed(self, pool: PoolBudget, calibrated: bool) -> None:
        """Forget ``pool``, which is closed; ``calibrated``: it kept this
        process' calibrator thread running (:func:`kvcached.ledger.open_pool_budget`)."""
        self._pools.discard(pool)
        if calibrated:
            self._release_calibrator()

    # -- calibration -----------------------------------------------------------------------
    def calibrate(self, sampler: MemInfo | None = None) -> Calibration:
        """Sample the device and publish a new budget, if no other process is calibrating.

        Checks first that the path still names this file (else
        :class:`LedgerReplacedError`). Takes the calibrator lease without
        waiting (``busy`` if another process or thread holds it), retires dead
        pools, opens the sample window under the data lock, samples
        ``sampler.mem_info()`` *outside* it, then under it publishes ::

            budget = min(total - margin,
                         max(0, charges - released + free - margin - window_granted))

        unless another sample was published since this one's sequence was read
        (``stale``). ``released`` is memory whose release is confirmed but whose
        refund is still batched in its process: the driver already counts it as
        free, so it is subtracted once from the charges. ``window_granted`` is
        what was granted since the window opened: charged now, and perhaps not
        yet out of ``free``, so it is not counted twice either. A data lock
        that stays held for :data:`CALIBRATE_LOCK_WAIT_S` gives ``locked``.
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
                self.check_identity()
                try:
                    retired = self.retire_dead(CALIBRATE_LOCK_WAIT_S)
                    self._lock_data(CALIBRATE_LOCK_WAIT_S)
                except LedgerBusyError:
                    return Calibration(False, "locked")
                try:
                    seq = self.u64[H_SEQ]
                    self.i64[H_WINDOW_GRANTED] = 0
                    self.u32[H_WINDOW] = 1
                    image = bytes(self.file.mm[: layout.FILE_SIZE])
                finally:
                    self._unlock_data()
                self.validate_image(image)  # a consistent copy, checked outside the lock
                free, _total = sampler.mem_info()
                if _hooks.point is not None:
                    _hooks.point("calibrate-sampled")
                return self._publish(seq, int(free), retired)
            finally:
                self._calib_lease.release()
        finally:
            self._calib_tlock.release()

    def _publish(self, seq: int, free: int, retired: int = 0) -> Calibration:
        try:
            self._lock_data(CALIBRATE_LOCK_WAIT_S)
        except LedgerBusyError:
            return Calibration(False, "locked", retired)
        try:
            if self.u64[H_SEQ] != seq:
                return Calibration(
                    False, "stale", retired, self.i64[H_BUDGET], free, 0, self.u64[H_SEQ]
                )
            i64 = self.i64
            charged = self.charged_total()
            released = self.released_total()
            total, margin = i64[H_TOTAL], i64[H_MARGIN]
            if not 0 <= released <= charged <= total:  # the records were checked at the window
                error = corrupt(
                    self.path,
                    f"the pools charge {charged} bytes ({released} "
                    f"released) on a device of {total}",
                )
                self.refuse(str(error))
                raise error
            free = min(max(0, free), total)
            # Released but not refunded: in `free` and in `charged`. Granted in the
            # window: in `charged`, and in `free` unless created before the sample.
            # Count each once; and never more than the device can hold.
            budget = charged - released + free - margin - i64[H_WINDOW_GRANTED]
            budget = min(max(0, budget), total - margin)
            # Journaled: budget, free, time and sequence land together.
            i64[H_PUB_BUDGET] = budget
            i64[H_PUB_FREE] = free
            self.u64[H_PUB_TIME] = time.time_ns()
            self.u64[H_PUB_SEQ] = seq + 1
            self.u32[H_PUB_PENDING] = 1  # the commit
            if _hooks.point is not None:
                _hooks.point("calibrate-journaled")
            self._apply_publish()
            if _hooks.point is not None:
                _hooks.point("calibrate-published")
        finally:
            self._unlock_data()
        self.refresh_pools()
        return Calibration(True, "published", retired, budget, free, charged, seq + 1)

    def _apply_publish(self) -> None:
        """Apply the journaled publication (absolute writes: idempotent)."""
        i64, u64 = self.i64, self.u64
        i64[H_BUDGET] = i64[H_PUB_BUDGET]
        i64[H_CAL_FREE] = i64[H_PUB_FREE]
        u64[H_CAL_TIME] = u64[H_PUB_TIME]
        u64[H_SEQ] = u64[H_PUB_SEQ]
        self.u32[H_WINDOW] = 0
        i64[H_WINDOW_GRANTED] = 0
        self.u32[H_PUB_PENDING] = 0

    def refresh_pools(self) -> None:
        """Refresh the cached headroom of every pool of this process."""
        for pool in list(self._pools):
            try:
                pool.refresh(CALIBRATE_LOCK_WAIT_S)
            except LedgerError as exc:  # busy or refused: the cached figure waits a tick
                log.debug("ledger %s: refreshing pool %d failed: %s", self.path, pool.slot, exc)

    def calibrator(self, sampler: MemInfo | None = None, interval_s: float | None = None):
        """A new :class:`~kvcached.ledger.calibrator.Calibrator` for this ledger (not started)."""
        if interval_s is None:
            interval_s = self.calibration_interval_s
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
    def set_limit(
        self, instance: str, limit: int | None, revision: int, *, timeout: float = LOCK_WAIT_S
    ) -> LimitStatus:
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
        self._lock_data(timeout)
        try:
            self.validate_locked()
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
            bytes(self.file.raw[i_name(s)]).rstrip(b"\0").decode(errors="replace")
            for s in range(layout.INSTANCE_SLOTS)
            if self.u64[i_token(s)]
        ]

    # -- snapshot ------------------------------------------------------------------------------
    def snapshot(self, timeout: float = LOCK_WAIT_S) -> LedgerSnapshot:
        """Everything in the file, validated, with each pool's liveness, all
        read under the data lock (so a slot cannot be retired and re-claimed
        between its record and its lease probe).

        When the lock is not free within ``timeout`` seconds, the file is read
        without it: the snapshot then names the holder (``locked_by``), only
        per-record checks apply, and a pool whose record changed while it was
        probed is left out. Raises :class:`~kvcached.errors.LedgerCorruptError`
        for a corrupt file (nothing is written)."""
        self._check_open()
        try:
            self._lock_data(timeout)
        except LedgerBusyError as exc:
            return self._snapshot_unlocked(exc)
        try:
            image = bytes(self.file.mm[: layout.FILE_SIZE])
            alive = {s: self._lease(s).held_elsewhere() for s in _live_slots(image)}
        finally:
            self._unlock_data()
        self.validate_image(image)  # a consistent copy: checked outside the lock
        return self._snapshot_of(image, alive)

    def _snapshot_unlocked(self, busy: LedgerBusyError) -> LedgerSnapshot:
        # A holder that is only slow (not stopped) may be halfway through a change:
        # a copy that fails the per-record checks is taken again before it counts.
        for attempt in range(3):
            image = bytes(self.file.mm[: layout.FILE_SIZE])
            try:
                check_image(image, self.path, locked=False)
                break
            except LedgerError:
                if attempt == 2:
                    raise
                time.sleep(0.01)
        alive = {}
        for s in _live_slots(image):
            token = PoolRecord.from_buffer_copy(image, layout.pool_offset(s)).token
            probe = self._lease(s).held_elsewhere()
            if self.tokens[s] == token:  # else retired (and maybe re-claimed) meanwhile
                alive[s] = probe
        return self._snapshot_of(
            image, alive, locked_by=busy.holder or -1, lock_waited_s=busy.waited_s
        )

    def _snapshot_of(
        self, image: bytes, alive: dict[int, bool], locked_by: int = 0, lock_waited_s: float = 0.0
    ) -> LedgerSnapshot:
        head = Header.from_buffer_copy(image)
        inst_names: dict[int, str] = {}
        inst_raw: dict[int, InstanceRecord] = {}
        for s in range(layout.INSTANCE_SLOTS):
            rec = InstanceRecord.from_buffer_copy(image, layout.instance_offset(s))
            if rec.token:
                inst_raw[s] = rec
                inst_names[s] = rec.name.decode(errors="replace")
        pools = []
        for s, is_alive in alive.items():
            rec = PoolRecord.from_buffer_copy(image, layout.pool_offset(s))
            pools.append(
                PoolView(
                    slot=s,
                    token=rec.token,
                    pid=rec.pid,
                    start_time=rec.start_time,
                    instance=inst_names.get(rec.instance - 1, ""),
                    charged=rec.charged,
                    registered_ns=rec.registered_ns,
                    released=rec.released,
                    alive=is_alive,
                )
            )
        instances = []
        for s, rec in inst_raw.items():
            mine = [p for p in pools if p.instance == inst_names[s]]
            instances.append(
                InstanceView(
                    slot=s,
                    name=inst_names[s],
                    limit=rec.limit,
                    revision=rec.revision,
                    pid=rec.pid,
                    start_time=rec.start_time,
                    created_ns=rec.created_ns,
                    limit_set_ns=rec.limit_set_ns,
                    charged=sum(p.charged for p in mine),
                    pools=len(mine),
                )
            )
        header = HeaderView(
            path=self.path,
            device_id=head.device_id.decode(errors="replace"),
            layout_version=head.layout_version,
            total_bytes=head.total_bytes,
            safety_margin=head.safety_margin,
            budget=head.budget,
            calibration_seq=head.calibration_seq,
            calibration_time_ns=head.calibration_time_ns,
            calibration_free=head.calibration_free,
            created_ns=head.created_ns,
            charged=sum(p.charged for p in pools),
            released=sum(p.released for p in pools),
        )
        return LedgerSnapshot(
            header, tuple(pools), tuple(instances), locked_by=locked_by, lock_waited_s=lock_waited_s
        )

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


def _live_slots(image: bytes) -> list[int]:
    """Pool slots in use in a copy of the file (below its high-water mark)."""
    hw = Header.from_buffer_copy(image).pool_high_water
    words = memoryview(image)[layout.POOLS_OFFSET : layout.INSTANCES_OFFSET].cast("Q")
    try:
        step = layout.POOL_RECORD_SIZE // 8
        return [s for s in range(min(hw, layout.POOL_SLOTS)) if words[s * step]]
    finally:
        words.release()


_LIVE: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ledger in list(_LIVE):
        ledger._detach_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
