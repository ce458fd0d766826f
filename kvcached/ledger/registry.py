"""Pool records: registration, owner leases, and retirement of the dead.

* **Liveness is a lock.** Each pool holds an OFD lock on its record's first
  byte (its owner lease) through a descriptor of its own for its whole life. A
  record whose lease can be taken belongs to a dead process; registration and
  calibration retire it, after checking again under the data lock (same owner
  token, lease still free).
* **Retiring creates no credit.** A retired record's charge leaves the sum and
  the budget alike; memory the dead process really gave back is recovered by a
  later calibration sample. Retirement is journaled in the header
  (:mod:`kvcached.ledger.journal`), so a process killed halfway leaves it to be
  finished, exactly once, by the next process that takes the data lock.
* A record's owner token is written last at registration and cleared first at
  retirement, so a half-written record never looks live.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvcached.errors import LedgerError, LedgerFullError
from kvcached.ledger import _hooks, layout
from kvcached.ledger.layout import (
    H_BUDGET,
    H_HIGH_WATER,
    p_charged,
    p_instance,
    p_pid,
    p_registered,
    p_released,
    p_start_time,
    p_token,
    p_wanted,
    p_wanted_seq,
)
from kvcached.ledger.limits import check_instance_name, new_token
from kvcached.ledger.locks import LOCK_WAIT_S, ByteLock
from kvcached.log import get_logger

if TYPE_CHECKING:
    from kvcached.ledger.pool import PoolBudget

log = get_logger("kvcached.ledger")


def process_start_time() -> int:
    """This process' start time in clock ticks since boot (``/proc/self/stat``
    field 22), written in its records beside its pid (0 when unreadable)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class PoolRegistry:
    """The pool records of one ledger, as this process registers and retires them.

    It works on its ledger (:class:`~kvcached.ledger.ledger.Ledger`): the
    mapped views, the data lock (``_lock_data`` / ``_unlock_data``), the header
    journal, the instance records and the owner-lease probe ``_lease``.
    """

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger

    def register(self, instance: str, *, calibrate: bool = False) -> PoolBudget:
        """See :meth:`kvcached.ledger.ledger.Ledger.register_pool`."""
        led = self._ledger
        check_instance_name(instance)
        led._check_open()
        led.check_identity()
        if led.refusal is not None:
            raise LedgerError(led.refusal)
        fd = led.file.open_again()
        try:
            led._lock_data()
            try:
                led.validate_locked()
                for slot, token in self.dead_slots():
                    if led.tokens[slot] == token:
                        self._log_retired(slot, self.retire_locked(slot))
                slot = self._claim_slot_locked(fd)
                pool = self._write_record_locked(slot, fd, instance)
            finally:
                led._unlock_data()
        except BaseException:
            os.close(fd)
            raise
        led._pools.add(pool)
        pool.refresh()
        if calibrate:
            led.calibration.acquire_thread()
            pool._uses_calibrator = True
        return pool

    def _write_record_locked(self, slot: int, fd: int, instance: str) -> PoolBudget:
        led = self._ledger
        inst = led.instance_records.find_locked(instance)
        if inst is None:
            inst = led.instance_records.create_locked(instance, led.start_time)
        token = new_token()
        i64, u32, u64 = led.i64, led.u32, led.u64
        i64[p_charged(slot)] = 0
        i64[p_released(slot)] = 0
        i64[p_wanted(slot)] = 0
        u64[p_wanted_seq(slot)] = 0
        led.file.i32[p_pid(slot)] = os.getpid()
        u32[p_instance(slot)] = inst + 1
        u64[p_start_time(slot)] = led.start_time
        u64[p_registered(slot)] = time.time_ns()
        if u32[H_HIGH_WATER] <= slot:
            u32[H_HIGH_WATER] = slot + 1
        if _hooks.point is not None:
            _hooks.point("register-leased")
        u64[p_token(slot)] = token  # identity last
        if _hooks.point is not None:
            _hooks.point("register-written")
        return led.pool_class(led, slot, fd, token, inst, instance)

    def _claim_slot_locked(self, fd: int) -> int:
        led = self._ledger
        for slot in range(layout.POOL_SLOTS):
            if led.tokens[slot]:
                continue
            lease = ByteLock(fd, layout.pool_offset(slot), f"owner lease {slot} of {led.path}")
            if lease.acquire(wait=False):  # held: a pool is closing there right now
                return slot
        raise LedgerFullError(
            f"{led.path}: all {layout.POOL_SLOTS} pool records are held by live processes"
        )

    # -- retirement --------------------------------------------------------------------------
    def retire_locked(self, slot: int) -> int:
        """Retire pool record ``slot`` (in use, owner dead or closing), through
        the journal; returns the charge retired. Its instance record is freed
        with it when no other pool in use refers to it."""
        led = self._ledger
        assert led.tokens[slot], f"invariant: retiring pool slot {slot} which is not in use"
        i64, u32 = led.i64, led.u32
        charge = i64[p_charged(slot)]
        ref = u32[p_instance(slot)]
        hw = u32[H_HIGH_WATER]
        tokens, refs = led.tokens, led.instances
        shared = any(j != slot and tokens[j] and refs[j] == ref for j in range(hw))
        led.journal.retire(slot, max(0, i64[H_BUDGET] - charge), 0 if shared else ref)
        return charge

    def dead_slots(self) -> list[tuple[int, int]]:
        """``(slot, token)`` of records in use whose owner lease is free (not locked)."""
        led = self._ledger
        dead = []
        for slot in range(led.u32[H_HIGH_WATER]):
            token = led.tokens[slot]
            if token and not led._lease(slot).held_elsewhere():
                dead.append((slot, token))
        return dead

    def retire_dead(self, timeout: float = LOCK_WAIT_S) -> int:
        """See :meth:`kvcached.ledger.ledger.Ledger.retire_dead`."""
        led = self._ledger
        led._check_open()
        candidates = self.dead_slots()
        if not candidates:
            return 0
        retired = 0
        led._lock_data(timeout)
        try:
            for slot, token in candidates:
                if led.tokens[slot] == token and not led._lease(slot).held_elsewhere():
                    self._log_retired(slot, self.retire_locked(slot))
                    retired += 1
        finally:
            led._unlock_data()
        return retired

    def _log_retired(self, slot: int, charge: int) -> None:
        log.info(
            "ledger %s: retired pool %d of a dead process (%d bytes charged)",
            self._ledger.path,
            slot,
            charge,
        )
