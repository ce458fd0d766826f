"""The cuda backend on a machine without an NVIDIA GPU.

* With no libcuda at all, asking for the backend says so plainly.
* Against tests/fakes/fake_libcuda.c (a libcuda.so.1 built here that keeps
  "device" memory in host memory and checks the arguments the real driver
  would), the whole backend runs through the real cuda-python bindings: struct
  layouts, enums, contexts per thread, error mapping, bookkeeping. That runs
  in a subprocess, since a process keeps the first libcuda it loads.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.errors import DriverUnavailableError

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"


def _real_libcuda_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


no_libcuda = pytest.mark.skipif(
    _real_libcuda_present(), reason="an NVIDIA driver is installed here"
)


@no_libcuda
def test_without_libcuda_the_backend_says_what_to_do():
    from kvcached.driver.cuda import CudaDriver

    with pytest.raises(DriverUnavailableError) as info:
        CudaDriver(0)
    message = str(info.value)
    assert "no NVIDIA driver found (libcuda.so.1)" in message
    assert "KVCACHED_DRIVER=host" in message


@no_libcuda
def test_make_driver_cuda_raises_the_same():
    from kvcached.driver import make_driver

    with pytest.raises(DriverUnavailableError, match="KVCACHED_DRIVER=host"):
        make_driver("cuda", 0)


@pytest.mark.slow
def test_importing_the_gpu_backends_needs_no_posix_ipc():
    code = (
        "import sys, kvcached.driver.cuda, kvcached.driver.hip\n"
        "bad = [m for m in sys.modules if m.startswith(('posix_ipc', 'kvcached.ledger', "
        "'kvcached.memory'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    out = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Werror",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out / "libcuda.so.1"),
            str(FAKES / "fake_libcuda.c"),
            "-lpthread",
        ],
        check=True,
        timeout=120,
    )
    return out


def _run_with_fake(fake_libcuda: Path, args: list[str], **env: str):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LD_LIBRARY_PATH": str(fake_libcuda),
            "KVCACHED_LOG_LEVEL": "WARNING",
            **env,
        },
    )


@pytest.mark.slow
def test_the_backend_against_the_fake_driver(fake_libcuda):
    result = _run_with_fake(fake_libcuda, [str(FAKES / "cuda_checks.py")])
    assert result.returncode == 0, result.stdout + result.stderr
    done = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    assert done == {
        "identity",
        "pages_keep_their_data",
        "runs_of_mappings",
        "mem_info_follows_handles",
        "misuse_is_refused",
        "threads_get_a_context_once",
        "current_context_is_left_as_found",
        "faulty_wrapper_speaks_cuda",
        "close",
    }


@pytest.mark.slow  # a benchmark script run end to end
def test_driver_benchmark_runs_both_loops_on_the_fake_driver(fake_libcuda, tmp_path):
    out = tmp_path / "driver.json"
    result = _run_with_fake(
        fake_libcuda,
        [
            "benchmarks/driver.py",
            "--backend",
            "cuda",
            "--iters",
            "16",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        FAKE_CUDA_NOOP="1",
        FAKE_CUDA_TOTAL=str(1 << 30),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    for key in ("kvcached_us", "raw_us"):
        for size in ("2MiB", "64MiB"):
            calls = data[key][size]
            assert set(calls) == {"create", "map", "set_access", "unmap", "release", "total"}
            assert all(v["p50"] > 0 and v["mean"] > 0 for v in calls.values()), calls
    assert data["iterations"] == {"2MiB": 32, "64MiB": 4}
    assert data["overhead_ratio"] > 0
    assert data["environment"]["device"]["name"] == "Fake CUDA Device 0"
    assert data["environment"]["cuda_driver_version"] == 13000
