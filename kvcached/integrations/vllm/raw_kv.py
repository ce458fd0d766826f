"""vLLM 0.26's KV tensors (``kv_alloc = "raw"``, see :mod:`.releases`) in kvcached's pages.

vLLM 0.26 allocates one raw ``int8`` tensor per ``KVCacheTensor`` (the V2
runner's ``attn_utils._allocate_kv_cache``, the V1 runner's
``GPUModelRunner._allocate_kv_cache_tensors``) and each attention backend views
it (``get_kv_cache_shape`` / ``get_kv_cache_stride_order``); on every backend
that indexes KV by the block stride, block ``b`` of a layer is the page of bytes
``[b*page, (b+1)*page)`` of its tensor. kvcached puts all tensors in one
virtual buffer and hands vLLM slices of it:

* per layer (vLLM's own layout): tensor ``i`` at ``i*size``; a kvcached page is
  then one lane per tensor;
* packed (``KVCACHED_CONTIGUOUS_LAYOUT=true``): the engine core rewrites the
  config as vLLM's packed layout (:func:`pack`: ``offset = i*page``,
  ``block_stride = T*page``), which vLLM itself views (it is how 0.26 lays out
  DeepSeek-V4 and cross-layer blocks), so a kvcached page is one run of whole
  blocks, every layer side by side.

Everything here is arithmetic on the config; nothing touches memory but
:func:`raw_tensors`, which slices a buffer.
"""

from __future__ import annotations

from typing import Any

from kvcached.integrations.vllm.geometry import PLAN_GRANULARITY, PlanError, TensorShape, lanes_of
from kvcached.memory.ranges import PageLanes


def is_packed(kv_cache_config: Any) -> bool:
    return any(getattr(t, "block_stride", 0) > 0 for t in kv_cache_config.kv_cache_tensors)


def raw_shapes(kv_cache_config: Any) -> tuple[list[TensorShape], int]:
    """The byte geometry of every ``KVCacheTensor`` in kvcached's buffer, and
    the buffer's size. Raises :class:`PlanError` for what cannot be paged."""
    tensors = kv_cache_config.kv_cache_tensors
    num_blocks = kv_cache_config.num_blocks
    if not tensors:
        raise PlanError("the model has no KV cache tensors")
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        for s in specs.values() if specs else (spec,):
            if not hasattr(s, "num_kv_heads"):
                raise PlanError(f"{type(s).__name__} lays out its own memory")
            if not getattr(s, "indexes_kv_by_block_stride", True):
                raise PlanError(
                    f"the attention backend of {type(s).__name__} does not index KV by "
                    "the block stride"
                )
    shapes: list[TensorShape] = []
    if is_packed(kv_cache_config):
        size = tensors[0].size
        for t in tensors:
            if t.block_stride <= 0 or t.size != size:
                raise PlanError("a packed KV config mixes packed and unpacked tensors")
        stride = tensors[0].block_stride
        if stride * num_blocks != size:
            raise PlanError(f"packed size {size} is not {num_blocks} blocks of {stride} bytes")
        bounds = sorted((t.offset, _page_of(kv_cache_config, t)) for t in tensors)
        for offset, page in bounds:
            shapes.append(_shape(offset, num_blocks, page, stride, size))
        return shapes, size
    offset = 0
    for t in tensors:
        if t.size % num_blocks:
            raise PlanError(f"a KV tensor of {t.size} bytes is not {num_blocks} whole blocks")
        page = t.size // num_blocks
        shapes.append(_shape(offset, num_blocks, page, page, t.size))
        offset += t.size
    return shapes, offset


def _shape(offset: int, num_blocks: int, page: int, stride: int, size: int) -> TensorShape:
    # One layer of num_blocks pages: [L=1, B, H=1, N=1, C=page] in TensorShape's terms.
    return TensorShape(offset, (1, num_blocks, 1, 1, page), (size, stride, page, page, 1), page)


def _page_of(kv_cache_config: Any, tensor: Any) -> int:
    layer = tensor.shared_by[0]
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)
            return (specs[layer] if specs else spec).page_size_bytes
    raise PlanError(f"layer {layer} of a KV tensor is in no KV cache group")


def plan_raw_lanes(
    kv_cache_config: Any, page_size: int, granularity: int = PLAN_GRANULARITY
) -> PageLanes:
    """The :class:`PageLanes` of a vLLM 0.26 ``KVCacheConfig``."""
    shapes, size = raw_shapes(kv_cache_config)
    layout = "packed" if is_packed(kv_cache_config) else "per-layer"
    return lanes_of(
        shapes, size, kv_cache_config.num_blocks, page_size, granularity, layout_name=layout
    )


def pack(kv_cache_config: Any) -> Any | None:
    """``kv_cache_config`` rewritten in vLLM's packed layout (every layer's page
    of a block side by side), or ``None`` when vLLM could not view it so: not
    the general case of equal tensors, already packed, or a backend that does
    not index KV by the block stride."""
    from dataclasses import replace

    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or is_packed(kv_cache_config):
        return None
    num_blocks = kv_cache_config.num_blocks
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if getattr(spec, "kv_cache_specs", None) or not getattr(
            spec, "indexes_kv_by_block_stride", False
        ):
            return None
    page = size // num_blocks
    stride = page * len(tensors)
    packed = [
        replace(t, size=stride * num_blocks, offset=i * page, block_stride=stride)
        for i, t in enumerate(tensors)
    ]
    return replace(kv_cache_config, kv_cache_tensors=packed)


def raw_tensors(kv_cache_config: Any, buf: Any) -> dict[str, Any]:
    """vLLM's raw tensor of every layer, as slices of kvcached's buffer ``buf``
    (laid out as :func:`raw_shapes` says)."""
    out: dict[str, Any] = {}
    offset = 0
    packed = is_packed(kv_cache_config)
    for t in kv_cache_config.kv_cache_tensors:
        if packed:
            tensor = buf[: t.size]
        else:
            tensor = buf[offset : offset + t.size]
            offset += t.size
        out.update(dict.fromkeys(t.shared_by, tensor))
    return out
