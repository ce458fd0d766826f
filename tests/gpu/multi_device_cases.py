"""The multi-device scenarios, run on two GPUs (``tests/gpu/test_multi_gpu.py``)
and on two host devices standing in for them in CI
(``tests/control/test_multi_device_host.py``): the same worker processes
(``multi_device_worker.py``) and the same assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached.ledger.ledger import Ledger
from kvcached.units import MIB

WORKER = Path(__file__).with_name("multi_device_worker.py")
REPO = Path(__file__).resolve().parents[2]
KVCTL = [sys.executable, "-m", "kvcached.cli.kvctl"]


def worker_env(ledger_dir: str, name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(
        {
            "KVCACHED_LEDGER_DIR": ledger_dir,
            "KVCACHED_IPC_NAME": name,
            "KVCACHED_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
            # NVLink multicast stays off on shared GPU hosts (the device's rules).
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    )
    env.update(extra)
    return env


class Worker:
    """A ``serve``-mode worker process, driven line by line."""

    def __init__(self, backend: str, index: int, capacity: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve", backend, str(index), str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ready = self._read(180)
        assert self.ready.get("ready"), self.ready

    def _read(self, timeout: float) -> dict[str, Any]:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"worker {self.proc.pid} did not answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"worker exited with {self.proc.wait(10)}: {err[-3000:]}")
        return json.loads(line)

    def cmd(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self._read(120)
        assert "error" not in answer, answer
        return answer

    def close(self) -> int:
        if self.proc.poll() is None:
            # It may have exited already; its exit code is what is reported.
            with contextlib.suppress(OSError, RuntimeError, TimeoutError, ValueError):
                self.cmd("quit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def ledger_charged(path: str) -> tuple[str, int, int]:
    """(device id, total bytes, charged bytes) of the ledger at ``path``."""
    ledger = Ledger.open_existing(path)
    try:
        h = ledger.snapshot().header
        return h.device_id, h.total_bytes, h.charged
    finally:
        ledger.close()


def kvctl_gpus(ledger_dir: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [*KVCTL, "gpus", "--ledger-dir", ledger_dir, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@dataclass
class MemorySlack:
    """How far one device's free memory may move for reasons not ours: none on
    the host backend (it counts only kvcached's memfds), a little on a GPU
    (the driver's own bookkeeping, another context's first kernel launch)."""

    other_device: int
    own_extra: int


HOST_SLACK = MemorySlack(other_device=0, own_extra=0)
GPU_SLACK = MemorySlack(other_device=64 * MIB, own_extra=64 * MIB)


def two_devices_grow_and_shrink(
    backend: str,
    indices: tuple[int, int],
    capacity: int,
    ledger_dir: str,
    slack: MemorySlack,
    env: dict[str, dict[str, str]] | None = None,
) -> None:
    """Two processes, one per device, each growing and shrinking its own KV
    cache with data checks; each device's ledger is its own file, keyed by its
    bus id, and charges exactly that process' memory; growth on one device
    leaves the other device's free memory where it was."""
    env = env or {}
    a = b = None
    try:
        a = Worker(
            backend, indices[0], capacity, worker_env(ledger_dir, "multi-a", **env.get("a", {}))
        )
        b = Worker(
            backend, indices[1], capacity, worker_env(ledger_dir, "multi-b", **env.get("b", {}))
        )
        ia, ib = a.ready, b.ready
        assert ia["bus_id"] != ib["bus_id"], (ia, ib)
        assert ia["ledger"] != ib["ledger"]
        for info in (ia, ib):
            assert os.path.dirname(info["ledger"]) == ledger_dir
            assert info["ledger"].endswith(info["bus_id"]), info
            assert info["view_device"] == info["torch_device"], info
        bpp = ia["blocks_per_page"]
        page = ia["page_bytes"]

        grown_a = a.cmd(f"grow {bpp * 20 + 3}")
        assert grown_a["ok"] and grown_a["charged"] >= 21 * page
        drop_a = ia["free"] - grown_a["free"]
        charged_a = grown_a["charged"] - ia["charged"]  # the null block's page came first
        assert charged_a >= 20 * page
        assert charged_a <= drop_a <= charged_a + slack.own_extra, (drop_a, charged_a)
        b_now = b.cmd("info")
        assert abs(b_now["free"] - ib["free"]) <= slack.other_device, (b_now, ib)
        assert b_now["charged"] == ib["charged"]  # b's null-block page only

        grown_b = b.cmd(f"grow {bpp * 7}")
        assert grown_b["ok"] and grown_b["charged"] - ib["charged"] >= 6 * page
        a_now = a.cmd("info")
        assert abs(a_now["free"] - grown_a["free"]) <= slack.other_device, (a_now, grown_a)

        for worker, info, grown in ((a, ia, grown_a), (b, ib, grown_b)):
            device_id, total, charged = ledger_charged(info["ledger"])
            assert device_id == info["bus_id"]
            assert total == info["total"]
            assert charged == grown["charged"], (info["bus_id"], charged, grown["charged"])
            assert worker.cmd("check")["bad"] == 0

        rows = {row["gpu"]: row for row in kvctl_gpus(ledger_dir)}
        assert set(rows) == {ia["bus_id"], ib["bus_id"]}, rows
        assert rows[ia["bus_id"]]["charged_bytes"] == grown_a["charged"]
        assert rows[ib["bus_id"]]["charged_bytes"] == grown_b["charged"]

        for worker, info in ((a, ia), (b, ib)):
            shrunk = worker.cmd("shrink")
            assert shrunk["charged"] == shrunk["bytes_mapped"] <= info["charged"], shrunk
            assert abs(shrunk["free"] - info["free"]) <= slack.own_extra, (shrunk, info)
            assert ledger_charged(info["ledger"])[2] == shrunk["charged"]
    finally:
        codes = [w.close() for w in (a, b) if w is not None]
    assert codes == [0, 0], codes
    for info in (ia, ib):
        assert ledger_charged(info["ledger"])[2] == 0  # closed: every charge refunded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_pair_agrees(
    backend: str,
    index_base: int,
    dist_backend: str,
    ledger_dir: str,
    out: str,
    limit_pages: int = 6,
    rounds: int = 40,
    env_extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A TP=2 pair, one process per device, under a limit on rank 1's device
    only: both ranks admit the same batches every round, rank 1 never goes
    past its limit, and rank 0 alone would have admitted more."""
    page = 2 * 2 * (2 * MIB)  # the worker's page: 2 layers x K,V x 2 MiB
    limit = limit_pages * page
    init = f"tcp://127.0.0.1:{free_port()}"
    env = worker_env(ledger_dir, "multi-tp", **(env_extra or {}))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "tp",
                backend,
                str(index_base),
                str(rank),
                "2",
                dist_backend,
                init,
                "1",
                str(limit),
                str(rounds),
                out,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-6000:]
    with open(out) as f:
        report = json.load(f)
    r0, r1 = report["ranks"]
    assert r0["bus_id"] != r1["bus_id"] and r0["ledger"] != r1["ledger"]
    assert r0["admitted"] == r1["admitted"], "the ranks admitted different batches"
    assert sum(len(x) for x in r0["admitted"]) > rounds // 2  # it did admit work
    assert r1["peak_charged"] <= limit, (r1["peak_charged"], limit)
    # The limit mattered: rank 0 alone could have admitted more at some round.
    assert any(a0 > a1 for a0, a1 in zip(r0["alone"], r1["alone"], strict=True)), (
        r0["alone"],
        r1["alone"],
    )
    assert r0["agreement"]["min_reduces"] == rounds == r1["agreement"]["min_reduces"]
    return report
