"""SGLang pools as seen by the kvcached instance (snapshots, limits, reclaim).

Every process that builds an elastic SGLang pool joins its instance
(:func:`kvcached.control.instance.get_instance` with ``engine="sglang"``) with
one :class:`SGLangPoolSource` per pool, watched through the pool's ledger
account. The instance's control thread calls the source; SGLang's scheduler
thread owns the pool. So the source only does what is safe from another
thread:

* :meth:`~SGLangPoolSource.pool_usage` reads counters (the block manager's
  lock makes the reading consistent);
* :meth:`~SGLangPoolSource.apply_limit` and the first step of
  :meth:`~SGLangPoolSource.reclaim` (unmapping idle and reserved pages) go
  through the page pool, which is thread-safe;
* evicting unreferenced prefix-cache blocks touches SGLang's radix tree, so
  :meth:`~SGLangPoolSource.reclaim` only *asks* for it; the scheduler thread
  evicts at the start of its next round (under TP every rank evicts the
  largest amount any rank asked for, agreed in the round's one collective) and
  unmaps the pages that emptied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcached.control.instance import PoolUsage

if TYPE_CHECKING:
    from kvcached.integrations.sglang.elastic_kv import ElasticKV
    from kvcached.integrations.sglang.slots import SlotAllocator


class SGLangPoolSource:
    """:class:`kvcached.control.instance.PoolSource` of one elastic SGLang pool.

    ``slots`` (the allocator's state) and ``prefix_cache_tokens`` (the radix
    cache's evictable tokens) are attached once the allocator and the
    scheduler exist; until then reclaim only unmaps idle pages.
    """

    def __init__(self, kv: ElasticKV) -> None:
        self.kv = kv
        self.name = kv.name
        info = kv.driver.info()
        self.gpu, self.backend = info.pci_bus_id, info.backend
        g = kv.cache.geometry
        self.token_bytes = g.page_bytes // (g.blocks_per_page * kv.shape.block_tokens)
        self.slots: SlotAllocator | None = None
        self.prefix_cache_tokens: Callable[[], int] | None = None

    def pool_usage(self) -> PoolUsage:
        u = self.kv.cache.usage()
        cached = self.prefix_cache_tokens() if self.prefix_cache_tokens is not None else 0
        return PoolUsage.of_cache(
            self.name,
            self.gpu,
            self.backend,
            u,
            prefix_cache_bytes=cached * self.token_bytes,
            misses=self.slots.misses if self.slots is not None else 0,
            short_bytes=self.kv.cache.blocks.last_miss_pages * self.kv.cache.geometry.page_bytes,
        )

    def apply_limit(self, limit_bytes: int | None) -> None:
        self.kv.cache.set_limit(limit_bytes or None)

    def hold_reserve(self, seconds: float) -> None:
        self.kv.cache.pages.hold_reserve(seconds)  # the page pool: thread-safe

    def reclaim(self, nbytes: int) -> int:
        """Unmap idle pages now; ask the scheduler to evict prefix-cache
        tokens for the rest (released within a round). Returns bytes released now."""
        cache = self.kv.cache
        before = cache.usage().bytes_mapped
        cache.trim()
        released = max(0, before - cache.usage().bytes_mapped)
        if released < nbytes and self.slots is not None:
            short = nbytes - released
            self.slots.request_eviction(-(-short // self.token_bytes))
        return released

    def leave(self) -> None:
        """Leave the instance (the pool is closing)."""
        unregister_pool(self)


def register_pool(kv: ElasticKV, engine_version: str = "") -> SGLangPoolSource:
    """Join this process' instance with ``kv`` (watched through its ledger account)."""
    from kvcached.control.instance import get_instance

    source = SGLangPoolSource(kv)
    watch: Any = kv.budget if hasattr(kv.budget, "limit_revision") else None
    get_instance("sglang", engine_version, ipc_name=kv.ipc_name).add_pool(source, watch)
    return source


def unregister_pool(source: SGLangPoolSource) -> None:
    from kvcached.control import instance as inst

    if inst._instance is not None:
        inst._instance.remove_pool(source)
