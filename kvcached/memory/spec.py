"""What a KV cache looks like, and how its blocks fall into pages.

:class:`KVCacheSpec` describes one group of same-shaped attention layers (the
engine's words: layers, K/V buffers per layer, tokens per block, per-token cell
shape, dtype). :func:`plan_pages` turns a spec, a page size and a capacity into a
:class:`PageGeometry`: pure arithmetic, no device.

Geometry rules (every later module relies on them):

* Block ``b`` of buffer ``i`` of every layer sits at a uniform stride, so an
  attention kernel can index it as ``base + b * stride``.
* A page is ``blocks_per_page`` consecutive blocks: block ``b`` lives in page
  ``b // blocks_per_page`` in every layer and every buffer. Blocks never
  straddle pages.
* Each buffer's share of a page (``page_strides[i] = blocks_per_page *
  buffer_block_bytes[i]``) is a whole number of driver granules, so a page can
  be mapped and unmapped on its own in every buffer. When the blocks do not
  tile the configured page size, the page grows to the smallest span that they
  tile (e.g. 10 MiB for 5120-byte blocks on 2 MiB granules) instead of wasting
  a block per page or breaking the uniform stride.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvcached.errors import ConfigError
from kvcached.units import MIB


class KVLayout(enum.Enum):
    """How the layers of one KV cache group share virtual address space.

    * ``PER_LAYER`` (non-contiguous): one VA range per layer holding the K
      region, then the V region; a page is one physical handle per layer and
      buffer (``num_layers * kv_buffers`` handles).
    * ``CONTIGUOUS``: one VA range for every layer, block-major (block ``b`` of
      all layers is one packed run of bytes); a page is one physical handle
      covering every layer, and per-layer views are strided.
    """

    PER_LAYER = "per_layer"
    CONTIGUOUS = "contiguous"


def resolve_layout(contiguous: bool | None) -> KVLayout:
    """The layout for ``KVCACHED_CONTIGUOUS_LAYOUT`` (``None`` = auto).

    Auto is ``PER_LAYER`` on every backend until the H200 layout benchmark
    (``benchmarks/kv_layout.py``) has measured the two; upstream's ROCm choice
    and its measured 31% attention slowdown for contiguous point the same way.
    """
    if contiguous is None:
        return KVLayout.PER_LAYER
    return KVLayout.CONTIGUOUS if contiguous else KVLayout.PER_LAYER


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "a whole number >= 1")
    return value


@dataclass(frozen=True)
class KVCacheSpec:
    """One KV cache group: ``num_layers`` layers of identical shape.

    ``kv_buffers`` is 2 for K and V, 1 for MLA's single latent buffer (or a
    fused per-block byte buffer). Each token of a buffer is a
    ``(num_heads, head_dim)`` cell of ``dtype``; V uses ``v_head_dim`` where it
    differs from K's.

    Hybrid models: a group is the unit that shares one block-id space. vLLM's
    hybrid groups (attention + mamba) already share one block pool with one
    unified per-layer block size, so they are one group described by
    :meth:`of_bytes` (each layer a raw per-block byte buffer that the
    integration views as attention KV or as mamba state through
    :meth:`VirtualKVTensors.block_view`). Pools with separate block spaces
    (SGLang's full and SWA / mamba pools) are separate groups, one
    :class:`~kvcached.memory.KVCache` each, passed the same
    :class:`~kvcached.memory.budget.PhysicalBudget` so they share memory.
    """

    num_layers: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_buffers: int = 2
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_heads", "head_dim"):
            _positive_int(name, getattr(self, name))
        if self.kv_buffers not in (1, 2):
            raise ConfigError("kv_buffers", self.kv_buffers, "2 (K and V) or 1 (MLA, fused)")
        if self.v_head_dim is not None:
            _positive_int("v_head_dim", self.v_head_dim)
            if self.kv_buffers != 2:
                raise ConfigError(
                    "v_head_dim",
                    self.v_head_dim,
                    "only meaningful with kv_buffers=2 (a separate V buffer)",
                )
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError("dtype", self.dtype, "a torch.dtype such as torch.bfloat16")

    @classmethod
    def of_bytes(cls, num_layers: int, block_bytes: int, kv_buffers: int = 1) -> KVCacheSpec:
        """A spec of raw bytes: each layer has ``kv_buffers`` buffers of
        ``block_bytes`` per block, viewed as ``uint8``. For integrations that
        lay out a block themselves (vLLM's per-layer page, hybrid state)."""
        _positive_int("block_bytes", block_bytes)
        return cls(
            num_layers=num_layers,
            block_size=1,
            num_heads=1,
            head_dim=block_bytes,
            dtype=torch.uint8,
            kv_buffers=kv_buffers,
        )

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Head dim of each buffer (K, then V)."""
        if self.kv_buffers == 1:
            return (self.head_dim,)
        return (self.head_dim, self.v_head_dim or self.head_dim)

    @property
    def buffer_block_bytes(self) -> tuple[int, ...]:
        """Bytes of one block in each buffer of one layer."""
        cell = self.block_size * self.num_heads * self.itemsize
        return tuple(cell * d for d in self.head_dims)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer and buffer."""
        return self.num_layers * sum(self.buffer_block_bytes)


@dataclass(frozen=True)
class PageGeometry:
    """Where blocks and pages of one spec live. See the module docstring."""

    layout: KVLayout
    num_layers: int
    buffer_block_bytes: tuple[int, ...]
    blocks_per_page: int
    num_pages: int
    granularity: int

    @property
    def num_buffers(self) -> int:
        return len(self.buffer_block_bytes)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (all its buffers)."""
        return sum(self.buffer_block_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return self.num_layers * self.layer_block_bytes

    @property
    def page_bytes(self) -> int:
        """Physical bytes one page holds, every layer and buffer together."""
        return self.blocks_per_page * self.block_bytes

    @property
    def page_strides(self) -> tuple[int, ...]:
        """Bytes of one page inside one buffer of one layer (per buffer): on
        ``PER_LAYER`` the page stride of each lane."""
        return tuple(self.blocks_per_page * b for b in self.buffer_block_bytes)

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.blocks_per_page

    @property
    def handles_per_page(self) -> int:
        """Physical handles one page needs when mapped on its own."""
        return 1 if self.layout is KVLayout.CONTIGUOUS else self.num_layers * self.num_buffers

    @property
    def handle_bytes_per_page(self) -> int:
        """The largest handle a one-page extent needs (for coalescing limits)."""
        return self.page_bytes if self.layout is KVLayout.CONTIGUOUS else max(self.page_strides)

    def page_of(self, block: int) -> int:
        return block // self.blocks_per_page

    def blocks_of(self, page: int) -> range:
        first = page * self.blocks_per_page
        return range(first, first + self.blocks_per_page)


@runtime_checkable
class PageShape(Protocol):
    """A page geometry as the page layer reads it (mapper, page pool, block
    manager): how many pages, blocks per page, physical bytes per page, the
    largest handle a one-page extent needs.

    Two geometries are one: :class:`PageGeometry`, the layout kvcached plans
    from a :class:`KVCacheSpec` (KVCache, SGLang, the demo), and
    :class:`~kvcached.memory.ranges.PageLanes`, a layout an engine fixed in one
    flat buffer (vLLM). docs/memory.md says why they stay two classes.
    """

    @property
    def num_pages(self) -> int: ...

    @property
    def blocks_per_page(self) -> int: ...

    @property
    def granularity(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def page_bytes(self) -> int: ...

    @property
    def handle_bytes_per_page(self) -> int: ...

    def page_of(self, block: int) -> int: ...


def min_tiling_blocks(buffer_block_bytes: tuple[int, ...], granularity: int) -> int:
    """The fewest blocks whose span is a whole number of granules in every buffer."""
    need = 1
    for b in buffer_block_bytes:
        step = granularity // math.gcd(b, granularity)
        need = need * step // math.gcd(need, step)
    return need


def plan_pages(
    spec: KVCacheSpec,
    *,
    layout: KVLayout,
    granularity: int,
    page_size: int,
    num_blocks: int | None = None,
    capacity_bytes: int | None = None,
) -> PageGeometry:
    """Choose blocks per page and the number of pages.

    ``page_size`` is the target span of one page inside the largest buffer of
    one layer (``KVCACHED_PAGE_SIZE_MB``). Capacity comes from ``num_blocks``
    (at least that many usable blocks) or ``capacity_bytes`` (physical bytes of
    the whole cache); exactly one must be given.
    """
    _positive_int("granularity", granularity)
    if page_size < granularity or page_size % granularity:
        raise ConfigError(
            "page_size",
            page_size,
            f"a positive multiple of the driver granularity ({granularity} bytes)",
        )
    if (num_blocks is None) == (capacity_bytes is None):
        raise ConfigError(
            "num_blocks/capacity_bytes", (num_blocks, capacity_bytes), "exactly one of the two"
        )
    bbytes = spec.buffer_block_bytes
    step = min_tiling_blocks(bbytes, granularity)
    per_page = page_size // max(bbytes) // step * step
    blocks_per_page = max(step, per_page)
    block_bytes = spec.block_bytes
    if num_blocks is not None:
        _positive_int("num_blocks", num_blocks)
        num_pages = -(-num_blocks // blocks_per_page)
    else:
        _positive_int("capacity_bytes", capacity_bytes)
        num_pages = capacity_bytes // (blocks_per_page * block_bytes)
        if num_pages < 1:
            raise ConfigError(
                "capacity_bytes",
                capacity_bytes,
                f"at least one page ({blocks_per_page * block_bytes} bytes = "
                f"{blocks_per_page * block_bytes / MIB:.1f} MiB for this spec)",
            )
    return PageGeometry(
        layout=layout,
        num_layers=spec.num_layers,
        buffer_block_bytes=bbytes,
        blocks_per_page=blocks_per_page,
        num_pages=num_pages,
        granularity=granularity,
    )
