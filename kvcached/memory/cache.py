"""One KV cache group, assembled: virtual tensors, mapper, page pool, blocks."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcached.driver.base import Driver
from kvcached.log import get_logger
from kvcached.memory.blocks import BlockManager
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.free_budget import DriverFreeBudget
from kvcached.memory.mapper import DEFAULT_MAX_HANDLE_BYTES, PageMapper
from kvcached.memory.pages import PageAllocator
from kvcached.memory.spec import KVCacheSpec, KVLayout, PageGeometry, plan_pages, resolve_layout
from kvcached.memory.tensors import VirtualKVTensors

if TYPE_CHECKING:
    from kvcached.config import Config

log = get_logger("kvcached.memory")

#: The share of a device that one cache may hold in coalesced runs' handles
#: and, separately, in its reserved pool by default. Both hold memory that no
#: other instance can use (a run is released only once all its pages are
#: idle; a pool keeps idle pages mapped), so on a small device the defaults
#: (64 MiB handles, 5..10 pages) would strand most of it: on a 64 MiB device
#: two demo instances delayed 54 of 213 requests against 16 for a static
#: split. On a GPU of 16 GiB or more the cap never binds.
STRAND_SHARE = 64


def sized_for_device(
    total_bytes: int, page_bytes: int, max_handle_bytes: int, min_reserved: int, max_reserved: int
) -> tuple[int, int, int]:
    """``(max_handle_bytes, min_reserved, max_reserved)`` capped so that each
    of a run's handle and the reserved pool holds at most ``1/STRAND_SHARE``
    of a device of ``total_bytes`` (a handle below one page turns coalescing
    off; a pool below one page turns the pool off)."""
    share = total_bytes // STRAND_SHARE
    max_handle_bytes = min(max_handle_bytes, share)
    max_reserved = min(max_reserved, share // page_bytes)
    return max_handle_bytes, min(min_reserved, max_reserved), max_reserved


def _shutdown(
    blocks: BlockManager | None,
    pages: PageAllocator | None,
    tensors: VirtualKVTensors | None,
    budget: PhysicalBudget | None,
) -> None:
    """Close in reverse order of construction. The address space is given
    back only when no page stays mapped (a quarantined page keeps it)."""
    if blocks is not None:
        blocks.close()
    clean = True
    if pages is not None:
        clean = pages.close()
    if tensors is not None:
        if clean:
            tensors.close()
        else:
            log.error(
                "KV cache closed with quarantined pages still mapped; its address "
                "space is kept so the mappings stay valid"
            )
    if budget is not None:
        budget.close()


class KVCache:
    """A KV cache group ready for an engine.

    Parts, each usable on its own (see their modules):

    * :attr:`tensors` (:class:`VirtualKVTensors`): the address space and the
      views attention kernels read (``flash_attn_view``, ``flashinfer_view``,
      ``mla_view``, ``raw_buffer``, ...);
    * :attr:`mapper` (:class:`PageMapper`): map / unmap pages against the budget;
    * :attr:`pages` (:class:`PageAllocator`): the page pool, its refill thread
      and the cap;
    * :attr:`blocks` (:class:`BlockManager`): ``alloc`` / ``free`` /
      ``available_size`` / ``usage`` for the scheduler, bound here as methods.

    Arguments: ``config`` (the settings every argument left unset defaults
    from: a :class:`~kvcached.config.Config` that the caller parsed, e.g.
    :func:`kvcached.config.get_config`; ``None``: the documented defaults, as
    this layer reads no environment), ``driver`` (default: the process' driver
    for ``config.driver``), ``budget`` (default: :class:`DriverFreeBudget` at
    ``config.gpu_utilization``; pass
    the ledger's pool account, and pass one budget to every group of a model so
    they share memory), ``layout`` (``KVLayout``, a bool for contiguous, or
    ``None`` for ``config.contiguous_layout``), capacity as ``num_blocks`` or
    ``capacity_bytes`` (default: the device's total memory), ``page_size``
    (default ``config.page_size``), ``min_reserved`` / ``max_reserved``
    (default ``config.min/max_reserved_pages``), ``background`` (refill on a
    thread), ``max_handle_bytes`` (coalescing; 0 = one page per handle;
    default 64 MiB). Defaults left unset are capped for the device (see
    :func:`sized_for_device`): on a device under 4 GiB a cache coalesces
    less and keeps a smaller pool, so it strands little memory;
    ``reserve_null_block``, ``thread_safe`` (``False`` when one scheduler
    thread is the only caller of ``alloc`` / ``free``: no lock), ``before_unmap``
    (default: ``driver.synchronize``).

    :meth:`close` (idempotent, also on garbage collection) unmaps everything
    and gives back the address space; a budget it created is closed too.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        driver: Driver | None = None,
        budget: PhysicalBudget | None = None,
        layout: KVLayout | bool | None = None,
        num_blocks: int | None = None,
        capacity_bytes: int | None = None,
        page_size: int | None = None,
        min_reserved: int | None = None,
        max_reserved: int | None = None,
        background: bool = True,
        max_handle_bytes: int | None = None,
        reserve_null_block: bool = True,
        thread_safe: bool = True,
        before_unmap: Callable[[], None] | None = None,
        config: Config | None = None,
    ) -> None:
        from kvcached.config import defaults
        from kvcached.driver import get_driver

        config = defaults() if config is None else config
        self.spec = spec
        self.driver = driver = driver if driver is not None else get_driver(config=config)
        if not isinstance(layout, KVLayout):
            layout = resolve_layout(config.contiguous_layout if layout is None else layout)
        if num_blocks is None and capacity_bytes is None:
            capacity_bytes = driver.info().total_bytes
        self.geometry: PageGeometry = plan_pages(
            spec,
            layout=layout,
            granularity=driver.granularity,
            page_size=config.page_size if page_size is None else page_size,
            num_blocks=num_blocks,
            capacity_bytes=capacity_bytes,
        )
        sized = sized_for_device(
            driver.info().total_bytes,
            self.geometry.page_bytes,
            DEFAULT_MAX_HANDLE_BYTES,
            config.min_reserved_pages,
            max(config.max_reserved_pages, config.min_reserved_pages),
        )
        if max_handle_bytes is None:
            max_handle_bytes = sized[0]
        if min_reserved is None and max_reserved is None:
            min_reserved, max_reserved = sized[1], sized[2]
        elif min_reserved is None:
            min_reserved = min(sized[1], max_reserved)
        elif max_reserved is None:
            max_reserved = max(sized[2], min_reserved)
        owned_budget = None
        tensors = pages = blocks = None
        try:
            if budget is None:
                budget = owned_budget = DriverFreeBudget(
                    driver,
                    utilization=config.gpu_utilization,
                    sample_interval_s=config.calibration_interval_s,
                )
            tensors = VirtualKVTensors(driver, spec, self.geometry)
            mapper = PageMapper(
                tensors, budget, max_handle_bytes=max_handle_bytes, before_unmap=before_unmap
            )
            pages = PageAllocator(
                mapper, min_reserved=min_reserved, max_reserved=max_reserved, background=background
            )
            blocks = BlockManager(
                pages, reserve_null_block=reserve_null_block, thread_safe=thread_safe
            )
        except BaseException:
            _shutdown(blocks, pages, tensors, owned_budget)  # undo in reverse
            raise
        self.budget = budget
        self.tensors = tensors
        self.mapper = mapper
        self.pages = pages
        self._bind(blocks)
        self._finalizer = weakref.finalize(self, _shutdown, blocks, pages, tensors, owned_budget)

    def _bind(self, blocks: BlockManager) -> None:
        """The scheduler's calls, bound once (no extra call layer on the hot path)."""
        self.blocks = blocks
        self.alloc = blocks.alloc
        self.free = blocks.free
        self.available_size = blocks.available_size
        self.usage = blocks.usage
        self.trim = blocks.trim
        self.set_limit = blocks.set_limit
        self.resize = blocks.resize

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def blocks_per_page(self) -> int:
        return self.geometry.blocks_per_page

    def page_of(self, block: int) -> int:
        """The page that holds ``block`` in every layer and buffer."""
        return block // self.geometry.blocks_per_page

    def close(self) -> None:
        """Unmap every page, give back the address space. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"<KVCache {g.layout.value} layers={g.num_layers} blocks={g.num_blocks} "
            f"pages={g.num_pages}x{g.page_bytes} driver={self.driver!r}>"
        )
