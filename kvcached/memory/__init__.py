"""The engine-facing memory core: virtual KV tensors, pages, blocks.

Most callers want :class:`KVCache`, which assembles the parts for one KV cache
group; each part is usable on its own:

========================  ===================================================
:class:`KVCacheSpec`      layers, K/V buffers, block size, cell shape, dtype
:func:`plan_pages`        blocks per page and number of pages (pure math)
:class:`VirtualKVTensors` address space and attention views of it
:class:`PageShape`        what the page layer reads of a geometry
:class:`PagedTensors`     what the mapper needs of the tensors it maps under
:class:`PageMapper`       map / unmap pages: budget, driver, undo, quarantine
:class:`PageBackend`      what the page pool needs of a mapper (TP proxies)
:class:`PageAllocator`    page pool: idle reserve, refill thread, cap, trim
:class:`BlockManager`     ``alloc`` / ``free`` / ``available_size`` / ``usage``
:class:`DriverFreeBudget` the :class:`PhysicalBudget` of a process with no ledger
========================  ===================================================
"""

from kvcached.errors import CapacityError
from kvcached.memory.blocks import BlockManager, MemoryUsage
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.cache import KVCache
from kvcached.memory.free_budget import DriverFreeBudget
from kvcached.memory.mapper import PageBackend, PageMapper
from kvcached.memory.pages import PageAllocator
from kvcached.memory.spec import (
    KVCacheSpec,
    KVLayout,
    PageGeometry,
    PageShape,
    plan_pages,
    resolve_layout,
)
from kvcached.memory.tensors import PagedTensors, VirtualKVTensors

__all__ = [
    "BlockManager",
    "CapacityError",
    "DriverFreeBudget",
    "KVCache",
    "KVCacheSpec",
    "KVLayout",
    "MemoryUsage",
    "PageAllocator",
    "PageBackend",
    "PageGeometry",
    "PageMapper",
    "PageShape",
    "PagedTensors",
    "PhysicalBudget",
    "VirtualKVTensors",
    "plan_pages",
    "resolve_layout",
]
