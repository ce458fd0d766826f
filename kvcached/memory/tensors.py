"""Virtual KV tensors: the reserved address space of one KV cache group, and
torch views of it in the shapes attention backends expect.

Nothing here maps memory; :class:`~kvcached.memory.mapper.PageMapper` does.
This module only knows *where* things are:

* ``PER_LAYER``: layer ``l`` has one reservation ``[K region | V region]``;
  block ``b`` of buffer ``i`` is at ``region_i + b * buffer_block_bytes[i]``.
* ``CONTIGUOUS``: one reservation, block-major; block ``b`` of buffer ``i`` of
  layer ``l`` is at ``b * block_bytes + l * layer_block_bytes + offset_i``.

Either way page ``p`` is the byte range of blocks ``[p*bpp, (p+1)*bpp)`` in each
buffer, a whole number of granules (see :mod:`kvcached.memory.spec`).

Reading a block that is not mapped gives zeros on the host backend and
whatever the backend's unmapped-read rule is on a GPU; writing one faults.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol, runtime_checkable

import torch

from kvcached.driver.base import Driver
from kvcached.errors import ConfigError, KVCachedError, MappingError
from kvcached.log import get_logger
from kvcached.memory.spec import KVCacheSpec, KVLayout, PageGeometry, PageShape

log = get_logger("kvcached.memory")


@runtime_checkable
class PagedTensors(Protocol):
    """Reserved address space that pages are mapped under, as
    :class:`~kvcached.memory.mapper.PageMapper` uses it: the driver, the
    geometry and the lanes. A *lane* is one address range that every page
    crosses at the same offset (one buffer of one layer on ``PER_LAYER``, the
    whole reservation on ``CONTIGUOUS``, one region of an engine's flat
    buffer); a one-page extent maps one handle per lane.

    :class:`VirtualKVTensors` (kvcached's layout, with attention views) and
    :class:`~kvcached.memory.ranges.RangeKVTensors` (an engine's flat buffer)
    are the two implementations."""

    driver: Driver

    @property
    def geometry(self) -> PageShape: ...

    def extent_ranges(self, first: int, count: int) -> list[tuple[int, int]]: ...

    def handle_strides(self) -> tuple[tuple[int, int], ...]: ...


def _free_all(driver: Driver, reservations: list[tuple[int, int]]) -> None:
    while reservations:
        va, size = reservations.pop()
        driver.free_reservation(va, size)


def _collect(driver: Driver, reservations: list[tuple[int, int]]) -> None:
    """Last resort when the owner was dropped without close(): give back what
    can be given back; a reservation with mappings left inside is kept (and
    said so), never unmapped behind the mapper's back."""
    for va, size in reversed(reservations):
        try:
            driver.free_reservation(va, size)
        except KVCachedError as exc:
            log.warning("KV address space at %#x kept at exit: %s", va, exc)
    reservations.clear()


class VirtualKVTensors:
    """The VA reservations of one group and their views.

    Owns the reservations (an OS / driver resource): :meth:`close` gives them
    back (idempotent; every mapping inside must be gone first), as does the
    garbage collector as a last resort. Views stay valid only while it is open.
    """

    def __init__(self, driver: Driver, spec: KVCacheSpec, geometry: PageGeometry) -> None:
        if geometry.buffer_block_bytes != spec.buffer_block_bytes:
            raise ConfigError("geometry", geometry, "a geometry planned for this spec")
        self.driver = driver
        self.spec = spec
        self.geometry = geometry
        g = geometry
        self._reservations: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.closed = False
        # Per (layer, buffer): VA of block 0, and the byte stride between blocks.
        self._base: list[list[int]] = []
        if g.layout is KVLayout.CONTIGUOUS:
            size = g.num_pages * g.page_bytes
            va = driver.reserve(size)
            self._reservations.append((va, size))
            self.block_stride = g.block_bytes
            for layer in range(g.num_layers):
                row, off = [], va + layer * g.layer_block_bytes
                for b in g.buffer_block_bytes:
                    row.append(off)
                    off += b
                self._base.append(row)
        else:
            self.block_stride = 0  # differs per buffer; see buffer_stride()
            try:
                for _ in range(g.num_layers):
                    size = g.num_pages * g.blocks_per_page * g.layer_block_bytes
                    va = driver.reserve(size)
                    self._reservations.append((va, size))
                    row, off = [], va
                    for stride in g.page_strides:
                        row.append(off)
                        off += g.num_pages * stride
                    self._base.append(row)
            except BaseException:
                _free_all(driver, self._reservations)  # undo in reverse
                raise
        self._finalizer = weakref.finalize(self, _collect, driver, self._reservations)

    # -- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Give the address space back. Idempotent. Unmap every page first."""
        with self._lock:
            if self.closed:
                return
            self._finalizer.detach()
            _free_all(self.driver, self._reservations)
            self.closed = True

    def __enter__(self) -> VirtualKVTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- where pages are --------------------------------------------------------------
    def extent_ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(va, size)`` of each physical handle that maps pages
        ``[first, first+count)`` as one extent: one range on ``CONTIGUOUS``,
        one per layer and buffer on ``PER_LAYER``. Each range is also one
        ``set_access`` call."""
        g = self.geometry
        if first < 0 or count < 1 or first + count > g.num_pages:
            raise MappingError(
                f"pages [{first}, {first + count}) are outside this cache's {g.num_pages} pages"
            )
        return [(va + first * stride, count * stride) for va, stride in self.handle_strides()]

    def handle_strides(self) -> tuple[tuple[int, int], ...]:
        """``(va, stride)`` of each lane (handle range), in
        :meth:`extent_ranges` order: lane ``i`` of pages ``[first,
        first+count)`` is ``(va_i + first * stride_i, count * stride_i)``.
        Fixed for the tensors' life, so the mapper computes addresses with two
        multiplications instead of a call."""
        g = self.geometry
        if g.layout is KVLayout.CONTIGUOUS:
            return ((self._reservations[0][0], g.page_bytes),)
        strides = g.page_strides
        return tuple(
            (base, stride) for row in self._base for base, stride in zip(row, strides, strict=True)
        )

    def buffer_stride(self, buffer: int = 0) -> int:
        """Byte distance between consecutive blocks of one buffer of one layer."""
        if self.geometry.layout is KVLayout.CONTIGUOUS:
            return self.block_stride
        return self.geometry.buffer_block_bytes[buffer]

    def block_address(self, layer: int, buffer: int, block: int) -> int:
        """VA of block ``block`` of buffer ``buffer`` (0 = K, 1 = V) of ``layer``."""
        self._check(layer, buffer)
        if not 0 <= block < self.geometry.num_blocks:
            raise MappingError(f"block={block} is outside [0, {self.geometry.num_blocks})")
        return self._base[layer][buffer] + block * self.buffer_stride(buffer)

    @property
    def reservations(self) -> tuple[tuple[int, int], ...]:
        """``(va, size)`` of each reservation (one per layer, or one)."""
        return tuple(self._reservations)

    # -- views --------------------------------------------------------------------------
    def _check(self, layer: int, buffer: int) -> None:
        if self.closed:
            raise MappingError("the KV tensors were closed")
        g = self.geometry
        if not 0 <= layer < g.num_layers:
            raise ConfigError("layer", layer, f"an index in [0, {g.num_layers})")
        if not 0 <= buffer < g.num_buffers:
            raise ConfigError("buffer", buffer, f"an index in [0, {g.num_buffers})")

    def _typed(self, va: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        raw = self.driver.tensor(va, nbytes)
        return raw if dtype == torch.uint8 else raw.view(dtype)

    def raw_buffer(self, layer: int, buffer: int = 0) -> torch.Tensor:
        """Buffer ``buffer`` of ``layer`` as ``uint8`` of shape
        ``(num_blocks, buffer_block_bytes)``: row ``b`` is block ``b``. Its block
        stride is the buffer's (``PER_LAYER``) or the packed block's
        (``CONTIGUOUS``). For integrations that view bytes their own way."""
        self._check(layer, buffer)
        g = self.geometry
        width, stride = g.buffer_block_bytes[buffer], self.buffer_stride(buffer)
        nbytes = (g.num_blocks - 1) * stride + width
        raw = self.driver.tensor(self._base[layer][buffer], nbytes)
        return torch.as_strided(raw, (g.num_blocks, width), (stride, 1))

    def layer_bytes(self, layer: int) -> torch.Tensor:
        """``PER_LAYER`` only: the layer's whole reservation as 1-D ``uint8``
        (K region, then V region), for integrations that compute their own
        strides over one per-layer buffer."""
        self._check(layer, 0)
        if self.geometry.layout is not KVLayout.PER_LAYER:
            raise ConfigError(
                "layout",
                self.geometry.layout.value,
                "per_layer (contiguous layers share one range: use raw_buffer or whole_bytes)",
            )
        va, size = self._reservations[layer]
        return self.driver.tensor(va, size)

    def whole_bytes(self) -> torch.Tensor:
        """``CONTIGUOUS`` only: the single reservation as 1-D ``uint8``; layer
        ``l``, buffer ``i`` of block ``b`` starts at ``b * block_stride +
        l * layer_block_bytes + sum(buffer_block_bytes[:i])``."""
        if self.geometry.layout is not KVLayout.CONTIGUOUS:
            raise ConfigError(
                "layout",
                self.geometry.layout.value,
                "contiguous (per-layer ranges: use layer_bytes)",
            )
        if self.closed:
            raise MappingError("the KV tensors were closed")
        va, size = self._reservations[0]
        return self.driver.tensor(va, size)

    def block_view(
        self, layer: int, buffer: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Buffer ``buffer`` of ``layer`` as ``(num_blocks, *shape)`` of
        ``dtype``, where ``shape`` fills one block exactly. The general view
        (hybrid state, custom cells); the ones below are special cases."""
        self._check(layer, buffer)
        g = self.geometry
        itemsize = torch.empty((), dtype=dtype).element_size()
        width = g.buffer_block_bytes[buffer]
        numel = 1
        for n in shape:
            numel *= n
        if numel * itemsize != width:
            raise ConfigError(
                "shape", shape, f"a {dtype} shape of exactly {width} bytes (one block)"
            )
        stride = self.buffer_stride(buffer)
        if stride % itemsize or self._base[layer][buffer] % itemsize:
            raise ConfigError(
                "dtype", dtype, f"a dtype whose size divides the block stride {stride}"
            )
        nbytes = (g.num_blocks - 1) * stride + width
        base = self._typed(self._base[layer][buffer], nbytes, dtype)
        inner = []
        acc = 1
        for n in reversed(shape):
            inner.append(acc)
            acc *= n
        strides = (stride // itemsize, *reversed(inner))
        return torch.as_strided(base, (g.num_blocks, *shape), strides)

    def key_view(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``(num_blocks, block_size, num_heads, head_dim)``
        (the MLA latent buffer when ``kv_buffers == 1``)."""
        s = self.spec
        return self.block_view(layer, 0, s.dtype, (s.block_size, s.num_heads, s.head_dims[0]))

    def value_view(self, layer: int) -> torch.Tensor:
        """V of ``layer``: ``(num_blocks, block_size, num_heads, v_head_dim)``."""
        s = self.spec
        if s.kv_buffers != 2:
            raise ConfigError("kv_buffers", s.kv_buffers, "2 for a separate V buffer")
        return self.block_view(layer, 1, s.dtype, (s.block_size, s.num_heads, s.head_dims[1]))

    def flash_attn_view(self, layer: int) -> torch.Tensor:
        """FlashAttention's ``(2, num_blocks, block_size, num_heads, head_dim)``:
        ``[0]`` is K, ``[1]`` is V, both aliasing the cache."""
        s, g = self.spec, self.geometry
        if s.kv_buffers != 2 or s.head_dims[0] != s.head_dims[1]:
            raise ConfigError("spec", s, "K and V buffers of one head dim for a stacked KV view")
        itemsize = s.itemsize
        kv_gap = self._base[layer][1] - self._base[layer][0]
        stride = self.buffer_stride(0)
        nbytes = kv_gap + (g.num_blocks - 1) * stride + g.buffer_block_bytes[0]
        base = self._typed(self._base[layer][0], nbytes, s.dtype)
        shape = (2, g.num_blocks, s.block_size, s.num_heads, s.head_dim)
        strides = (kv_gap // itemsize, stride // itemsize, s.num_heads * s.head_dim, s.head_dim, 1)
        return torch.as_strided(base, shape, strides)

    def flashinfer_view(self, layer: int) -> torch.Tensor:
        """FlashInfer's ``(num_blocks, 2, block_size, num_heads, head_dim)``,
        the same memory as :meth:`flash_attn_view` with the first two axes
        swapped (dense per block on ``CONTIGUOUS``, strided on ``PER_LAYER``)."""
        return self.flash_attn_view(layer).transpose(0, 1)

    def mla_view(self, layer: int) -> torch.Tensor:
        """MLA's single buffer: ``(num_blocks, block_size, head_dim)``."""
        s = self.spec
        if s.kv_buffers != 1:
            raise ConfigError("kv_buffers", s.kv_buffers, "1 (MLA) for the single-buffer view")
        if s.num_heads != 1:
            return self.block_view(layer, 0, s.dtype, (s.block_size, s.num_heads * s.head_dim))
        return self.block_view(layer, 0, s.dtype, (s.block_size, s.head_dim))
