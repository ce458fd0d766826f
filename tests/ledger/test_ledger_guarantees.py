"""What the ledger promises whatever the timing, shown with real processes.

* Growth inside a calibration's sample window is counted once: the next
  grant that would pass the device is refused (issue #14, point 1).
* A snapshot never shows a retired and re-claimed slot alive with the dead
  owner's charge (point 3).
* A process stopped inside the data lock stalls nobody for long: grants are
  misses after a bounded wait, ``kvctl`` answers within ``--timeout`` and names
  the holder (point 4).
* A ledger whose records are garbage is refused, by kvctl and by a new
  process, and left untouched (point 5).
* A ledger file unlinked in use is detected at calibration and registration,
  and no grant is made against it afterwards (point 6).
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time

import pytest

from kvcached.errors import LedgerCorruptError, LedgerError, LedgerReplacedError
from kvcached.ledger import Ledger, _hooks, layout
from kvcached.ledger.layout import PoolRecord
from kvcached.units import GIB, MIB

from .conftest import data_lock_is_free, file_bytes

CHILD = os.path.join(os.path.dirname(__file__), "guarantee_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVCTL = [sys.executable, "-m", "kvcached.cli.kvctl"]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, KVCACHED_LOG_LEVEL="WARNING")


class Child:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, *args],
            env=env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self, timeout: float) -> str | None:
        """The child's next line, or None if it says nothing within ``timeout``."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
        line = self.proc.stdout.readline().strip()
        if not line and self.proc.poll() is not None:
            raise AssertionError(f"child exited {self.proc.returncode}: {self.proc.stderr.read()}")
        return line

    def state(self) -> str:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- 1: growth during the sample window ------------------------------------------------------
@pytest.mark.slow
def test_growth_inside_the_sample_window_is_not_counted_twice(ledger_dir):
    """On a 128 MiB host device (margin 12.8 MiB), 50 MiB used outside kvcached:
    a calibration samples 78 MiB free, then (before it publishes) another
    process grants and creates 50 MiB. Counting that growth as both charged and
    free would publish 115.2 MiB and grant a further 50 MiB (150 MiB on 128);
    the window subtracts it: 65.2 MiB, so 50 MiB more is refused, 15 MiB is not."""
    from kvcached.driver.host import HostDriver

    index = random.randrange(60_000, 90_000)
    capacity = 128 * MIB
    driver = HostDriver(index, capacity)
    other = driver.create(50 * MIB)  # memory taken by something that is not kvcached
    ledger = Ledger.open(f"host-{index}", driver, directory=ledger_dir, gpu_utilization=0.9)
    margin = ledger.safety_margin
    grower: list[Child] = []

    def grow_in_window(name: str) -> None:
        if name == "calibrate-sampled":
            _hooks.point = None
            child = Child("grow", ledger_dir, str(index), str(capacity), str(50 * MIB))
            grower.append(child)
            assert child.line(120) == "grown"

    try:
        _hooks.point = grow_in_window
        result = ledger.calibrate(driver)
        assert result.published and grower
        assert result.free == capacity - 50 * MIB  # sampled before the growth
        assert driver.mem_info()[0] == capacity - 100 * MIB  # the growth is real
        assert ledger.budget == 50 * MIB + (capacity - 50 * MIB) - margin - 50 * MIB
        assert ledger.budget <= capacity - margin
        pool = ledger.register_pool("late")
        assert not pool.grant(50 * MIB), "granted past the device: growth counted twice"
        assert pool.grant(15 * MIB)  # what is really left under the margin
        pool.refund(15 * MIB)
        pool.close()
    finally:
        _hooks.point = None
        for child in grower:
            child.stop()
        driver.release(other)
        ledger.close()


