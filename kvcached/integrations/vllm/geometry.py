"""Pages of vLLM's KV buffer: which bytes hold which blocks.

vLLM 0.32 allocates one ``int8`` buffer for every KV cache group and views it
per layer (``allocate_kv_cache`` -> ``create_kv_cache_views``): block ``b`` of
layer ``l`` of a ``KVCacheTensor`` starts at ``offset + l*layer_stride +
b*block_stride``, and the other axes (heads, tokens, bytes) follow the
resolved ``KVCacheLayout``. The same arithmetic is done here without memory:
each tensor is a 5-D byte array ``[L, B, H, N, C]`` with the strides vLLM
computes (``compute_layout_strides``), and a page is the slice of ``B`` holding
``blocks_per_page`` blocks. Its footprint is a few contiguous runs (one per
layer region on layer-outermost layouts, one for the whole block range on
block-outermost ones); rounded out to the granularity and merged over
tensors (overlaid groups alias the same bytes), they are the page's lanes.

Two sizing rules make every lane page-aligned (see docs/vllm-integration.md):

* ``blocks_per_page * block_stride`` is a multiple of the granularity for every
  tensor (:func:`blocks_per_page` picks the fewest blocks that do this, then as
  many of those as fit in ``KVCACHED_PAGE_SIZE_MB`` of one layer);
* ``num_blocks`` is a multiple of ``blocks_per_page`` (the engine core rounds
  it up while vLLM builds the configs), so layer regions start on pages too.

Anything else (a layout whose pages cannot be expressed as aligned lanes) is a
:class:`PlanError`: kvcached then leaves vLLM native.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvcached.errors import KVCachedError
from kvcached.memory.ranges import PageLanes
from kvcached.units import MIB

#: The alignment every plan is made for: a multiple of every backend's
#: granularity (CUDA and the host backend: 2 MiB; HIP: 4 KiB or 2 MiB). The
#: engine core plans without a device, so it cannot ask the driver.
PLAN_GRANULARITY = 2 * MIB


class PlanError(KVCachedError):
    """vLLM's KV cache config cannot be cut into kvcached pages."""


def strided_runs(
    offset: int, shape: Sequence[int], strides: Sequence[int]
) -> list[tuple[int, int]]:
    """The contiguous byte runs ``(start, length)`` of a strided byte array.

    Axes of size 1 are ignored; the innermost axes whose strides chain (each
    equal to the extent of the ones inside it) form one run, and every index
    of the remaining outer axes starts one. Raises :class:`PlanError` when
    the innermost axis does not have stride 1 (the array is not made of bytes).
    """
    dims = sorted((s, n) for n, s in zip(shape, strides, strict=True) if n > 1)
    if not dims:
        return [(offset, 1)]
    if dims[0][0] != 1:
        raise PlanError(f"innermost stride {dims[0][0]} is not 1 byte: {shape}, {strides}")
    extent = 1
    i = 0
    while i < len(dims) and dims[i][0] == extent:
        extent *= dims[i][1]
        i += 1
    starts = [offset]
    for stride, n in dims[i:]:
        starts = [s + k * stride for s in starts for k in range(n)]
    return [(s, extent) for s in starts]


def merge_runs(runs: Iterable[tuple[int, int]], granularity: int = 1) -> list[tuple[int, int]]:
    """Union of runs, each first rounded out to ``granularity``; sorted, with
    overlapping and touching runs joined."""
    bounds = sorted(
        (start // granularity * granularity, -(-(start + length) // granularity) * granularity)
        for start, length in runs
    )
    out: list[list[int]] = []
    for lo, hi in bounds:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


class TensorShape:
    """One ``KVCacheTensor`` as a 5-D byte array: offset, shape and strides of
    ``[L, B, H, N, C]`` for ``num_blocks`` blocks, and the bytes one block of
    one layer holds (its padded page)."""

    __slots__ = ("offset", "shape", "strides", "layer_block_bytes")

    def __init__(
        self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], layer_block_bytes: int
    ) -> None:
        self.offset = offset
        self.shape = shape
        self.strides = strides
        self.layer_block_bytes = layer_block_bytes

    @property
    def block_stride(self) -> int:
        return self.strides[1]

    def page_runs(self, page: int, blocks_per_page: int) -> list[tuple[int, int]]:
        """The byte runs of blocks ``[page*bpp, (page+1)*bpp)`` in every layer."""
        shape = (self.shape[0], blocks_per_page, *self.shape[2:])
        start = self.offset + page * blocks_per_page * self.strides[1]
        return strided_runs(start, shape, self.strides)


