"""Patch groups for vLLM 0.30 and 0.31, where their internals differ from 0.32.

Everything else (the block pool, ``allocate_kv_cache``, the model runners, the
scheduler, the engine core) is the same patch on all three releases; the
differences are three signatures (docs/vllm-integration.md, "Versions"):

* ``request_memory(init_snapshot, cache_config)``: 0.32 added
  ``external_weight_memory`` (groups ``worker_utils``, ``gpu_worker``,
  ``xpu_worker``);
* ``KVCacheManager.allocate_slots``: 0.32 added ``skip_zeroing_group_ids``
  (group ``kv_cache_manager``);
* ``KVCacheCoordinator.get_num_blocks_to_allocate``: 0.31 added
  ``prefill_end`` (group ``kv_cache_coordinator``, 0.30 only; the wrapper
  passes arguments through, only the check differs).
"""

from __future__ import annotations

import inspect
import math
from types import ModuleType
from typing import Any

from kvcached.integrations.patching import Patcher, check_params, original
from kvcached.integrations.vllm import engine, worker
from kvcached.integrations.vllm.state import STATE

_REQUEST_MEMORY = ("init_snapshot", "cache_config")
ALLOCATE_SLOTS_PARAMS = engine.ALLOCATE_SLOTS_PARAMS[:-1]  # no skip_zeroing_group_ids


def _request_memory(init_snapshot: Any, cache_config: Any) -> int:
    """vLLM's ``request_memory`` without the refusal to start when another
    process uses the device (see :func:`.worker._request_memory`)."""
    if not STATE.active:
        return original(_request_memory)(init_snapshot, cache_config)
    return max(1, math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization))


def check_utils(module: ModuleType) -> str | None:
    return check_params(module, "allocate_kv_cache", worker.ALLOCATE_PARAMS) or check_params(
        module, "request_memory", _REQUEST_MEMORY
    )


def install_utils(patcher: Patcher, module: ModuleType) -> None:
    worker._ORIGINAL_ALLOCATE = patcher.replace(
        module, "allocate_kv_cache", worker.allocate_kv_cache
    )
    patcher.replace(module, "request_memory", _request_memory)


def check_request_memory(module: ModuleType) -> str | None:
    return check_params(module, "request_memory", _REQUEST_MEMORY)


def install_request_memory(patcher: Patcher, module: ModuleType) -> None:
    patcher.replace(module, "request_memory", _request_memory)


def check_gpu_worker(module: ModuleType) -> str | None:
    return check_request_memory(module) or check_params(
        module.Worker, "determine_available_memory", ("self",)
    )


def install_gpu_worker(patcher: Patcher, module: ModuleType) -> None:
    install_request_memory(patcher, module)
    patcher.replace(
        module.Worker, "determine_available_memory", worker._gpu_determine_available_memory
    )


def check_coordinator(module: ModuleType) -> str | None:
    pool = getattr(module, "BlockPool", None)
    if pool is None:
        return "kv_cache_coordinator has no BlockPool"
    return check_params(original(pool), "__init__", engine._POOL_PARAMS) or check_params(
        module.KVCacheCoordinator,
        "get_num_blocks_to_allocate",
        (
            "self",
            "request_id",
            "num_tokens",
            "new_computed_blocks",
            "num_encoder_tokens",
            "total_computed_tokens",
            "num_local_computed_tokens",
            "num_tokens_main_model",
            "apply_admission_cap",
        ),
    )


def _allocate_slots(
    self,
    request,
    num_new_tokens,
    num_new_computed_tokens=0,
    new_computed_blocks=None,
    num_lookahead_tokens=0,
    num_external_computed_tokens=0,
    delay_cache_blocks=False,
    num_encoder_tokens=0,
    full_sequence_must_fit=False,
    reserved_blocks=0,
    has_scheduled_reqs=True,
):  # noqa: ANN001, ANN202
    orig = original(_allocate_slots)
    pool = self.block_pool
    kvcached = engine.hold_back(self, request, reserved_blocks, has_scheduled_reqs)
    try:
        return orig(
            self,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )
    finally:
        if kvcached:
            pool.alloc_extra = None


def check_kv_cache_manager(module: ModuleType) -> str | None:
    reason = check_params(module.KVCacheManager, "allocate_slots", ALLOCATE_SLOTS_PARAMS)
    if reason is not None:
        return reason
    theirs = inspect.signature(original(module.KVCacheManager.allocate_slots)).parameters
    ours = inspect.signature(_allocate_slots).parameters
    for name in ALLOCATE_SLOTS_PARAMS:
        if theirs[name].default != ours[name].default:
            return f"allocate_slots' default of {name} is {theirs[name].default!r}"
    return None


def install_kv_cache_manager(patcher: Patcher, module: ModuleType) -> None:
    from vllm.v1.request import RequestStatus

    engine._WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    patcher.replace(module.KVCacheManager, "allocate_slots", _allocate_slots)
