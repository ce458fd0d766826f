"""Sizes are bounded where they are parsed, and the host device variable is honoured
everywhere (issue #14, point 7)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from kvcached.config import Config, physical_memory
from kvcached.errors import ConfigError, LedgerError
from kvcached.ledger import Ledger
from kvcached.units import GIB, MIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvcached(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, KVCACHED_DRIVER="host", PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-m", "kvcached", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


@pytest.mark.parametrize("value", ["1K", "1M", "99999999999999999999999999", "9000T"])
def test_host_capacity_out_of_bounds_is_refused_at_parse_time(value):
    with pytest.raises(ConfigError, match="KVCACHED_HOST_CAPACITY.*2 MiB page"):
        Config.from_env({"KVCACHED_HOST_CAPACITY": value})


def test_host_capacity_above_the_machine_needs_overcommit():
    above = str(physical_memory() + 2 * MIB)
    with pytest.raises(ConfigError, match="machine's memory.*KVCACHED_HOST_OVERCOMMIT"):
        Config.from_env({"KVCACHED_HOST_CAPACITY": above})
    config = Config.from_env({"KVCACHED_HOST_CAPACITY": above, "KVCACHED_HOST_OVERCOMMIT": "1"})
    assert config.host_capacity == int(above)


def test_kvcached_info_with_a_tiny_capacity_is_a_clear_usage_error():
    out = kvcached("info", KVCACHED_HOST_CAPACITY="1K")
    assert out.returncode == 2, out
    assert "KVCACHED_HOST_CAPACITY='1K'" in out.stderr and "2 MiB page" in out.stderr
    assert "unexpected" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_kvcached_info_uses_the_host_device_variable():
    out = kvcached(
        "info", "--json", "--pages", "1", KVCACHED_HOST_CAPACITY="64M", KVCACHED_HOST_DEVICE="7"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device"]["pci_bus_id"] == "host-7"


@pytest.mark.slow
def test_open_kv_cache_uses_the_host_device_variable(tmp_path):
    code = (
        "import torch\n"
        "from kvcached.config import get_config\n"
        "from kvcached.control.instance import close_kv_cache, open_kv_cache\n"
        "from kvcached.memory.spec import KVCacheSpec\n"
        "spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=2, head_dim=32, "
        "dtype=torch.float16)\n"
        "cache = open_kv_cache(spec, capacity_bytes=8 << 20, config=get_config())\n"
        "print(cache.budget.ledger_path)\n"
        "close_kv_cache(cache)\n"
    )
    env = dict(
        os.environ,
        KVCACHED_DRIVER="host",
        KVCACHED_HOST_DEVICE="9",
        KVCACHED_HOST_CAPACITY="64M",
        KVCACHED_LEDGER_DIR=str(tmp_path),
        KVCACHED_IPC_NAME="hostdev-test",
        PYTHONPATH=ROOT,
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("kvcached-ledger-host-9")


class Device:
    def __init__(self, free: int, total: int) -> None:
        self.free, self.total = free, total

    def mem_info(self) -> tuple[int, int]:
        return self.free, self.total


@pytest.mark.parametrize("free,total", [(1 << 60, 1 << 60), (0, -(1 << 40)), (-1, GIB)])
def test_no_ledger_is_created_for_an_absurd_device(tmp_path, free, total):
    with pytest.raises(LedgerError, match="host-3 reports.*KVCACHED_HOST_CAPACITY"):
        Ledger.open("host-3", Device(free, total), directory=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_total_that_differs_names_the_variable_that_differs(tmp_path, caplog):
    first = Ledger.open("host-4", Device(GIB, GIB), directory=str(tmp_path), gpu_utilization=0.9)
    with caplog.at_level(logging.WARNING, logger="kvcached.ledger"):
        second = Ledger.open(
            "host-4", Device(2 * GIB, 2 * GIB), directory=str(tmp_path), gpu_utilization=0.9
        )
    text = " ".join(r.message for r in caplog.records)
    assert "KVCACHED_HOST_CAPACITY" in text and "KVCACHED_GPU_UTILIZATION" not in text
    assert second.total_bytes == GIB  # the ledger's own total is kept
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcached.ledger"):
        third = Ledger.open(
            "host-4", Device(GIB, GIB), directory=str(tmp_path), gpu_utilization=0.5
        )
    assert "KVCACHED_GPU_UTILIZATION" in " ".join(r.message for r in caplog.records)
    for led in (first, second, third):
        led.close()
