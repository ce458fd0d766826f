"""An instance in this process: snapshot of its pools, and limits from outside."""

from __future__ import annotations

import fcntl
import glob
import os
import time

import pytest

from kvcached.control.instance import Instance, KVCachePool
from kvcached.control.limits import ledger_snapshots, set_limit
from kvcached.control.snapshot import read_snapshots
from kvcached.driver.host import HostDriver
from kvcached.errors import InstanceNotFoundError, LedgerBusyError
from kvcached.ledger import Ledger
from kvcached.ledger.snapshot import LimitStatus
from kvcached.memory.cache import KVCache
from kvcached.units import MIB
from tests.control.host_pool import SPEC, host_pool


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    with host_pool(str(tmp_path), "limit-test", index=31) as pool:
        yield pool.cache, pool.instance, str(tmp_path)


def wait_until(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_snapshot_shows_the_pool(setup):
    cache, instance, _ = setup
    ids = cache.alloc(300)
    assert ids is not None
    assert wait_until(
        lambda: any(
            s.instance == "limit-test" and s.data["pools"][0]["blocks_used"] == 300
            for s in read_snapshots()
        )
    )
    cache.free(ids)


def test_lower_limit_releases_idle_pages_within_seconds_and_raise_regrows(setup):
    cache, instance, directory = setup
    page = cache.geometry.page_bytes
    ids = cache.alloc(256 * 10)  # ten full pages
    assert ids is not None
    cache.free(ids[256 * 2 :])  # two pages stay in use
    result = set_limit("limit-test", 3 * page, directory=directory, wait_s=5)
    assert result.status == LimitStatus.APPLIED, result
    charged = ledger_snapshots(directory)[0].instance("limit-test").charged
    assert charged <= 3 * page
    assert cache.usage().blocks_used == 512  # in-use blocks untouched
    assert cache.alloc(256 * 4) is None  # growth past the limit is a miss
    assert set_limit("limit-test", None, directory=directory).status == LimitStatus.APPLIED
    assert wait_until(lambda: cache.alloc(256 * 4) is not None)
    assert cache.usage().bytes_mapped > 3 * page


def test_stale_and_conflicting_revisions_are_reported(setup):
    _, _, directory = setup
    set_limit("limit-test", 128 * MIB, directory=directory)
    second = set_limit("limit-test", 64 * MIB, directory=directory)
    rev = second.devices[0].revision
    assert rev == 2
    assert (
        set_limit("limit-test", 32 * MIB, revision=1, directory=directory).status
        == LimitStatus.STALE
    )
    assert (
        set_limit("limit-test", 32 * MIB, revision=rev, directory=directory).status
        == LimitStatus.CONFLICT
    )
    assert (
        set_limit("limit-test", 64 * MIB, revision=rev, directory=directory).status
        == LimitStatus.APPLIED
    )


def test_a_held_data_lock_is_reported_busy_naming_its_holder(setup):
    """set_limit reads each ledger through a snapshot; one taken without the
    data lock (held past ``timeout``) is refused with the ledger's busy error."""
    _cache, _instance, d = setup
    (path,) = glob.glob(os.path.join(d, "kvcached-ledger-*"))
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another description: excludes the ledger's
        with pytest.raises(LedgerBusyError, match=rf"held by pid {os.getpid()} \(") as err:
            set_limit("limit-test", 64 * MIB, directory=d, timeout=0.05)
        assert err.value.holder == os.getpid()
    finally:
        os.close(fd)
    assert set_limit("limit-test", 64 * MIB, directory=d).status is LimitStatus.APPLIED


def test_unknown_instance(setup):
    _, _, directory = setup
    with pytest.raises(InstanceNotFoundError, match="no-such"):
        set_limit("no-such", 64 * MIB, directory=directory)


def test_reclaim_evicts_unreferenced_prefix_cache_blocks_but_never_blocks_in_use(
    tmp_path, monkeypatch
):
    """A limit below what idle pages can give back: the instance asks the engine
    to drop its unreferenced prefix-cache blocks, and stops at the blocks in use."""
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    driver = HostDriver(index=32, capacity=512 * MIB)
    ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=str(tmp_path))
    budget = ledger.register_pool("prefix-test")
    cache = KVCache(
        SPEC,
        driver=driver,
        budget=budget,
        capacity_bytes=256 * MIB,
        min_reserved=0,
        max_reserved=0,
        max_handle_bytes=0,
        background=False,
    )
    bpp = cache.blocks_per_page
    running = cache.alloc(bpp * 2 - 1)  # with the null block: pages 0 and 1
    cached = cache.alloc(bpp * 4)  # pages 2..5: a prefix cache nobody references
    asked = []

    def evict(nbytes):
        asked.append(nbytes)
        n = min(len(cached), -(-nbytes // cache.geometry.page_bytes) * bpp)
        cache.free([cached.pop() for _ in range(n)])
        return n * cache.geometry.page_bytes // bpp

    instance = Instance("prefix-test", engine="test", start=False)
    source = KVCachePool(
        cache,
        evict_cached=evict,
        prefix_cache_bytes=lambda: len(cached) * cache.geometry.page_bytes // bpp,
    )
    instance.add_pool(source, budget)
    try:
        page = cache.geometry.page_bytes
        assert source.pool_usage().prefix_cache_bytes == 4 * page
        ledger.set_limit("prefix-test", 3 * page, 1)
        instance.enforce()  # sees the new revision: caps the pool (nothing idle to release)
        assert not asked
        released = instance.enforce()  # still over: evict, then unmap what emptied
        assert asked and released >= 3 * page
        assert budget.instance_charged() <= 3 * page
        ledger.set_limit("prefix-test", page, 2)  # below what is in use
        instance.enforce()
        instance.enforce()
        assert cached == []  # every unreferenced cached block went
        assert cache.usage().blocks_used == bpp * 2 - 1  # the running ones are intact
        assert all(cache.blocks.is_live(b) for b in running)
        assert budget.instance_charged() == 2 * page  # the pages in use, and no more
    finally:
        instance.close()
        cache.close()
        budget.close()
        ledger.close()


class _FailingFlushWatch:
    """A ledger account whose refund flush fails while ``failing`` (fake: the failure
    of a real ledger's flush cannot be provoked on demand)."""

    limit = 1 * MIB
    limit_revision = 1

    def __init__(self) -> None:
        self.failing = True
        self.charged = 10 * MIB

    def instance_charged(self) -> int:
        return self.charged

    def flush(self) -> None:
        if self.failing:
            raise OSError("ledger file gone")


class _IdleSource:
    def __init__(self) -> None:
        self.reclaimed: list[int] = []

    def pool_usage(self):
        from kvcached.control.instance import PoolUsage

        return PoolUsage(name="kv", gpu="host-9", backend="host")

    def apply_limit(self, limit_bytes):
        pass

    def reclaim(self, nbytes: int) -> int:
        self.reclaimed.append(nbytes)
        return 0


def test_a_failed_refund_flush_is_logged_once_and_reclaim_goes_on(caplog):
    import logging

    logger = logging.getLogger("kvcached")
    logger.addHandler(caplog.handler)  # kvcached's logger does not propagate
    try:
        instance = Instance("flush-test", engine="test", start=False)
        watch, source = _FailingFlushWatch(), _IdleSource()
        instance.add_pool(source, watch)  # its first pass only passes the limit on
        caplog.clear()
        for _ in range(3):
            instance.enforce()
        assert source.reclaimed == [9 * MIB] * 3  # the failure did not stop reclaim
        failed = [r for r in caplog.records if "refund flush" in r.getMessage()]
        assert len(failed) == 1 and "ledger file gone" in failed[0].getMessage()
        watch.failing = False
        instance.enforce()
        watch.failing = True
        instance.enforce()  # a new failure after a success is logged again
        assert len([r for r in caplog.records if "refund flush" in r.getMessage()]) == 2
        instance.close()
    finally:
        logger.removeHandler(caplog.handler)
