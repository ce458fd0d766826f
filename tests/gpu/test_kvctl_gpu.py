"""GPU: kvctl sees and limits instances whose KV caches live in real GPU memory.

Two instance processes (tests/control/instance_child.py) open KV caches on CUDA
device 0 through ``open_kv_cache``, charged to a ledger in a temporary
directory; kvctl runs with no CUDA device visible at all. Never in CI:
``python -m pytest -m gpu tests/gpu/test_kvctl_gpu.py -v`` on a machine with an
NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid

import pytest

from tests.control.kvctl_helpers import Child, run_kvctl, wait_until
from tests.gpu.cuda_marks import requires_cuda

GIB = 1 << 30


def kvctl(*args: str):
    """kvctl with no GPU visible: it must not need one."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return run_kvctl(*args, env=env)


@pytest.mark.gpu
@requires_cuda
def test_kvctl_lists_and_limits_gpu_instances():
    ledger_dir = tempfile.mkdtemp(prefix="kvctl-gpu-")
    tag = uuid.uuid4().hex[:6]
    kids = []
    try:
        a = Child(ledger_dir, "cuda", name=f"gpu-{tag}-a", capacity=2 * GIB)
        kids.append(a)
        b = Child(ledger_dir, "cuda", name=f"gpu-{tag}-b", capacity=2 * GIB)
        kids.append(b)
        page, bpp = a.page_bytes, a.blocks_per_page
        done = kvctl("list", "--json", a.name, b.name)
        assert done.returncode == 0, done.stderr
        rows = {r["name"]: r for r in json.loads(done.stdout)}
        assert set(rows) == {a.name, b.name}
        gpu = rows[a.name]["gpu"]
        assert rows[a.name]["backend"] == "cuda" and ":" in gpu  # a PCI bus id
        assert a.cmd(f"alloc {bpp * 40}")["ok"]
        a.cmd(f"free {bpp * 30}")
        before = a.cmd("usage")
        used = before["pages_used"] * page
        assert before["bytes_mapped"] > used
        started = time.monotonic()
        done = kvctl("limit", a.name, str(used), "--wait", "5", "--json")
        elapsed = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "applied" and elapsed < 6
        after = a.cmd("usage")
        assert after["bytes_mapped"] == used == after["ledger_charged"]
        assert after["blocks_used"] == before["blocks_used"]
        assert not a.cmd(f"alloc {bpp * 2}")["ok"]  # growth past the limit: a miss
        assert kvctl("limit", a.name, "1G").returncode == 0
        assert wait_until(lambda: a.cmd(f"alloc {bpp * 20}")["ok"], timeout=5)
        assert a.cmd("usage")["bytes_mapped"] > used
        done = kvctl("gpus", "--ledger-dir", ledger_dir, "--json")
        (row,) = json.loads(done.stdout)
        assert row["gpu"] == gpu and row["total_bytes"] > 10 * GIB and row["budget_bytes"] > 0
        done = kvctl("metrics")
        assert f'kvcached_instance_up{{instance="{a.name}",gpu="{gpu}"}} 1' in done.stdout
    finally:
        for c in kids:
            c.close()
        shutil.rmtree(ledger_dir, ignore_errors=True)
