"""A kvcached pool on the host backend with its own ledger and instance, for the
control layer's tests: what an engine process holds, without an engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvcached.control.instance import Instance, KVCachePool
from kvcached.driver.host import HostDriver
from kvcached.ledger import Ledger
from kvcached.memory.cache import KVCache
from kvcached.memory.spec import KVCacheSpec
from kvcached.units import MIB

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_heads=4, head_dim=64, dtype=torch.float16)


@dataclass
class HostPool:
    cache: KVCache
    budget: object
    instance: Instance


@contextmanager
def host_pool(
    directory: str,
    name: str,
    *,
    index: int,
    capacity_bytes: int = 256 * MIB,
    min_reserved: int = 2,
    max_reserved: int = 4,
    tick_s: float = 0.05,
) -> Iterator[HostPool]:
    """A pool of ``capacity_bytes`` on host device ``index`` (its ledger in
    ``directory``) joined to instance ``name``. One handle per page: a coalesced
    extent goes back only once all its pages are idle, which would blur the exact
    byte counts these tests check."""
    driver = HostDriver(index=index, capacity=512 * MIB)
    ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=directory)
    budget = ledger.register_pool(name)
    cache = KVCache(
        SPEC,
        driver=driver,
        budget=budget,
        capacity_bytes=capacity_bytes,
        min_reserved=min_reserved,
        max_reserved=max_reserved,
        max_handle_bytes=0,
    )
    instance = Instance(name, engine="test", tick_s=tick_s)
    instance.add_pool(KVCachePool(cache), budget)
    try:
        yield HostPool(cache, budget, instance)
    finally:
        instance.close()
        cache.close()
        budget.close()
        ledger.close()
