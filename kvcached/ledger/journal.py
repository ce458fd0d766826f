"""The header journal: the ledger's two changes that take more than one write.

Retiring a pool record and publishing a calibrated budget each change several
words. Each is written here as a record in the header first, committed by one
word (``retire_slot``, ``publish_pending``: the two share the 8-byte word
:data:`~kvcached.ledger.layout.H_JOURNAL`, so one read tells whether anything
is pending), then applied by absolute writes, then cleared. A process killed
before the commit word changed nothing; one killed after it left a record
that the next holder of the data lock replays (:meth:`HeaderJournal.replay`,
run by :class:`~kvcached.ledger.datalock.DataLock` on every acquisition).
Absolute writes make a replay idempotent, so a change lands exactly once.

Every method runs under the data lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcached.ledger import _hooks, layout
from kvcached.ledger.file import LedgerFile
from kvcached.ledger.layout import (
    H_BUDGET,
    H_CAL_FREE,
    H_CAL_TIME,
    H_JOURNAL,
    H_PUB_BUDGET,
    H_PUB_FREE,
    H_PUB_PENDING,
    H_PUB_SEQ,
    H_PUB_TIME,
    H_RETIRE_BUDGET,
    H_RETIRE_INSTANCE,
    H_RETIRE_SLOT,
    H_SEQ,
    H_WINDOW,
    H_WINDOW_GRANTED,
    i_token,
    p_charged,
    p_instance,
    p_released,
    p_token,
)
from kvcached.ledger.validate import corrupt


class HeaderJournal:
    """The journal in the header of one mapped ledger file.

    ``refuse(reason)`` is called when the journal's own words are corrupt (the
    ledger then grants nothing more on the file) before the error is raised.
    Invariant: at most one retirement and one publication are pending, and
    only while a process died holding the data lock.
    """

    def __init__(self, lfile: LedgerFile, refuse: Callable[[str], None]) -> None:
        self.path = lfile.path
        self.i64, self.u32, self.u64 = lfile.i64, lfile.u32, lfile.u64
        self._refuse = refuse

    @property
    def pending(self) -> bool:
        """Whether a change was committed and not applied (a holder died)."""
        return bool(self.u64[H_JOURNAL])

    def replay(self) -> None:
        """Apply what a process killed under the data lock left committed."""
        u32 = self.u32
        slot, pending = u32[H_RETIRE_SLOT], u32[H_PUB_PENDING]
        if slot > layout.POOL_SLOTS or pending > 1:
            reason = corrupt(
                self.path, f"journal words retire_slot={slot}, publish_pending={pending}"
            )
            self._refuse(str(reason))
            raise reason
        if slot:
            self._apply_retire()
        if pending:
            self._apply_publish()

    # -- retirement --------------------------------------------------------------------------
    def retire(self, slot: int, budget_after: int, instance_ref: int) -> None:
        """Retire pool record ``slot``: the budget becomes ``budget_after``, the
        record is cleared and, when ``instance_ref`` (slot + 1) is not 0, that
        instance record is freed too. Journaled: the header records the budget
        and the instance, *then* the slot (the commit)."""
        assert not self.u32[H_RETIRE_SLOT], "invariant: one retirement at a time"
        self.i64[H_RETIRE_BUDGET] = budget_after
        self.u32[H_RETIRE_INSTANCE] = instance_ref
        self.u32[H_RETIRE_SLOT] = slot + 1
        if _hooks.point is not None:
            _hooks.point("retire-journaled")
        self._apply_retire()

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

    # -- publication of a calibrated budget --------------------------------------------------
    def publish(self, budget: int, free: int, seq: int) -> None:
        """Publish ``budget`` from a sample of ``free`` bytes as calibration
        ``seq``, closing the sample window. Journaled: budget, free, time and
        sequence land together."""
        self.i64[H_PUB_BUDGET] = budget
        self.i64[H_PUB_FREE] = free
        self.u64[H_PUB_TIME] = time.time_ns()
        self.u64[H_PUB_SEQ] = seq
        self.u32[H_PUB_PENDING] = 1  # the commit
        if _hooks.point is not None:
            _hooks.point("calibrate-journaled")
        self._apply_publish()

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
