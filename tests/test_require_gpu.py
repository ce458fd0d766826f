"""``KVCACHED_REQUIRE_GPU=1`` turns the GPU tests' skips into failures (for the GPU
machine, where a skip would hide a device that was not seen); unset, they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import cuda_marks

ROOT = Path(__file__).resolve().parents[1]
GPU_MODULES = ["tests/gpu/test_ledger_gpu.py", "tests/memory/test_gpu.py"]


def run_pytest(require: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(cuda_marks.REQUIRE_VARIABLE, None)
    if require is not None:
        env[cuda_marks.REQUIRE_VARIABLE] = require
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", *GPU_MODULES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # two pytest runs in subprocesses, ~14 s
@pytest.mark.skipif(cuda_marks.has_torch_gpu(), reason="a GPU is here: nothing would skip")
def test_without_a_gpu_the_gpu_tests_skip_unless_required():
    skipped = run_pytest(None)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "skipped" in skipped.stdout and "failed" not in skipped.stdout
    required = run_pytest("1")
    assert required.returncode == 1, required.stdout + required.stderr
    assert "KVCACHED_REQUIRE_GPU=1, but this test needs" in required.stdout
    assert "skipped" not in required.stdout.splitlines()[-1]


def test_the_variable_takes_one_or_zero(monkeypatch):
    monkeypatch.setenv(cuda_marks.REQUIRE_VARIABLE, "1")
    assert cuda_marks.gpu_required()
    monkeypatch.setenv(cuda_marks.REQUIRE_VARIABLE, "off")
    assert not cuda_marks.gpu_required()
    monkeypatch.setenv(cuda_marks.REQUIRE_VARIABLE, "maybe")
    with pytest.raises(ValueError, match="KVCACHED_REQUIRE_GPU='maybe'"):
        cuda_marks.gpu_required()