def test_no_budget_is_ever_published_above_total_minus_margin(ledger, device):
    device.free = 50 * GIB  # a sampler that over-reports (or a device total that shrank)
    pool = ledger.register_pool("a")
    assert pool.grant(GIB)
    assert ledger.calibrate().published
    assert ledger.budget == 10 * GIB - ledger.safety_margin
    assert not pool.grant(9 * GIB)


# -- 3: liveness read under the lock ---------------------------------------------------------
def test_a_snapshot_never_shows_a_reclaimed_slot_alive_with_the_old_charge(
    ledger, ledger_dir, monkeypatch
):
    from .test_ledger_crash import run_child

    run_child(ledger_dir, "hold")  # dies holding 10 MiB in slot 0
    newcomer: list[Child] = []
    probe = Ledger._lease

    def lease_after_a_newcomer(self, slot):
        if not newcomer:
            # Between the snapshot's copy of the records and its first lease probe,
            # another process registers: it retires the dead slot 0 and takes it.
            child = Child("register", ledger_dir)
            newcomer.append(child)
            child.line(3)  # registers at once if the snapshot dropped the lock already
        return probe(self, slot)

    try:
        monkeypatch.setattr(Ledger, "_lease", lease_after_a_newcomer)
        snap = ledger.snapshot()
        monkeypatch.undo()
        assert newcomer
        shown = [(p.slot, p.charged, p.alive) for p in snap.pools]
        assert (0, 10 * MIB, True) not in shown, f"a dead owner's charge shown alive: {shown}"
        assert shown == [(0, 10 * MIB, False)]
        assert newcomer[0].line(30) == "registered"
        assert [(p.instance, p.charged, p.alive) for p in ledger.snapshot().pools] == [
            ("newcomer", 0, True)
        ]
    finally:
        for child in newcomer:
            child.stop()


