"""benchmarks/map_beside_kernels.py: its read-outs, and one short run on the host backend."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

import map_beside_kernels


class _CountingLoop:
    """A page loop that counts a page every 10 ms until stopped."""

    def __init__(self) -> None:
        self.pages = 0
        self.running = False

    def run(self, stop: threading.Event) -> None:
        self.running = True
        while not stop.wait(0.01):
            self.pages += 1
        self.running = False


def test_measure_reads_the_step_time_added_per_page() -> None:
    loop = _CountingLoop()

    def step() -> float:  # a step takes 2 ms alone, 3 ms with the page loop beside it
        return 0.003 if loop.running else 0.002

    r = map_beside_kernels.measure(step, loop, seconds=0.1, rounds=2)
    assert r["step_ratio"] == pytest.approx(1.5)
    assert r["median_step_us_alone"] == pytest.approx(2000)
    assert r["median_step_us_beside"] == pytest.approx(3000)
    beside = r["rounds"]["beside"]
    assert all(p["pages"] > 0 for p in beside)
    assert all(p["pages"] == 0 for p in r["rounds"]["alone"])
    # 1 ms added to each step, spread over the pages done meanwhile
    expected = [1000 * p["steps"] / p["pages"] for p in beside]
    assert min(expected) <= r["us_per_page"] <= max(expected)


def test_a_short_run_on_the_host_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "256M")
    out = tmp_path / "r.json"
    interval = sys.getswitchinterval()
    rc = map_beside_kernels.main(
        ["--device", "cpu", "--backend", "host", "--handles", "2", "--kernels", "2", "--dim", "16"]
        + ["--seconds", "0.05", "--rounds", "2", "--shapes", "launch", "--out", str(out)]
    )
    assert rc == 0
    assert sys.getswitchinterval() == interval  # restored
    result = json.loads(out.read_text())
    assert result["backend"] == "host" and result["handles_per_page"] == 2
    launch = result["shapes"]["launch"]
    assert launch["step_ratio"] > 0 and launch["pages_per_s_beside"] > 0
    assert len(launch["rounds"]["alone"]) == len(launch["rounds"]["beside"]) == 2
    assert result["provenance"]["command"]
