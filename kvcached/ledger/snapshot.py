"""Plain records of a whole ledger at one moment, for ``kvctl`` and tests.

Totals here (``charged`` of the header and of each instance) are computed from
the pool records when the snapshot is taken; the file stores no totals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
