"""The ``kv`` sleep level's calls on a real instance in this process: a real
KVCache on the host backend, charged to a real ledger, with its control thread."""

from __future__ import annotations

import time

import pytest

from kvcached.control.limits import set_limit
from kvcached.serve import sleep as kv
from kvcached.units import MIB
from tests.control.host_pool import host_pool

NAME = "serve-kv-test"


@pytest.fixture
def instance(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    with host_pool(str(tmp_path), NAME, index=33, capacity_bytes=128 * MIB) as pool:
        yield pool.cache


def held() -> int:
    reading = kv.read_kv(NAME)
    assert reading is not None
    return reading.charged_bytes


@pytest.mark.slow  # waits out real reclaim and wake, ~10 s
def test_sleep_releases_everything_idle_and_wake_restores_the_users_limit(instance):
    cache = instance
    ids = cache.alloc(cache.blocks_per_page * 3)
    assert ids is not None
    cache.free(ids)
    set_limit(
        NAME, 96 * MIB, configured_dir=kv.configured_ledger_dir()
    )  # the user's own limit, to come back on wake
    before = kv.kv_sleep(NAME, settle_s=5.0)
    assert before is not None and before.charged_bytes > 0 and before.limit_bytes == 96 * MIB
    assert before.ledgers and before.ledgers[0].endswith(before.devices[0])
    # a KVCache keeps its null block's page (only vLLM's planner parks it)
    assert kv.wait_released(NAME, 5.0) <= cache.geometry.page_bytes
    assert cache.alloc(cache.blocks_per_page * 2) is None  # held: growth is a miss
    began = time.monotonic()
    assert kv.kv_wake(NAME, before.limit_bytes, before.ledgers)
    assert time.monotonic() - began < 5.0
    reading = kv.read_kv(NAME)
    assert reading is not None and reading.limit_bytes == 96 * MIB
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = cache.alloc(cache.blocks_per_page * 2)  # the control thread applies it within 20 ms
        time.sleep(0.01)
    assert got is not None


def test_a_limit_changed_while_asleep_is_left_alone(instance):
    before = kv.kv_sleep(NAME, settle_s=1.0)
    assert before is not None
    set_limit(
        NAME, 64 * MIB, configured_dir=kv.configured_ledger_dir()
    )  # kvctl limit while it slept
    assert not kv.kv_wake(NAME, 0, before.ledgers)
    reading = kv.read_kv(NAME)
    assert reading is not None and reading.limit_bytes == 64 * MIB


def test_no_instance_is_nothing_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    assert kv.read_kv("nobody-here") is None
    assert kv.kv_sleep("nobody-here") is None
    assert not kv.kv_wake("nobody-here", 0)
    assert kv.retire_dead_pools("nobody-here") == 0


DIE_HOLDING = """
import os, sys
from kvcached.ledger import Ledger

class Device:
    def mem_info(self):
        return 1 << 30, 1 << 30

ledger = Ledger.open("retire-0", Device(), directory=sys.argv[1], gpu_utilization=1.0)
pools = [ledger.register_pool(name) for name in sys.argv[2:]]
assert all(pool.grant(4 << 20) for pool in pools)
os._exit(0)  # no pool closed: an engine whose workers were SIGKILLed
"""


def test_serve_retires_only_its_own_dead_pools_and_quietly(tmp_path, monkeypatch, caplog):
    """What serve stopped itself is routine (nothing at info or above); a dead
    process of another instance is left to the ledger, which names it when it
    retires it."""
    import logging
    import subprocess
    import sys

    from kvcached.ledger.ledger import Ledger

    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    subprocess.run([sys.executable, "-c", DIE_HOLDING, str(tmp_path), "ours", "theirs"], check=True)
    assert kv.read_kv("ours") is not None and kv.read_kv("theirs") is not None
    with caplog.at_level(logging.DEBUG, logger="kvcached"):
        assert kv.retire_dead_pools("ours") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text
    assert "pool 0 of its ended process" in caplog.text  # at debug, for whoever asks
    assert kv.read_kv("ours") is None
    theirs = kv.read_kv("theirs")
    assert theirs is not None and theirs.charged_bytes == 4 << 20  # not serve's to retire
    assert kv.retire_dead_pools("ours") == 0
    caplog.clear()
    ledger = Ledger.open_existing(theirs.ledgers[0])
    try:
        with caplog.at_level(logging.INFO, logger="kvcached"):
            assert ledger.retire_dead() == 1
    finally:
        ledger.close()
    assert "retired pool 1 of a dead process" in caplog.text
    assert kv.read_kv("theirs") is None
