"""Coalescing and the reserved pool are sized for the device by default, so a
cache on a small device strands little memory that other instances could use."""

from __future__ import annotations

import os

import pytest
import torch

from kvcached.driver.host import HostDriver
from kvcached.memory import KVCache, KVCacheSpec
from kvcached.memory.cache import STRAND_SHARE, sized_for_device
from kvcached.memory.mapper import DEFAULT_MAX_HANDLE_BYTES
from kvcached.units import GIB, MIB

# 4 MiB pages: one layer, K and V of 2 MiB each (the demo's cache)
SPEC = KVCacheSpec(num_layers=1, block_size=16, num_heads=8, head_dim=128, dtype=torch.float16)


@pytest.mark.parametrize(
    "total, expect",
    [
        (64 * MIB, (1 * MIB, 0, 0)),  # a handle under a page: coalescing and the pool off
        (1 * GIB, (16 * MIB, 4, 4)),
        (4 * GIB, (64 * MIB, 5, 10)),  # from 4 GiB up the defaults stand
        (141 * GIB, (64 * MIB, 5, 10)),
    ],
)
def test_defaults_hold_at_most_a_sixty_fourth_of_the_device(total, expect):
    got = sized_for_device(total, 4 * MIB, DEFAULT_MAX_HANDLE_BYTES, 5, 10)
    assert got == expect
    handle, lo, hi = got
    assert handle <= total // STRAND_SHARE and hi * 4 * MIB <= total // STRAND_SHARE
    assert 0 <= lo <= hi


def test_a_cache_on_a_small_device_does_not_coalesce_or_keep_a_pool():
    driver = HostDriver(index=300_000 + os.getpid(), capacity=64 * MIB)
    with KVCache(SPEC, driver=driver, capacity_bytes=64 * MIB, background=False) as kv:
        assert kv.geometry.page_bytes == 4 * MIB
        assert kv.mapper.max_run_pages == 1
        assert (kv.pages.min_reserved, kv.pages.max_reserved) == (0, 0)
        blocks = kv.alloc(3 * kv.blocks_per_page)  # three pages at once: three extents
        assert blocks is not None
        pages = sorted({kv.page_of(b) for b in blocks})
        assert [kv.mapper.extent_of(p) for p in pages] == [(p, 1) for p in pages]
        kv.free(blocks)
        assert kv.pages.n_idle == 0  # no pool: freed pages go back at once


def test_explicit_settings_are_kept_on_a_small_device():
    driver = HostDriver(index=310_000 + os.getpid(), capacity=64 * MIB)
    with KVCache(
        SPEC,
        driver=driver,
        capacity_bytes=64 * MIB,
        background=False,
        max_handle_bytes=16 * MIB,
        min_reserved=1,
        max_reserved=2,
    ) as kv:
        assert kv.mapper.max_run_pages == 8  # per-layer: 2 MiB handles
        assert (kv.pages.min_reserved, kv.pages.max_reserved) == (1, 2)
