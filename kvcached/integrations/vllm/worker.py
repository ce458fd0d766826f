"""Patches in vLLM's worker processes: KV allocation, page ops, startup checks.

* KV allocation, during ``initialize_from_config`` only (any other call, such
  as the V1 runner's minimal cache for CUDA-graph profiling, stays native):
  on 0.30-0.32 (``kv_alloc = "views"``) ``allocate_kv_cache`` (``vllm.v1.worker.utils``,
  imported by name into the V1 model runner and the V2 ``attn_utils``) returns
  vLLM's own per-layer views (``create_kv_cache_views``) over a kvcached
  virtual buffer of the same size, so shapes, strides, dtypes and storage
  offsets are native; on 0.26 (``kv_alloc = "raw"``) the V2 runner's
  ``_allocate_kv_cache`` and the V1 runner's ``_allocate_kv_cache_tensors``
  return slices of that buffer as the raw tensors vLLM then views itself
  (:mod:`.raw_kv`).
* ``WorkerWrapperBase.execute_model`` applies the step's page ops
  (``scheduler_output.kvcached_ops``) before vLLM runs the step, those the
  step does not touch (past ``kvcached_sync``) in the executor's thread beside
  it, finished before a later step the planner marks (``kvcached_wait``: it
  uses a page they map, or has ops of its own); under tensor
  parallelism every rank agrees on the outcome of a growth step with one MIN
  all-reduce on vLLM's TP CPU group, so no rank fails alone.
* ``kvcached_describe`` and ``kvcached_apply_page_ops`` are added to
  ``WorkerWrapperBase`` for the engine core's ``collective_rpc``.
* Startup: ``request_memory`` no longer refuses to start because another
  process uses the device; the GPU worker profiles as with
  ``--kv-cache-memory-bytes`` (no free-memory assertion) and reports the
  virtual capacity ``total x KVCACHED_GPU_UTILIZATION``; the CPU worker reports
  ``VLLM_CPU_KVCACHE_SPACE`` (or, unset, the host backend's capacity) without
  comparing it with the node's free memory, at start or when sizing. Physical memory is the ledger's
  business from then on.
"""

from __future__ import annotations

import math
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvcached.errors import KVCachedError
from kvcached.integrations.patching import Patcher, check_params, original
from kvcached.integrations.vllm.releases import Release
from kvcached.integrations.vllm.state import STATE
from kvcached.log import get_logger
from kvcached.units import format_bytes

if TYPE_CHECKING:
    from kvcached.config import Config

log = get_logger("integrations.vllm")

ALLOCATE_PARAMS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
RAW_V2_PARAMS = ("kv_cache_config", "shared_layers", "device")
RAW_V1_PARAMS = ("self", "kv_cache_config")


class _Worker:
    """This process' worker-side state."""

    executor: Any = None
    allocating = False  # inside initialize_from_config: the real KV allocation
    rank = 0
    world_size = 1
    native_reason: str | None = None
    vllm_config: Any = None


WORKER = _Worker()


