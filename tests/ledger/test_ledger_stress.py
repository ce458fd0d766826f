"""Multi-process stress: workers grant and refund on one ledger while a supervisor
SIGKILLs them at random moments and starts new ones.

Kills are aimed: about half wait until the victim's journal says it holds the
data lock, a fifth until it is between a grant and its materialisation, the
rest land anywhere (registration, calibration, refunds). After each death the
victim's journal says where it really was, and the test counts the kills that
landed inside the lock and between a grant and its use.

What must hold:

* the budget is never exceeded by accounting: every granted grant leaves
  ``sum(charges) <= budget``, and no holder of the data lock ever sees the sum
  raised past the budget while it holds it (checked by every worker at every
  grant and every unlock, tens of thousands of times; a calibration may
  legitimately publish a budget below the charges, see ``Sampler`` in
  stress_worker.py, so the supervisor counts those moments but does not fail
  on them);
* at the end, once the live workers are quiesced and the dead owners retired,
  every pool record belongs to a live worker and charges exactly what that
  worker holds: the sum of charges equals the sum of what live processes hold;
  and a calibration taken at rest publishes a budget that covers those charges.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from kvcached.ledger import Ledger
from kvcached.units import MIB

from . import stress_worker as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(__file__), "stress_worker.py")
WORKERS = 5
MIN_KILLS = 300
MAX_SECONDS = 100.0


class Supervisor:
    def __init__(self, directory: str, seed: int) -> None:
        self.dir = directory
        self.rng = random.Random(seed)
        self.seq = 0
        self.workers: dict[int, tuple[subprocess.Popen, str, object, memoryview]] = {}
        self.kills: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self.env = dict(os.environ, PYTHONPATH=ROOT, KVCACHED_LOG_LEVEL="ERROR")

    def spawn(self) -> None:
        self.seq += 1
        path = os.path.join(self.dir, f"journal-{self.seq}")
        with open(path, "wb") as f:
            f.write(bytes(W.WORDS * 8))
        proc = subprocess.Popen(
            [sys.executable, WORKER, os.path.join(self.dir, "ledger"), path, str(self.seq)],
            env=self.env,
            stderr=subprocess.PIPE,
        )
        mm, j = W.open_journal(path)
        self.workers[proc.pid] = (proc, path, mm, j)

    def _forget(self, pid: int) -> memoryview:
        proc, path, mm, j = self.workers.pop(pid)
        words = memoryview(bytearray(j.tobytes())).cast("q")
        j.release()
        mm.close()
        os.unlink(path)
        for key, word in (
            ("ops", W.OPS),
            ("locks", W.LOCKS),
            ("violations", W.VIOLATIONS),
            ("calibrations", W.CALIBRATIONS),
            ("denials", W.DENIALS),
            ("checks", W.CHECKS),
        ):
            self.totals[key] += words[word]
        return words

    def reap_unexpected(self) -> None:
        for pid, (proc, *_rest) in list(self.workers.items()):
            code = proc.poll()
            if code is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise AssertionError(f"worker {pid} exited by itself with {code}:\n{err}")

    def kill_one(self) -> None:
        mode = self.rng.random()
        running = [pid for pid, w in self.workers.items() if w[3][W.STATE] == W.RUNNING]
        if mode < 0.7 and not running:  # aimed kills wait for a registered worker
            deadline = time.monotonic() + 10
            while not running and time.monotonic() < deadline:
                time.sleep(0.005)
                running = [pid for pid, w in self.workers.items() if w[3][W.STATE] == W.RUNNING]
        pid = self.rng.choice(running if mode < 0.7 and running else list(self.workers))
        proc, _path, _mm, j = self.workers[pid]
        deadline = time.monotonic() + 0.2
        if mode < 0.5:
            aim = "lock"
            while j[W.IN_LOCK] == 0 and time.monotonic() < deadline:
                time.sleep(0)
        elif mode < 0.7:
            aim = "materialise"
            while j[W.STAGE] != 1 and time.monotonic() < deadline:
                time.sleep(0)
        else:
            aim = "anywhere"
            time.sleep(self.rng.uniform(0, 0.01))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        if proc.stderr:
            proc.stderr.close()
        words = self._forget(pid)
        self.kills["total"] += 1
        self.kills[f"aimed-{aim}"] += 1
        if words[W.STATE] == W.STARTING:
            self.kills["while-starting"] += 1
        if words[W.IN_LOCK]:
            self.kills["inside-data-lock"] += 1
        if words[W.STAGE] == 1:
            self.kills["between-grant-and-materialisation"] += 1
        if words[W.PENDING_GRANT]:
            self.kills["inside-a-grant-call"] += 1
        if words[W.STAGE] == 2:
            self.kills["between-release-and-refund"] += 1
        if words[W.STAGE] == 3:
            self.kills["inside-calibration"] += 1


def sum_within_budget(ledger: Ledger) -> bool:
    with ledger.locked():
        return ledger.charged_total() <= ledger.budget


@pytest.mark.slow
def test_sigkill_stress_keeps_charges_exact(tmp_path):
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()

    class Device:
        def mem_info(self):
            return W.MARGIN + 512 * MIB, W.TOTAL

    ledger = Ledger.open(W.DEVICE_ID, Device(), directory=str(ledger_dir), gpu_utilization=0.9)
    sup = Supervisor(str(tmp_path), seed=1234)
    supervisor_checks = supervisor_over = 0
    revision = 0
    try:
        for _ in range(WORKERS):
            sup.spawn()
        start = time.monotonic()
        while sup.kills["total"] < MIN_KILLS and time.monotonic() - start < MAX_SECONDS:
            sup.reap_unexpected()
            sup.kill_one()
            sup.spawn()
            supervisor_checks += 1
            if not sum_within_budget(ledger):
                supervisor_over += 1
            if sup.kills["total"] % 25 == 0:
                ledger.retire_dead()
                revision += 1
                for name in ("inst0", "inst1", "inst2"):
                    with contextlib.suppress(LookupError):  # no live worker of it now
                        ledger.set_limit(name, sup.rng.choice([0, 128 * MIB, 384 * MIB]), revision)
        elapsed = time.monotonic() - start

        # Quiesce the live workers: each finishes its step, flushes, and waits.
        for _proc, _path, _mm, j in sup.workers.values():
            j[W.STOP] = 1
        deadline = time.monotonic() + 60
        while any(j[W.STATE] != W.QUIESCED for *_x, j in sup.workers.values()):
            sup.reap_unexpected()
            assert time.monotonic() < deadline, "workers did not quiesce"
            time.sleep(0.01)
        retired_at_end = ledger.retire_dead()
        snap = ledger.snapshot()
        live = {j[W.TOKEN]: j[W.HELD] for *_x, j in sup.workers.values()}
        records = {p.token: p.charged for p in snap.pools}
        assert all(p.alive for p in snap.pools)
        assert records == live  # every record is a live worker's, charging what it holds
        assert snap.header.charged == sum(live.values())
        # The last calibration of the run may have published a budget below the
        # charges (a refund or a retirement between its sample and its publication);
        # one taken at rest, from a device that reports what the workers hold, must not.
        at_rest = W.Sampler(random.Random(0))
        at_rest.ledger = ledger
        calibration = ledger.calibrate(at_rest)
        assert calibration.published, calibration
        snap = ledger.snapshot()
        assert snap.header.charged == sum(live.values())
        assert snap.header.charged <= snap.header.budget

        # Let them go: they refund everything and close.
        for _proc, _path, _mm, j in sup.workers.values():
            j[W.EXIT] = 1
        for pid in list(sup.workers):
            proc = sup.workers[pid][0]
            assert proc.wait(60) == 0, proc.stderr.read().decode(errors="replace")
            proc.stderr.close()
            sup._forget(pid)
        snap = ledger.snapshot()
        assert snap.pools == () and snap.header.charged == 0 and snap.instances == ()
    finally:
        for proc, *_rest in sup.workers.values():
            proc.kill()
            proc.wait()
        ledger.close()

    report = dict(
        sup.kills,
        seconds=round(elapsed, 1),
        retired_at_end=retired_at_end,
        supervisor_checks=supervisor_checks,
        supervisor_saw_budget_below_charges=supervisor_over,
        **sup.totals,
    )
    print("ledger stress:", report)
    assert sup.totals["violations"] == 0 and sup.totals["checks"] > 10_000, report
    assert sup.kills["total"] >= MIN_KILLS, report
    assert sup.kills["inside-data-lock"] >= 50, report
    assert sup.kills["between-grant-and-materialisation"] >= 20, report
    assert sup.totals["calibrations"] > 0 and sup.totals["denials"] > 0, report
    assert [n for n in os.listdir(ledger_dir) if n != "kvcached-ledger-stress-0"] == []
