"""GPU: 2 and 4 processes fill one GPU through one ledger with no CUDA OOM.

Runs benchmarks/ledger_gpu.py (see its docstring) for a short time and checks
its report. Never in CI: ``pytest -m gpu tests/gpu/test_ledger_gpu.py`` on a
machine with an NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.cuda_marks import requires_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("procs", [2, 4])
def test_processes_fill_one_gpu_without_oom(tmp_path, procs):
    out = os.environ.get("OUT") or str(tmp_path)
    report_path = os.path.join(out, f"ledger-gpu-test-{procs}.json")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "ledger_gpu.py"),
            "--procs",
            str(procs),
            "--seconds",
            "20",
            "--out",
            report_path,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert os.path.exists(report_path), proc.stdout + proc.stderr
    with open(report_path) as f:
        run = json.load(f)["runs"][0]
    assert run["oom_errors"] == 0, run["oom_calls"]
    assert run["agree_within_margin"], (
        run["min_used_minus_ledger"],
        run["max_used_minus_ledger"],
        run["safety_margin"],
    )
    assert run["fill_phases"] > 0 and run["denials"] > 0  # it did reach the budget
    assert run["peak_fill_of_total"] > 0.8
    assert run["final_charged"] == 0 and run["final_pools"] == 0
    assert all(code == 0 for code in run["exit_codes"]), proc.stderr