def refusal_reason(vllm_config: Any) -> str | None:
    """Why kvcached cannot serve this vLLM configuration (``None``: it can).
    The engine core and every worker evaluate it alike, so they agree."""
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return "pipeline parallelism is not supported"
    if getattr(parallel, "nnodes", 1) > 1:
        return "tensor parallelism across nodes is not supported"
    if (
        getattr(parallel, "decode_context_parallel_size", 1) > 1
        or getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        return "context parallelism is not supported"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "KV connectors (--kv-transfer-config) register KV memory of their own"
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        return "HiSparse keeps its own host KV pool"
    if getattr(vllm_config.model_config, "enable_sleep_mode", False) or getattr(
        cache, "enable_sleep_mode", False
    ):
        return "sleep mode (--enable-sleep-mode) uses its own memory pool"
    return None


def _driver_for(device: Any, settings: Config) -> Any:
    import torch

    from kvcached.driver import get_driver

    device = torch.device(device)
    if device.type == "cpu":
        return get_driver(settings.host_device, "host", config=settings)
    if device.type == "cuda":
        backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
        index = device.index if device.index is not None else torch.cuda.current_device()
        return get_driver(index, backend)
    raise KVCachedError(f"no kvcached backend for torch device {device}")


def _serving() -> bool:
    """Whether this call is the worker's real KV allocation and kvcached serves it."""
    return STATE.active and WORKER.allocating and WORKER.native_reason is None


def _open_buffer(plan: Any, device: Any, settings: Config) -> Any:
    """The virtual buffer of a new :class:`PageExecutor` (``WORKER.executor``)
    for the pages ``plan(settings.page_size)`` returns; ``None`` (logged once)
    when kvcached cannot page this cache."""
    from kvcached.integrations.vllm.executor import PageExecutor
    from kvcached.integrations.vllm.geometry import PlanError

    try:
        lanes = plan(settings.page_size)
        driver = _driver_for(device, settings)
    except (PlanError, KVCachedError) as exc:
        WORKER.native_reason = str(exc)
        log.warning(
            "vLLM %s worker rank %d: KV cache stays native: %s", STATE.version, WORKER.rank, exc
        )
        return None
    if WORKER.executor is not None:  # a second real allocation (re-initialisation)
        WORKER.executor.close()
    executor = PageExecutor(driver, lanes, settings=settings)
    executor.stalls.rank = WORKER.rank
    WORKER.executor = executor
    return executor.buffer()


def _log_allocated(hook: str, tensors: int, layers: int, layout: str) -> None:
    executor = WORKER.executor
    lanes = executor.lanes
    info = executor.driver.info()
    log.info(
        "vLLM %s worker rank %d: %s patched; %d KV tensor%s, %d layers, %s, "
        "%d pages of %d blocks (%s each), virtual %s (%s %s)",
        STATE.version,
        WORKER.rank,
        hook,
        tensors,
        "" if tensors == 1 else "s",
        layers,
        layout,
        lanes.num_pages,
        lanes.blocks_per_page,
        format_bytes(lanes.page_bytes),
        format_bytes(lanes.size),
        info.backend,
        info.pci_bus_id,
    )


def allocate_kv_cache(
    kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None
) -> dict[str, Any]:
    """vLLM's ``allocate_kv_cache`` (``kv_alloc = "views"``) over a kvcached
    virtual buffer (see the module docstring); vLLM's own allocation whenever
    kvcached is not serving."""
    native = original(allocate_kv_cache)
    if not (_serving() and kv_cache_config.kv_cache_tensors):
        return native(kv_cache_config, device, layout, kernel_block_sizes)
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    from kvcached.integrations.vllm.geometry import plan_lanes

    buf = _open_buffer(
        lambda page_size: plan_lanes(kv_cache_config, layout, page_size), device, STATE.settings
    )
    if buf is None:
        return native(kv_cache_config, device, layout, kernel_block_sizes)
    kv_caches: dict[str, Any] = {}
    layers = 0
    for tensor in kv_cache_config.kv_cache_tensors:
        # The same walk as vLLM's allocate_kv_cache (vllm/v1/worker/utils.py).
        layer_name = tensor.layers[0]
        group_id, group = next(
            (i, g)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if layer_name in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        layers += len(tensor.layers)
        if not spec.has_layer_views:
            kv_caches.update((name, buf) for name in tensor.layers)
            continue
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            buf,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size,
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    _log_allocated(
        "allocate_kv_cache",
        len(kv_cache_config.kv_cache_tensors),
        layers,
        getattr(layout, "name", str(layout)),
    )
    return kv_caches


def _raw_kv_tensors(kv_cache_config: Any, device: Any, runner: str) -> Any:
    """``kv_alloc = "raw"`` (vLLM 0.26): every layer's raw tensor as a slice of a
    kvcached virtual buffer (:mod:`.raw_kv`), or ``None``: allocate natively.
    ``runner`` ("V1" or "V2") is named in the log line, which the GPU runs read."""
    if not (_serving() and kv_cache_config.kv_cache_tensors):
        return None
    from kvcached.integrations.vllm import raw_kv

    buf = _open_buffer(
        lambda page_size: raw_kv.plan_raw_lanes(kv_cache_config, page_size),
        device,
        STATE.settings,
    )
    if buf is None:
        return None
    tensors = raw_kv.raw_tensors(kv_cache_config, buf)
    _log_allocated(
        f"{runner} runner's KV allocation",
        len(kv_cache_config.kv_cache_tensors),
        len(tensors),
        "packed" if raw_kv.is_packed(kv_cache_config) else "per-layer",
    )
    return tensors


def _allocate_raw_v2(kv_cache_config: Any, shared_layers: dict[str, str], device: Any) -> Any:
    """The V2 runner's ``attn_utils._allocate_kv_cache`` (0.26)."""
    tensors = _raw_kv_tensors(kv_cache_config, device, "V2")
    if tensors is None:
        return original(_allocate_raw_v2)(kv_cache_config, shared_layers, device)
    return tensors


def _allocate_raw_v1(self: Any, kv_cache_config: Any) -> Any:
    """The V1 runner's ``GPUModelRunner._allocate_kv_cache_tensors`` (0.26)."""
    tensors = _raw_kv_tensors(kv_cache_config, self.device, "V1")
    if tensors is None:
        return original(_allocate_raw_v1)(self, kv_cache_config)
    return tensors


#: Blocks per request and KV cache group that vLLM 0.26's V2 warm-up may use
#: (prompts of decode_query_len + 1 tokens, then decode_query_len more: one
#: block, two with speculative blocks); only a bound on the pages mapped for it.
WARMUP_BLOCKS_PER_REQUEST = 2


def _warmup_kernels(model_runner: Any, worker_execute_model: Any, worker_sample_tokens: Any) -> Any:
    """vLLM 0.26's V2 warm-up (``gpu.warmup.warmup_kernels``) runs real steps on
    blocks ``1, 2, ...`` of the KV cache, outside any plan: map enough pages for
    it, and have it count only those blocks (it sizes its batch by
    ``kv_cache_config.num_blocks``), then unmap them. If they cannot be mapped,
    it warms up within page 0 (the null block's, always mapped)."""
    orig = original(_warmup_kernels)
    executor = WORKER.executor
    config = getattr(model_runner, "kv_cache_config", None)
    if executor is None or not STATE.active or config is None:
        return orig(model_runner, worker_execute_model, worker_sample_tokens)
    lanes = executor.lanes
    groups = max(1, len(config.kv_cache_groups))
    want = 1 + int(getattr(model_runner, "max_num_reqs", 256)) * groups * WARMUP_BLOCKS_PER_REQUEST
    pages = min(lanes.num_pages, -(-want // lanes.blocks_per_page))
    if not executor.map_warmup(pages):
        log.warning("vLLM %s worker rank %d: warm-up limited to page 0", STATE.version, WORKER.rank)
        pages = 1
    saved = config.num_blocks
    config.num_blocks = pages * lanes.blocks_per_page
    try:
        return orig(model_runner, worker_execute_model, worker_sample_tokens)
    finally:
        config.num_blocks = saved
        executor.unmap_warmup(pages)


# -- WorkerWrapperBase -----------------------------------------------------------------------
def _initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
    orig = original(_initialize_from_config)
    if not STATE.active:
        return orig(self, kv_cache_configs)
    vllm_config = self.vllm_config
    WORKER.vllm_config = vllm_config
    WORKER.rank = getattr(self, "rpc_rank", 0)
    WORKER.world_size = vllm_config.parallel_config.tensor_parallel_size
    reason = refusal_reason(vllm_config)
    if reason is not None:
        WORKER.native_reason = reason
        return orig(self, kv_cache_configs)
    WORKER.allocating = True
    try:
        return orig(self, kv_cache_configs)
    finally:
        WORKER.allocating = False


def _apply_ops(
    ops: list[Any], sync: int | None = None, wait: bool = True
) -> tuple[float | None, float | None]:
    """Apply page ops on this rank: first (with ``wait``, or when any op must
    precede the step) finish those still running beside earlier steps, then
    apply ``ops[:sync]`` (all of them by default) and start the rest in the
    executor's thread, beside the step about to run. With several ranks,
    agree on the outcome of every map applied before the step and of the
    overlapped ones just finished (the same ops and ``wait`` reach every rank,
    so every rank agrees at the same step). Returns the seconds spent waiting
    for the ops beside earlier steps and applying ``ops[:sync]`` (``None``
    for either that did not happen), for the step's tally (:mod:`.stalls`)."""
    executor = WORKER.executor
    if executor is None:
        raise KVCachedError("page ops reached a worker whose KV cache kvcached does not hold")
    now = ops if sync is None or sync >= len(ops) else ops[:sync]
    overlapped_maps, ok = False, True
    wait_s = sync_s = None
    if (wait or now) and executor.overlapping:
        overlapped_maps = executor.overlapped_maps
        began = time.perf_counter()
        ok = executor.finish()
        wait_s = time.perf_counter() - began
    if ok and now:
        began = time.perf_counter()
        ok = executor.apply(now)
        sync_s = time.perf_counter() - began
    if WORKER.world_size > 1 and (overlapped_maps or any(op[0] == "map" for op in now)):
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        ok = bool(flag.item())
    if not ok:
        raise KVCachedError(
            "a device refused KV memory the ledger granted; the step cannot run without it "
            "(another process took the memory outside kvcached's budget, or "
            "KVCACHED_GPU_UTILIZATION leaves too small a safety margin)"
        )
    if len(now) < len(ops):
        executor.overlap(ops[len(now) :])
    return wait_s, sync_s


def apply_step_ops(scheduler_output: Any) -> None:
    """Before a step: its page ops (``kvcached_ops``, the first
    ``kvcached_sync`` of them at once), after the end of those still beside
    earlier steps where ``kvcached_wait`` says so (this step uses a page they
    map; absent, as from an engine core that does not say, it waits)."""
    ops = getattr(scheduler_output, "kvcached_ops", None)
    wait = getattr(scheduler_output, "kvcached_wait", True)
    executor = WORKER.executor
    stalled: tuple[float | None, float | None] = (None, None)
    if ops:  # a worker without kvcached's cache raises here: ops would be lost
        stalled = _apply_ops(ops, scheduler_output.kvcached_sync, wait)
    elif executor is None:  # the KV cache stayed native
        return
    elif wait and executor.overlapping:
        stalled = _apply_ops([])
    executor.stalls.step(*stalled)


def _execute_model(self: Any, scheduler_output: Any) -> Any:
    apply_step_ops(scheduler_output)
    return original(_execute_model)(self, scheduler_output)


def _kvcached_describe(self: Any) -> dict[str, Any]:
    if WORKER.executor is None or not STATE.active:
        return {
            "ok": False,
            "reason": WORKER.native_reason
            or STATE.off_reason
            or "the worker's KV cache is not kvcached's",
        }
    desc = WORKER.executor.describe()
    desc["rank"] = WORKER.rank
    return desc


def _kvcached_apply_page_ops(self: Any, ops: list[Any]) -> int:
    _apply_ops(ops)
    return WORKER.executor.mapped_pages


# -- startup memory checks ---------------------------------------------------------------------
def _request_memory(init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0) -> int:
    """vLLM's ``request_memory`` without the refusal to start when another
    process already uses the device: with kvcached the KV cache takes no
    memory at start, and the ledger shares what is free. One wrapper for both
    signatures (``external_weight_memory`` came with 0.32, default 0)."""
    if not STATE.active:
        native = original(_request_memory)
        if external_weight_memory:
            return native(init_snapshot, cache_config, external_weight_memory)
        return native(init_snapshot, cache_config)
    requested = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    return max(1, requested - max(0, external_weight_memory))


def _gpu_determine_available_memory(self: Any) -> int:
    """Profile as with ``--kv-cache-memory-bytes`` (which compiles the model but
    asserts nothing about the device's free memory) and report the virtual
    capacity ``total x KVCACHED_GPU_UTILIZATION`` minus this process' own
    peak use, unless the user gave a KV size."""
    orig = original(_gpu_determine_available_memory)
    cache = self.cache_config
    if (
        not STATE.active
        or refusal_reason(self.vllm_config) is not None
        or cache.kv_cache_memory_bytes
    ):
        return orig(self)
    import torch

    utilization = STATE.settings.gpu_utilization
    total = self.init_snapshot.total_memory
    cache.kv_cache_memory_bytes = max(1, int(total * utilization))
    try:
        orig(self)
    finally:
        cache.kv_cache_memory_bytes = None
    own = 0
    try:
        own = torch.cuda.max_memory_reserved(self.device)
    except Exception as e:  # no CUDA statistics: the worker's own use counts as 0
        log.warning("torch.cuda.max_memory_reserved(%s) failed (%s); counting none", self.device, e)
    return max(1, int(total * utilization) - own)


def _host_capacity(settings: Config) -> int:
    """The host backend's capacity (``KVCACHED_HOST_CAPACITY``), which every
    kvcached server on the host shares."""
    from kvcached.driver import get_driver

    return get_driver(settings.host_device, "host", config=settings).info().total_bytes


def _cpu_worker_init(
    self: Any,
    vllm_config: Any,
    local_rank: int,
    rank: int,
    distributed_init_method: str,
    is_driver_worker: bool = False,
) -> None:
    """Without ``VLLM_CPU_KVCACHE_SPACE`` the CPU worker sizes its cache from the
    NUMA node's free memory and refuses to start when other processes use it.
    With kvcached the size is virtual: make it the host backend's capacity
    (``KVCACHED_HOST_CAPACITY``), which every kvcached server on the host shares."""
    cache = vllm_config.cache_config
    if STATE.active and refusal_reason(vllm_config) is None and not cache.kv_cache_memory_bytes:
        cache.kv_cache_memory_bytes = _host_capacity(STATE.settings)
    original(_cpu_worker_init)(
        self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker
    )


def _cpu_determine_available_memory(self: Any) -> int:
    """The CPU worker's size without its check against the node's free memory."""
    orig = original(_cpu_determine_available_memory)
    if not STATE.active or refusal_reason(self.vllm_config) is not None:
        return orig(self)
    if self._should_warm_up_model():
        self.model_runner.warming_up_model()
    size = self.cache_config.kv_cache_memory_bytes
    if not size:
        size = _host_capacity(STATE.settings)
    log.debug("vLLM CPU worker: virtual KV cache of %s", format_bytes(size))
    return size


# -- patch groups (their parameter lists come from the release's row, :mod:`.releases`) ----------
def check_utils(module: ModuleType, row: Release) -> str | None:
    reason = check_params(module, "request_memory", row.request_memory)
    if reason is None and row.kv_alloc == "views":
        reason = check_params(module, "allocate_kv_cache", ALLOCATE_PARAMS)
    return reason


def install_utils(patcher: Patcher, module: ModuleType, row: Release) -> None:
    if row.kv_alloc == "views":
        patcher.replace(module, "allocate_kv_cache", allocate_kv_cache)
    patcher.replace(module, "request_memory", _request_memory)


def check_runner(module: ModuleType, row: Release) -> str | None:
    if row.kv_alloc == "raw":
        return check_params(module.GPUModelRunner, "_allocate_kv_cache_tensors", RAW_V1_PARAMS)
    return check_params(module, "allocate_kv_cache", ALLOCATE_PARAMS)


def install_runner(patcher: Patcher, module: ModuleType, row: Release) -> None:
    if row.kv_alloc == "raw":
        patcher.replace(module.GPUModelRunner, "_allocate_kv_cache_tensors", _allocate_raw_v1)
    else:
        patcher.replace(module, "allocate_kv_cache", allocate_kv_cache)


def check_attn_utils(module: ModuleType, row: Release) -> str | None:
    if row.kv_alloc == "raw":
        return check_params(module, "_allocate_kv_cache", RAW_V2_PARAMS)
    return check_params(module, "allocate_kv_cache", ALLOCATE_PARAMS)


def install_attn_utils(patcher: Patcher, module: ModuleType, row: Release) -> None:
    if row.kv_alloc == "raw":
        patcher.replace(module, "_allocate_kv_cache", _allocate_raw_v2)
    else:
        patcher.replace(module, "allocate_kv_cache", allocate_kv_cache)


def check_worker_base(module: ModuleType, row: Release) -> str | None:
    cls = module.WorkerWrapperBase
    return check_params(
        cls, "initialize_from_config", ("self", "kv_cache_configs")
    ) or check_params(cls, "execute_model", ("self", "scheduler_output"))


def install_worker_base(patcher: Patcher, module: ModuleType, row: Release) -> None:
    cls = module.WorkerWrapperBase
    patcher.replace(cls, "initialize_from_config", _initialize_from_config)
    patcher.replace(cls, "execute_model", _execute_model)
    patcher.add(cls, "kvcached_describe", _kvcached_describe)
    patcher.add(cls, "kvcached_apply_page_ops", _kvcached_apply_page_ops)


def check_request_memory(module: ModuleType, row: Release) -> str | None:
    return check_params(module, "request_memory", row.request_memory)


def install_request_memory(patcher: Patcher, module: ModuleType, row: Release) -> None:
    patcher.replace(module, "request_memory", _request_memory)


def check_gpu_worker(module: ModuleType, row: Release) -> str | None:
    reason = check_request_memory(module, row) or check_params(
        module.Worker, "determine_available_memory", ("self",)
    )
    if reason is None and row.kv_alloc == "raw":
        reason = check_params(
            module,
            "warmup_kernels",
            ("model_runner", "worker_execute_model", "worker_sample_tokens"),
        )
    return reason


def install_gpu_worker(patcher: Patcher, module: ModuleType, row: Release) -> None:
    install_request_memory(patcher, module, row)
    if row.kv_alloc == "raw":
        patcher.replace(module, "warmup_kernels", _warmup_kernels)
    patcher.replace(module.Worker, "determine_available_memory", _gpu_determine_available_memory)


def check_cpu_worker(module: ModuleType, row: Release) -> str | None:
    if not row.cpu_build:
        return "kvcached was not proven on this release's CPU build"
    cls = module.CPUWorker
    return (
        check_params(cls, "determine_available_memory", ("self",))
        or check_params(cls, "_should_warm_up_model", ("self",))
        or check_params(
            cls,
            "__init__",
            (
                "self",
                "vllm_config",
                "local_rank",
                "rank",
                "distributed_init_method",
                "is_driver_worker",
            ),
        )
    )


def install_cpu_worker(patcher: Patcher, module: ModuleType, row: Release) -> None:
    patcher.replace(module.CPUWorker, "__init__", _cpu_worker_init)
    patcher.replace(module.CPUWorker, "determine_available_memory", _cpu_determine_available_memory)