# -- 4: a stopped lock holder ----------------------------------------------------------------
def test_a_holder_stopped_in_the_data_lock_stalls_nobody_for_long(ledger, ledger_dir, caplog):
    pool = ledger.register_pool("engine")
    assert pool.grant(GIB)
    stopper = Child("stop", ledger_dir)
    try:
        assert stopper.line(60) == "stopping"
        deadline = time.monotonic() + 30
        while stopper.state() != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopper.state() == "T", "the child did not stop inside the lock"
        fd = os.open(ledger.path, os.O_RDWR)
        try:
            assert not data_lock_is_free(fd)
        finally:
            os.close(fd)

        t0 = time.monotonic()
        assert not pool.grant(2 * MIB)  # a miss after a bounded wait, not a hang
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert not pool.grant(2 * MIB)  # the same episode: no wait at all
        again = time.monotonic() - t0
        assert first < 5 and again < 1, (first, again)
        assert sum("data lock is held by pid" in r.message for r in caplog.records) == 1

        t0 = time.monotonic()
        out = subprocess.run(
            [*KVCTL, "gpus", "--ledger-dir", ledger_dir, "--timeout", "1"],
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert "fake-0" in out.stdout and "1.00 GiB" in out.stdout  # what it could read
        assert f"held by pid {stopper.proc.pid} (stopped)" in out.stderr
        assert took < 30  # a Python start on a loaded machine, plus the 1 s timeout
        out = subprocess.run(
            [*KVCTL, "limit", "engine", "512M", "--ledger-dir", ledger_dir, "--timeout", "1"],
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and f"held by pid {stopper.proc.pid}" in out.stderr, out

        stopper.proc.send_signal(signal.SIGCONT)
        assert stopper.line(30) == "continued"
        assert pool.grant(2 * MIB)  # free again: the episode ends
        assert any("free again" in r.message for r in caplog.records)
    finally:
        stopper.stop()


# -- 5: corrupt records ---------------------------------------------------------------------
def _scribble(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "field,value,what",
    [
        ("charged", (7_464_639 << 40).to_bytes(8, "little", signed=True), "charges"),
        ("charged", (-569_899 << 40).to_bytes(8, "little", signed=True), "charges"),
        ("instance", (9_999).to_bytes(4, "little"), "instance record"),
    ],
)
def test_a_corrupt_record_is_refused_and_left_untouched(ledger, ledger_dir, field, value, what):
    pool = ledger.register_pool("a")
    assert pool.grant(GIB)
    offset = layout.pool_offset(pool.slot) + getattr(PoolRecord, field).offset
    _scribble(ledger.path, offset, value)
    before = file_bytes(ledger.path)

    out = subprocess.run(
        [*KVCTL, "gpus", "--ledger-dir", ledger_dir],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and ledger.path in lines[0] and "is corrupt" in lines[0]
    assert what in lines[0] and "remove the file" in lines[0]
    for command in ("list", "metrics"):  # no crash: the ledger is skipped with a warning
        out = subprocess.run(
            [*KVCTL, command, "--ledger-dir", ledger_dir],
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Traceback" not in out.stderr and "is corrupt" in out.stderr, out.stderr

    code = (
        "from kvcached.ledger import Ledger\n"
        "class D:\n    def mem_info(self): return 8 << 30, 10 << 30\n"
        f"Ledger.open('fake-0', D(), directory={ledger_dir!r}, gpu_utilization=0.9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "LedgerCorruptError" in out.stderr, out.stderr
    assert "IndexError" not in out.stderr
    assert file_bytes(ledger.path) == before  # nobody wrote a byte
    with pytest.raises(LedgerCorruptError):
        ledger.snapshot()
    assert not pool.grant(2 * MIB)  # the running process refuses too, without raising
    pool.refund(64 * MIB)  # kept in the process: a flush would write the file
    pool.flush()
    assert file_bytes(ledger.path) == before
    pool._abandon()


@pytest.mark.slow
def test_kvctl_list_still_lists_instances_beside_a_corrupt_ledger(tmp_path):
    from tests.control.kvctl_helpers import Child as Instance
    from tests.control.kvctl_helpers import child_env, unique_index

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    inst = Instance(str(good), unique_index(), name="survivor")
    try:
        assert inst.cmd("alloc 4")["ok"]
        led = Ledger.open(
            "fake-0",
            type("D", (), {"mem_info": lambda s: (8 << 30, 10 << 30)})(),
            directory=str(bad),
            gpu_utilization=0.9,
        )
        pool = led.register_pool("victim")
        assert pool.grant(GIB)
        _scribble(
            led.path,
            layout.pool_offset(pool.slot) + PoolRecord.charged.offset,
            (1 << 62).to_bytes(8, "little"),
        )
        e = child_env(str(bad), None)
        out = subprocess.run([*KVCTL, "list"], env=e, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "survivor" in out.stdout
        assert "is corrupt" in out.stderr and "Traceback" not in out.stderr
        pool._abandon()
        led.close()
    finally:
        inst.close()


# -- 6: the file is the one at the path -------------------------------------------------------
def test_a_ledger_unlinked_in_use_grants_nothing_more(ledger, ledger_dir, device):
    pool = ledger.register_pool("old")
    assert pool.grant(GIB)
    os.unlink(ledger.path)
    # A new process creates a fresh ledger at the path, with the full budget.
    newcomer = Child("register", ledger_dir)
    try:
        assert newcomer.line(60) == "registered"
        with pytest.raises(LedgerReplacedError, match="now names another file"):
            ledger.calibrate()
        assert not pool.grant(2 * MIB), "granted against a file no longer at the path"
        assert pool.headroom() == 0 or not pool.grant(1)
        with pytest.raises(LedgerError, match="another file"):
            ledger.register_pool("old")
        pool.refund(GIB)  # refunds still work: they only lower a charge
    finally:
        newcomer.stop()


def test_a_removed_ledger_is_detected_at_registration(ledger):
    os.unlink(ledger.path)
    with pytest.raises(LedgerReplacedError, match="was removed"):
        ledger.register_pool("late")
