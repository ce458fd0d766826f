"""Plain records of a whole ledger at one moment, for ``kvctl`` and tests.

Totals here (``charged`` of the header and of each instance) are computed from
the pool records when the snapshot is taken; the file stores no totals.
:func:`take_snapshot` reads them (:meth:`Ledger.snapshot
<kvcached.ledger.ledger.Ledger.snapshot>`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from kvcached.errors import LedgerBusyError, LedgerError
from kvcached.ledger import layout
from kvcached.ledger.layout import Header, InstanceRecord, PoolRecord
from kvcached.ledger.validate import check_image


class LimitStatus(str, enum.Enum):
    """What became of a limit write (:meth:`Ledger.set_limit`)."""

    APPLIED = "applied"  #: written (or the same value was already there at that revision)
    STALE = "stale"  #: an older revision than the stored one: not applied
    CONFLICT = "conflict"  #: the stored revision is the same but its limit differs: not applied
    DEFERRED = "deferred"  #: used by the control layer: applied, usage above it is being released


@dataclass(frozen=True)
class HeaderView:
    path: str
    device_id: str
    layout_version: int
    total_bytes: int
    safety_margin: int
    budget: int
    calibration_seq: int
    calibration_time_ns: int
    calibration_free: int
    created_ns: int
    charged: int
    released: int  #: of ``charged``: released, refund batched in its process

    @property
    def headroom(self) -> int:
        """``budget - charged``; negative when charges exceed the last calibration."""
        return self.budget - self.charged


@dataclass(frozen=True)
class PoolView:
    slot: int
    token: int
    pid: int
    start_time: int
    instance: str
    charged: int
    registered_ns: int
    released: int  #: of ``charged``: released, refund still batched in the process
    alive: bool  #: its owner lease is held (False: a dead owner not retired yet)


@dataclass(frozen=True)
class InstanceView:
    slot: int
    name: str
    limit: int  #: 0: unlimited
    revision: int
    pid: int
    start_time: int
    created_ns: int
    limit_set_ns: int
    charged: int  #: the sum of its pools' charges on this device
    pools: int


@dataclass(frozen=True)
class LedgerSnapshot:
    header: HeaderView
    pools: tuple[PoolView, ...]
    instances: tuple[InstanceView, ...]
    #: 0: read under the data lock. Else the data lock stayed held and the file
    #: was read without it: the holder's pid as the kernel lists it (-1: not known).
    locked_by: int = 0
    lock_waited_s: float = 0.0  #: how long the reader waited before reading unlocked

    def instance(self, name: str) -> InstanceView | None:
        for inst in self.instances:
            if inst.name == name:
                return inst
        return None


def take_snapshot(ledger: Any, timeout: float) -> LedgerSnapshot:
    """Everything in ``ledger``'s file, validated, with each pool's liveness, all
    read under the data lock (so a slot cannot be retired and re-claimed
    between its record and its lease probe, ``ledger._lease(slot)``).

    When the lock is not free within ``timeout`` seconds, the file is read
    without it: the snapshot then names the holder (``locked_by``), only
    per-record checks apply, and a pool whose record changed while it was
    probed is left out. Raises :class:`~kvcached.errors.LedgerCorruptError`
    for a corrupt file (nothing is written)."""
    ledger._check_open()
    try:
        ledger._lock_data(timeout)
    except LedgerBusyError as exc:
        return _unlocked(ledger, exc)
    try:
        image = bytes(ledger.file.mm[: layout.FILE_SIZE])
        alive = {s: ledger._lease(s).held_elsewhere() for s in live_slots(image)}
    finally:
        ledger._unlock_data()
    ledger.validate_image(image)  # a consistent copy: checked outside the lock
    return snapshot_of(ledger.path, image, alive)


def _unlocked(ledger: Any, busy: LedgerBusyError) -> LedgerSnapshot:
    # A holder that is only slow (not stopped) may be halfway through a change:
    # a copy that fails the per-record checks is taken again before it counts.
    for attempt in range(3):
        image = bytes(ledger.file.mm[: layout.FILE_SIZE])
        try:
            check_image(image, ledger.path, locked=False)
            break
        except LedgerError:
            if attempt == 2:
                raise
            time.sleep(0.01)
    alive = {}
    for s in live_slots(image):
        token = PoolRecord.from_buffer_copy(image, layout.pool_offset(s)).token
        probe = ledger._lease(s).held_elsewhere()
        if ledger.tokens[s] == token:  # else retired (and maybe re-claimed) meanwhile
            alive[s] = probe
    return snapshot_of(
        ledger.path, image, alive, locked_by=busy.holder or -1, lock_waited_s=busy.waited_s
    )


def live_slots(image: bytes) -> list[int]:
    """Pool slots in use in a copy of the file (below its high-water mark)."""
    hw = Header.from_buffer_copy(image).pool_high_water
    words = memoryview(image)[layout.POOLS_OFFSET : layout.INSTANCES_OFFSET].cast("Q")
    try:
        step = layout.POOL_RECORD_SIZE // 8
        return [s for s in range(min(hw, layout.POOL_SLOTS)) if words[s * step]]
    finally:
        words.release()


def snapshot_of(
    path: str,
    image: bytes,
    alive: dict[int, bool],
    locked_by: int = 0,
    lock_waited_s: float = 0.0,
) -> LedgerSnapshot:
    """The snapshot of ``image``, a copy of the file at ``path``, showing the pools
    of ``alive`` (slot: whether its owner lease is held)."""
    inst_raw: dict[int, InstanceRecord] = {}
    for s in range(layout.INSTANCE_SLOTS):
        rec = InstanceRecord.from_buffer_copy(image, layout.instance_offset(s))
        if rec.token:
            inst_raw[s] = rec
    names = {s: rec.name.decode(errors="replace") for s, rec in inst_raw.items()}
    pools = tuple(_pool_view(image, s, is_alive, names) for s, is_alive in alive.items())
    instances = tuple(_instance_view(s, rec, names[s], pools) for s, rec in inst_raw.items())
    head = Header.from_buffer_copy(image)
    header = HeaderView(
        path=path,
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
        header, pools, instances, locked_by=locked_by, lock_waited_s=lock_waited_s
    )


def _pool_view(image: bytes, slot: int, alive: bool, names: dict[int, str]) -> PoolView:
    rec = PoolRecord.from_buffer_copy(image, layout.pool_offset(slot))
    return PoolView(
        slot=slot,
        token=rec.token,
        pid=rec.pid,
        start_time=rec.start_time,
        instance=names.get(rec.instance - 1, ""),
        charged=rec.charged,
        registered_ns=rec.registered_ns,
        released=rec.released,
        alive=alive,
    )


def _instance_view(
    slot: int, rec: InstanceRecord, name: str, pools: tuple[PoolView, ...]
) -> InstanceView:
    mine = [p for p in pools if p.instance == name]
    return InstanceView(
        slot=slot,
        name=name,
        limit=rec.limit,
        revision=rec.revision,
        pid=rec.pid,
        start_time=rec.start_time,
        created_ns=rec.created_ns,
        limit_set_ns=rec.limit_set_ns,
        charged=sum(p.charged for p in mine),
        pools=len(mine),
    )
