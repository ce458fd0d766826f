"""vLLM's block pool with blocks from kvcached: ``KvcachedBlockPool``.

vLLM 0.32's ``BlockPool`` keeps one ``KVCacheBlock`` per block id and one
intrusive free queue: unhashed free blocks in front (reused first), idle
prefix-cached blocks behind them in LRU order. Here the same class keeps its
blocks, hashes and events, and splits the queue in two:

* free blocks without a hash belong to kvcached's block manager (the
  planner), which packs them into pages and releases pages that empty;
* idle cached blocks (``ref_cnt == 0`` with a hash) stay in vLLM's
  ``FreeKVCacheBlockQueue`` in LRU order, still free to vLLM and still hits.

Rules the pool keeps:

* ``get_num_free_blocks()`` = blocks the planner has ready without growth +
  idle cached blocks. The planner reserved pages right before vLLM's capacity
  check (see :mod:`~kvcached.integrations.vllm.planner`), so the figure is
  exact and ``get_new_blocks`` never grows or fails.
* ``get_new_blocks(n)`` takes ready blocks first and evicts idle cached
  blocks (LRU, dropping their hashes, as natively) only when those run out.
  With memory to spare no cached block is evicted, so the same prompts find
  the same ``cached_tokens`` as natively.
* Idle cached blocks count against ``KVCACHED_MAX_CACHED_TOKENS``: over the
  cap, whole pages are evicted, oldest first (the page whose newest idle
  cached block is oldest); a page left without live blocks goes back to the
  page pool, and then to the device.
* ``reset_prefix_cache()`` returns every idle cached block to the planner and
  releases every idle page.
* Block 0 is vLLM's null block and the planner's: never freed, never moved.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from vllm.v1.core import block_pool as _vllm_block_pool
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached.errors import KVCachedError
from kvcached.integrations.vllm.planner import StepPlanner

_logger = _vllm_block_pool.logger  # vLLM's own log lines keep their source


class KvcachedBlockPool(BlockPool):
    """See the module docstring. ``cap_blocks < 0``: no cap on idle cached blocks."""

    def __init__(
        self,
        planner: StepPlanner,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector=None,
        medium: str | None = None,
        *,
        cap_blocks: int = -1,
    ) -> None:
        kwargs = {} if medium is None else {"medium": medium}
        super().__init__(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
            **kwargs,
        )
        assert num_gpu_blocks == planner.num_blocks, (
            f"invariant: vLLM's {num_gpu_blocks} blocks are the planner's {planner.num_blocks}"
        )
        for block in self.blocks:  # the native queue held every block; ours only idle cached ones
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        # vLLM 0.30+ blocks know their pool (a request may hold another pool's
        # blocks) and released blocks may have reuse watchers; 0.26 has neither.
        self._owned_blocks = hasattr(self.blocks[0], "pool")
        if not hasattr(self, "_reuse_watchers"):
            self._reuse_watchers = {}
        self.planner = planner
        self.cap_blocks = cap_blocks
        self._bpp = planner.blocks_per_page
        self._idle_seq = [-1] * num_gpu_blocks  # when a block became idle cached; -1: it is not
        self._seq = 0
        self._page_heap: list[tuple[int, int]] = []  # (newest idle seq in the page, page)
        self.evicted_pages = 0
        # Set by the allocate_slots wrapper around vLLM's capacity check: the
        # blocks vLLM keeps back beyond the need (reserved + watermark).
        self.alloc_extra: int | None = None

    # -- capacity ------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.planner.ready_blocks() + self.free_block_queue.num_free_blocks

    @property
    def num_idle_cached(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Blocks in use over what this engine could use now (in use + free +
        still growable): ``kv_cache_usage_perc`` of an elastic cache."""
        used = self.planner.live_blocks() - self.free_block_queue.num_free_blocks
        total = used + self.get_num_free_blocks() + self.planner.growable_blocks()
        return used / total if total > 0 else 0.0

    def reserve(self, target: int) -> None:
        """Right before vLLM's capacity check: have ``target`` blocks ready
        without growth if memory allows (see the planner); when neither that
        nor the idle cached blocks cover it, the check fails: a miss."""
        planner = self.planner
        if not planner.reserve(target):
            short = target - planner.ready_blocks() - self.free_block_queue.num_free_blocks
            if short > 0:
                planner.note_miss(short)

    # -- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        planner = self.planner
        queue = self.free_block_queue
        ids = None
        while True:
            short = num_blocks - planner.ready_blocks()
            if short <= 0:
                ids = planner.alloc(num_blocks)
                if ids is not None:
                    break
                short = 1  # readiness was released under us (an emptied page left): evict more
            if queue.num_free_blocks == 0:
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            self._drop_idle(queue.popleft_n(min(short, queue.num_free_blocks)))
        blocks = self.blocks
        ret = [blocks[i] for i in ids]
        if self._reuse_watchers:
            self._notify_reuse(ret)
        metrics = self.metrics_collector
        for block in ret:
            assert block.ref_cnt == 0 and block.block_hash is None, (
                f"invariant: a planner block is free and unhashed: {block}"
            )
            block.ref_cnt = 1
            if metrics:
                metrics.on_block_allocated(block)
        return ret

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        to_planner: list[int] = []
        to_cache: list[KVCacheBlock] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        caching = self.enable_caching
        owned = self._owned_blocks
        for block in ordered_blocks:
            if owned and block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None or not caching:
                    to_planner.append(block.block_id)
                else:
                    to_cache.append(block)
        if to_planner:
            self.planner.free(to_planner)
        if to_cache:
            self.free_block_queue.append_n(to_cache)
            self._mark_idle(to_cache)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        idle_seq = self._idle_seq
        metrics = self.metrics_collector
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                if block.prev_free_block is not None:  # idle cached (or unpinned): in the queue
                    self.free_block_queue.remove(block)
                    idle_seq[block.block_id] = -1
                else:  # free without a hash: the planner's, handed out by id
                    self._claim(block)
            block.ref_cnt += 1
            if metrics:
                metrics.on_block_accessed(block)

    def _claim(self, block: KVCacheBlock) -> None:
        """vLLM takes the free block ``block`` itself (as its pool's ``touch``
        does with any free block): the planner hands it out, evicting idle
        cached pages if its page needs memory that is not there."""
        planner = self.planner
        while not planner.blocks.claim(block.block_id):
            if self.evict_oldest_page() == 0:
                planner.note_miss()
                raise KVCachedError(
                    f"touch(): free block {block.block_id} lies in a page that cannot be mapped "
                    "now (the budget, the instance limit or the device is full); vLLM's own "
                    "pool would have handed it out"
                )
            planner.pages.trim()

    def unpin_blocks(
        self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]
    ) -> None:
        """As vLLM's: released blocks join the tail of the queue of idle
        blocks (last to be evicted), count as free and stay readable until the
        pool reuses them or drops them to the planner, when ``on_reuse`` fires."""
        released: list[KVCacheBlock] = []
        for block in blocks:
            assert block.ref_cnt > 0 and not block.is_null, (
                f"invariant: only a held block can be unpinned: {block}"
            )
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        if released:
            self.free_block_queue.append_n(released)
            self._mark_idle(released)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        evicted = super()._maybe_evict_cached_block(block)
        if evicted and block.ref_cnt == 0 and block.prev_free_block is not None:
            # An idle cached block lost its hash (KV connector, Mamba): it is
            # now a plain free block, which the planner owns.
            self.free_block_queue.remove(block)
            self._idle_seq[block.block_id] = -1
            if self._reuse_watchers:
                self._notify_reuse([block])
            self.planner.free([block.block_id])
        return evicted

    def reset_prefix_cache(self) -> bool:
        in_use = self.planner.live_blocks() - self.free_block_queue.num_free_blocks
        if in_use != 0:
            _logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet", in_use
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        idle = self.free_block_queue.popleft_n(self.free_block_queue.num_free_blocks)
        for block in self.blocks:
            block.reset_hash()
        ids = [block.block_id for block in idle]
        for i in ids:
            self._idle_seq[i] = -1
        self._page_heap.clear()
        if ids:
            self.planner.free(ids)
        self.planner.pages.trim()
        if self.metrics_collector:
            self.metrics_collector.reset()
        _logger.info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            from vllm.distributed.kv_events import AllBlocksCleared

            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- idle cached blocks ------------------------------------------------------------------
    def _mark_idle(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks just became idle cached (already in the queue)."""
        idle_seq, bpp = self._idle_seq, self._bpp
        seq = self._seq
        pages: dict[int, int] = {}  # page -> the newest seq given to it here
        for block in blocks:
            seq += 1
            idle_seq[block.block_id] = seq
            pages[block.block_id // bpp] = seq
        self._seq = seq
        if self.cap_blocks < 0:
            return
        heap = self._page_heap
        for page, newest in pages.items():  # the newest seq of the page is this one
            heapq.heappush(heap, (newest, page))
        if self.free_block_queue.num_free_blocks > self.cap_blocks:
            self.evict_over_cap()
        elif len(heap) > 4 * max(1, self.free_block_queue.num_free_blocks) + 1024:
            self._rebuild_heap()

    def _page_newest(self, page: int) -> int:
        first = page * self._bpp
        return max(self._idle_seq[first : first + self._bpp])

    def _rebuild_heap(self) -> None:
        pages = {i // self._bpp for i, s in enumerate(self._idle_seq) if s >= 0}
        self._page_heap = [(self._page_newest(p), p) for p in pages]
        heapq.heapify(self._page_heap)

    def _drop_idle(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks already out of the queue lose their hashes and go to the planner
        (whose page may then be unmapped: an unpinned block's reader is told now)."""
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        idle_seq = self._idle_seq
        evict = super()._maybe_evict_cached_block  # not ours: they left the queue already
        ids = []
        for block in blocks:
            evict(block)
            idle_seq[block.block_id] = -1
            ids.append(block.block_id)
        self.planner.free(ids)

    def evict_oldest_page(self) -> int:
        """Evict every idle cached block of the page whose newest one is the
        oldest; returns how many were evicted (0: none left)."""
        heap, bpp, idle_seq = self._page_heap, self._bpp, self._idle_seq
        if not heap and self.free_block_queue.num_free_blocks:
            self._rebuild_heap()
            heap = self._page_heap
        while heap:
            seq, page = heapq.heappop(heap)
            newest = self._page_newest(page)
            if newest < 0:
                continue  # nothing idle there any more
            if newest != seq:
                heapq.heappush(heap, (newest, page))  # its newest block left: re-file it
                continue
            first = page * bpp
            victims = [self.blocks[i] for i in range(first, first + bpp) if idle_seq[i] >= 0]
            for block in victims:
                self.free_block_queue.remove(block)
            self._drop_idle(victims)
            self.evicted_pages += 1
            return len(victims)
        return 0

    def evict_over_cap(self) -> int:
        """Evict whole pages of idle cached blocks until they fit the cap."""
        evicted = 0
        while self.free_block_queue.num_free_blocks > self.cap_blocks:
            n = self.evict_oldest_page()
            if n == 0:
                break
            evicted += n
        return evicted

    def reclaim(self, nbytes: int) -> int:
        """Release at least ``nbytes`` per rank of idle memory if there is that
        much: idle pages first, then whole pages of idle cached blocks, oldest
        first. Never a block in use. Returns the bytes per rank released."""
        planner = self.planner
        before = planner.mapped_bytes()
        planner.pages.trim()
        while before - planner.mapped_bytes() < nbytes:
            if self.evict_oldest_page() == 0:
                break
            planner.pages.trim()
        return before - planner.mapped_bytes()

    def prefix_cache_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks
