"""DriverFreeBudget: the driver's free memory minus the safety margin, adjusted
by this pool's own grants and refunds between samples."""

from __future__ import annotations

import time

import pytest
import torch

from kvcached.driver.host import HostDriver
from kvcached.errors import ConfigError
from kvcached.memory import DriverFreeBudget, KVCache, KVCacheSpec, PhysicalBudget
from kvcached.units import MIB
from tests.memory.kvmem_helpers import HOST_INDEX


class FixedFree(HostDriver):
    """A host device whose free memory the test sets."""

    free = 800 * MIB

    def mem_info(self):
        self.samples = getattr(self, "samples", 0) + 1
        return self.free, 1000 * MIB


def test_headroom_is_free_minus_margin_and_tracks_own_grants():
    d = FixedFree(HOST_INDEX, capacity=1000 * MIB)
    b = DriverFreeBudget(d, utilization=0.9, sample_interval_s=60)
    assert isinstance(b, PhysicalBudget)
    assert b.margin == 100 * MIB
    assert b.headroom() == 700 * MIB
    assert b.grant(300 * MIB)
    assert b.headroom() == 400 * MIB
    assert not b.grant(401 * MIB), "a grant beyond the headroom is a denial"
    b.refund(100 * MIB)
    assert b.headroom() == 500 * MIB
    samples = d.samples
    for _ in range(1000):
        b.headroom()
    assert d.samples == samples, "headroom() sampled the driver on the hot path"


def test_a_stale_sample_is_refreshed():
    d = FixedFree(HOST_INDEX, capacity=1000 * MIB)
    b = DriverFreeBudget(d, utilization=0.9, sample_interval_s=0.01)
    assert b.grant(200 * MIB)
    d.free = 600 * MIB  # the grant's memory now shows in the driver
    time.sleep(0.02)
    assert b.headroom() == 500 * MIB
    d.free = 50 * MIB  # another process took memory: headroom floors at 0
    time.sleep(0.02)
    assert b.headroom() == 0 and not b.grant(1)


def test_closed_budget_grants_nothing():
    b = DriverFreeBudget(FixedFree(HOST_INDEX, capacity=1000 * MIB), utilization=0.9)
    b.close()
    b.close()
    assert not b.grant(MIB)


@pytest.mark.parametrize("bad", [0.0, 1.5, -1])
def test_utilization_is_checked(bad):
    with pytest.raises(ConfigError) as err:
        DriverFreeBudget(FixedFree(HOST_INDEX, capacity=1000 * MIB), utilization=bad)
    assert err.value.variable == "utilization"


def test_cache_defaults_to_the_driver_budget_and_respects_the_margin():
    d = FixedFree(HOST_INDEX, capacity=1000 * MIB)
    d.free = 110 * MIB
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=1, head_dim=64, dtype=torch.float16)
    with KVCache(
        spec, driver=d, num_blocks=64 * 1024, background=False, min_reserved=0, max_reserved=0
    ) as kv:
        assert isinstance(kv.budget, DriverFreeBudget)
        # 110 MiB free - 50 MiB margin (utilization 0.95) = 60 MiB: 15 pages of
        # 4 MiB (K and V), one of which already holds the null block
        assert kv.geometry.page_bytes == 4 * MIB
        bpp = kv.blocks_per_page
        assert kv.available_size() == 15 * bpp - 1
        assert kv.alloc(15 * bpp) is None
        assert kv.alloc(15 * bpp - 1) is not None