def tensor_shapes(kv_cache_config: Any, layout: Any) -> list[TensorShape]:
    """:class:`TensorShape` of every ``KVCacheTensor`` of a vLLM 0.32
    ``KVCacheConfig`` under ``layout`` (a ``KVCacheLayout``), found the way
    ``allocate_kv_cache`` finds each tensor's spec."""
    from vllm.v1.kv_cache_interface import (
        UniformTypeKVCacheSpecs,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )

    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        if getattr(tensor, "host_resident", False):
            raise PlanError("a host-resident KV tensor (HiSparse) is not supported")
        layer = tensor.layers[0]
        group = next((g for g in kv_cache_config.kv_cache_groups if layer in g.layer_names), None)
        if group is None:
            raise PlanError(f"layer {layer} of a KV tensor is in no KV cache group")
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer]
        if not spec.has_layer_views:
            raise PlanError(f"{type(spec).__name__} lays out its own memory")
        num_blocks = kv_cache_config.num_blocks
        num_layers = len(tensor.layers)
        shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
        strides = compute_layout_strides(
            spec,
            num_blocks,
            num_layers,
            layout,
            fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None),
        )
        layer_block = getattr(spec, "page_size_padded", None) or spec.page_size_bytes
        out.append(TensorShape(tensor.offset, shape, tuple(strides), layer_block))
    return out


def blocks_per_page(
    shapes: Sequence[TensorShape], page_size: int, granularity: int = PLAN_GRANULARITY
) -> int:
    """Blocks per page: the fewest that make ``bpp * block_stride`` a multiple
    of ``granularity`` for every tensor, times as many as fit in ``page_size``
    bytes of the largest per-layer block."""
    if not shapes:
        raise PlanError("no KV tensors")
    step = 1
    for t in shapes:
        need = granularity // math.gcd(t.block_stride, granularity)
        step = step * need // math.gcd(step, need)
    unit = max(t.layer_block_bytes for t in shapes)
    return max(step, page_size // unit // step * step)


def plan_lanes(
    kv_cache_config: Any, layout: Any, page_size: int, granularity: int = PLAN_GRANULARITY
) -> PageLanes:
    """The :class:`PageLanes` of a vLLM ``KVCacheConfig`` (see the module
    docstring). Raises :class:`PlanError` when the config cannot be paged."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        raise PlanError("the model has no KV cache tensors")
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise PlanError(f"KV tensors of different sizes {sorted(sizes)}")
    return lanes_of(
        tensor_shapes(kv_cache_config, layout),
        sizes.pop(),
        kv_cache_config.num_blocks,
        page_size,
        granularity,
        layout_name=getattr(layout, "name", str(layout)),
    )


def lanes_of(
    shapes: Sequence[TensorShape],
    size: int,
    num_blocks: int,
    page_size: int,
    granularity: int = PLAN_GRANULARITY,
    layout_name: str = "",
) -> PageLanes:
    """The :class:`PageLanes` of tensors laid out as ``shapes`` in a buffer of
    ``size`` bytes holding ``num_blocks`` blocks (no vLLM needed)."""
    bpp = blocks_per_page(shapes, page_size, granularity)
    if num_blocks % bpp:
        raise PlanError(f"num_blocks={num_blocks} is not a multiple of {bpp} blocks per page")
    num_pages = num_blocks // bpp

    def page(k: int) -> list[tuple[int, int]]:
        return merge_runs((r for t in shapes for r in t.page_runs(k, bpp)), granularity)

    first = page(0)
    if num_pages > 1:
        second = page(1)
        if len(second) != len(first) or any(
            n0 != n1 or s1 - s0 != n0 for (s0, n0), (s1, n1) in zip(first, second, strict=True)
        ):
            raise PlanError(
                f"pages do not repeat at a fixed stride in every lane ({first[:4]} then "
                f"{second[:4]}): layout {layout_name} is not paged"
            )
    try:
        lanes = PageLanes(
            size=size,
            lanes=tuple(first),
            num_pages=num_pages,
            blocks_per_page=bpp,
            granularity=granularity,
        )
    except KVCachedError as exc:
        raise PlanError(str(exc)) from None
    last = num_pages - 1
    if page(last) != lanes.run_ranges(last, 1):
        raise PlanError(f"the last page's bytes {page(last)[:4]} are not where the lanes put them")
    return lanes
