"""A process SIGKILLed at each named point of the ledger's code leaves it consistent.

Each case runs a child that uses the ledger and kills itself at one hook point
(inside the data lock, between a grant's write and its return, halfway through
a retirement, between a calibration's sample and its publication, ...). The
test then checks that the data lock is free, that the dead owner is retired
exactly once, that its charge left the sum and the budget alike, and that the
ledger goes on working.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvcached.ledger import layout
from kvcached.units import GIB, MIB

from .conftest import data_lock_is_free as lock_free

CHILD = os.path.join(os.path.dirname(__file__), "crash_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET = 7 * GIB


def run_child(directory: str, action: str, point: str = "-") -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, KVCACHED_LOG_LEVEL="ERROR")
    proc = subprocess.run(
        [sys.executable, CHILD, directory, action, point],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{action}@{point}: exit {proc.returncode}, the point was not reached\n{proc.stderr}"
    )


def data_lock_is_free(ledger) -> bool:
    fd = os.open(ledger.path, os.O_RDWR)
    try:
        return lock_free(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "action,point,charge",
    [
        ("grant", "data-locked", 10 * MIB),  # killed inside the lock, before the write
        ("grant", "grant-charged", 16 * MIB),  # written, not yet returned to the caller
        ("refund", "data-locked", 100 * MIB),
        ("refund", "refund-flushed", 36 * MIB),
        ("register", "register-written", 0),
    ],
)
def test_killed_owner_is_retired_exactly(ledger, ledger_dir, action, point, charge):
    run_child(ledger_dir, action, point)
    assert data_lock_is_free(ledger)
    snap = ledger.snapshot()
    assert [(p.charged, p.alive) for p in snap.pools] == [(charge, False)]
    assert ledger.retire_dead() == 1
    snap = ledger.snapshot()
    assert snap.pools == () and snap.instances == ()
    assert snap.header.budget == BUDGET - charge
    pool = ledger.register_pool("after")
    assert pool.grant(BUDGET - charge) and not pool.grant(1)


def test_killed_before_its_identity_is_written_leaves_no_pool(ledger, ledger_dir):
    run_child(ledger_dir, "register", "register-leased")
    snap = ledger.snapshot()
    assert snap.pools == ()  # fields were written, the token was not: the slot is free
    assert [(i.name, i.pools) for i in snap.instances] == [("victim", 0)]  # an orphan
    assert snap.header.budget == BUDGET
    # the orphan instance record is reclaimed when instance records run out
    pools = [ledger.register_pool(f"i{k}") for k in range(layout.INSTANCE_SLOTS)]
    assert ledger.snapshot().instance("victim") is None
    for pool in pools:
        pool.close()


@pytest.mark.parametrize("point", ["retire-journaled", "retire-applying"])
def test_a_retirement_killed_halfway_is_finished_once(ledger, ledger_dir, point):
    run_child(ledger_dir, "hold", "-")
    run_child(ledger_dir, "retire", point)
    assert ledger.u32[layout.Header.retire_slot.offset // 4] == 1  # journal left behind
    assert data_lock_is_free(ledger)
    snap = ledger.snapshot()  # the first lock holder finished the retirement
    assert ledger.u32[layout.Header.retire_slot.offset // 4] == 0
    assert snap.pools == () and snap.instances == ()
    assert snap.header.budget == BUDGET - 10 * MIB  # subtracted once, not twice, not never
    assert ledger.retire_dead() == 0


def test_a_grant_finishes_a_retirement_killed_halfway(ledger, ledger_dir):
    """A pool's grant takes the data lock inline; it still finishes the journal."""
    pool = ledger.register_pool("survivor")
    run_child(ledger_dir, "hold", "-")
    run_child(ledger_dir, "retire", "retire-applying")
    assert ledger.u32[layout.Header.retire_slot.offset // 4] == 2  # the victim's slot 1, + 1
    assert pool.grant(2 * MIB)  # the first lock holder since the kill
    assert ledger.u32[layout.Header.retire_slot.offset // 4] == 0
    snap = ledger.snapshot()
    assert snap.header.budget == BUDGET - 10 * MIB and snap.header.charged == 2 * MIB
    pool.close()


def test_a_calibrator_killed_after_sampling_frees_the_lease(ledger, ledger_dir, device):
    run_child(ledger_dir, "calibrate", "calibrate-sampled")
    seq = ledger.calibration_seq
    device.free = 5 * GIB
    result = ledger.calibrate()
    assert result.published and result.retired == 1
    assert ledger.calibration_seq == seq + 1
    assert ledger.budget == 5 * GIB - GIB


def test_a_calibrator_killed_after_publishing(ledger, ledger_dir):
    run_child(ledger_dir, "calibrate", "calibrate-published")
    # the child published its sample: 10 MiB charged + 3 GiB free - 1 GiB margin
    assert ledger.budget == 10 * MIB + 2 * GIB
    assert ledger.calibration_seq == 2
    assert ledger.retire_dead() == 1
    assert ledger.budget == 2 * GIB


def test_a_limit_write_killed_before_its_revision(ledger, ledger_dir):
    run_child(ledger_dir, "limit", "limit-written")
    inst = ledger.snapshot().instance("victim")
    # the value landed, the revision did not: a retry at the same revision applies cleanly
    assert (inst.limit, inst.revision) == (5 * MIB, 0)


def test_a_calibrator_killed_between_budget_and_sequence_leaves_neither_half(ledger, ledger_dir):
    """Publication is journaled: killed after its commit and before it applied it,
    the calibrator leaves the old pair (budget 7 GiB, sequence 1) until the next
    holder of the data lock applies the new pair, both words together."""
    run_child(ledger_dir, "calibrate", "calibrate-journaled")
    assert (ledger.budget, ledger.calibration_seq) == (BUDGET, 1)  # nothing half-written
    assert data_lock_is_free(ledger)
    snap = ledger.snapshot()  # the first lock holder finishes the publication
    assert (snap.header.budget, snap.header.calibration_seq) == (10 * MIB + 2 * GIB, 2)
    assert ledger.retire_dead() == 1
    assert ledger.budget == 2 * GIB


class _Device:
    def __init__(self, free: int) -> None:
        self.free = free

    def mem_info(self) -> tuple[int, int]:
        return self.free, 10 * GIB


def test_a_ledger_whose_users_all_died_takes_the_next_process_margin(ledger_dir, caplog):
    """Found on the GPU: a run at KVCACHED_GPU_UTILIZATION=0.12 left its ledger
    in /dev/shm, and the next run's engines (0.95) found 0 bytes of headroom
    under the dead run's margin. A file whose pools are all dead is nobody's."""
    from kvcached.ledger import Ledger

    run_child(ledger_dir, "hold")  # created at 0.9 (margin 1 GiB), died holding 10 MiB
    with Ledger.open("fake-0", _Device(8 * GIB), directory=ledger_dir, gpu_utilization=0.5) as led:
        snap = led.snapshot()
        assert snap.pools == ()  # the dead holder was retired on the way
        assert snap.header.safety_margin == 5 * GIB
        assert led.budget == 3 * GIB  # 8 free - 5 margin, sampled anew
        assert "its safety margin is now" in caplog.text


def test_a_live_pool_keeps_its_ledger_margin(ledger_dir, caplog):
    from kvcached.ledger import Ledger

    with Ledger.open(
        "fake-0", _Device(8 * GIB), directory=ledger_dir, gpu_utilization=0.9
    ) as first:
        pool = first.register_pool("live")
        assert pool.grant(10 * MIB)
        with Ledger.open(
            "fake-0", _Device(8 * GIB), directory=ledger_dir, gpu_utilization=0.5
        ) as second:
            assert second.snapshot().header.safety_margin == GIB
            assert second.budget == 7 * GIB
            assert "keeps the safety margin of 1073741824 bytes" in caplog.text
        pool.close()
