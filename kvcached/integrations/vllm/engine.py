"""Patches in vLLM's engine core: KV sizing, the block pool, capacity, steps.

* ``EngineCore._initialize_kv_caches``: while vLLM builds its KV cache
  configs, ``num_blocks`` is rounded up to whole pages (the wrapped
  ``get_kv_cache_config_from_groups`` asks again with vLLM's own
  ``num_gpu_blocks_override`` set to the rounded count); then the
  workers describe their buffers (``kvcached_describe``) and the engine core
  opens one ledger pool per rank and builds the :class:`StepPlanner`, before
  vLLM builds its scheduler.
* ``kv_cache_coordinator.BlockPool`` builds a ``KvcachedBlockPool`` over that
  planner (vLLM's only construction site), which joins the control layer.
* ``KVCacheManager.allocate_slots`` notes the blocks vLLM keeps back
  (``reserved_blocks``, the watermark) and the coordinator's
  ``get_num_blocks_to_allocate``, inside that call only, reserves the exact
  need before vLLM compares it with ``get_num_free_blocks()``.
* ``Scheduler.schedule`` serves posted control requests, then attaches the
  step's page ops to its ``SchedulerOutput`` (``kvcached_ops``, and in
  ``kvcached_sync`` how many must precede the step's first kernel) and
  ``kvcached_wait`` (whether workers finish the ops still beside earlier steps
  first);
  ``Scheduler.update_from_output`` refunds what the step's output confirms.
* ``EngineCoreProc`` flushes page ops to the workers whenever it is about to
  wait idle, and serves control requests on ``WAKEUP``;
  ``EngineCore.reset_prefix_cache`` flushes the released pages at once.

Settings come from ``STATE.settings``, the :class:`~kvcached.config.Config`
this process' entry point read (:func:`kvcached.integrations.vllm.apply`), and
go on to our own functions as parameters; nothing here reads the environment.
The workers' page size is their own entry point's, read from the environment
the engine core started them with, so the same value: vLLM's one carrier of a
value the engine core resolves for its workers is the ``KVCacheConfig`` it
sends them, and a field of ours on vLLM's dataclass, pickled to every rank,
would be a second channel for one setting beside the ones the workers need
anyway (host device, utilization, ledger).

Three things stay, each for a reason vLLM gives:

* ``ENGINE.sizing``, a flag set only while ``_initialize_kv_caches`` runs:
  vLLM reaches ``get_kv_cache_config_from_groups`` from
  ``get_kv_cache_configs`` through its module's namespace, with no argument of
  ours, and calls it outside the sizing too (a worker's minimal cache for
  CUDA-graph profiling, which stays as vLLM sizes it); the flag tells the
  two apart and carries no setting.
* ``num_gpu_blocks_override``, set for one call of vLLM's builder and put
  back: the builder derives every tensor's size, strides and offsets from
  ``num_blocks`` inside one function and takes the count only from the
  available memory or from that override, which wins over the memory (so a
  user's own override would defeat a memory-based request); vLLM sets it the
  same way for its profiling cache (``_init_minimal_kv_cache_for_profiling``).
* ``kvcached_describe``, one RPC after the workers allocated: the engine core
  has no device, and which device each rank's buffer is on (the ledger is per
  device), its free and total memory, and whether the rank could open a buffer
  at all are known only there; the geometry comes with them so the engine core
  plans over what each rank really reserved from the per-rank configs it never
  sees (``_initialize_kv_caches`` returns only the scheduler's copy).
"""

from __future__ import annotations

import inspect
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvcached.errors import KVCachedError
from kvcached.integrations.patching import Patcher, check_params, original, wrapped
from kvcached.integrations.vllm.releases import Release
from kvcached.integrations.vllm.state import STATE
from kvcached.integrations.vllm.worker import refusal_reason
from kvcached.log import get_logger
from kvcached.units import format_bytes

if TYPE_CHECKING:
    from kvcached.config import Config

log = get_logger("integrations.vllm")


class _Engine:
    """This process' engine-core state."""

    sizing = False  # inside the engine core's _initialize_kv_caches (module docstring)
    pending: Any = None  # an EngineContext waiting for vLLM to build its block pool
    block_size = 16


ENGINE = _Engine()
_NATIVE_BLOCK_POOL: Any = None


class _ReportedMemInfo:
    """The ledger's sampler in the engine core, which has no device: what a
    worker reported. Used only if the engine core creates the ledger file
    (the workers normally have) and to check the safety margin."""

    def __init__(self, free: int, total: int) -> None:
        self.free, self.total = free, total

    def mem_info(self) -> tuple[int, int]:
        return self.free, self.total


def _context_of(scheduler: Any) -> Any:
    manager = getattr(scheduler, "kv_cache_manager", None)
    return getattr(getattr(manager, "block_pool", None), "kvcached", None)


# -- sizing ----------------------------------------------------------------------------------
def _get_kv_cache_config_from_groups(
    vllm_config: Any, kv_cache_groups: Any, available_memory: int
) -> Any:
    orig = original(_get_kv_cache_config_from_groups)
    config = orig(vllm_config, kv_cache_groups, available_memory)
    if not ENGINE.sizing or not STATE.active or not config.kv_cache_tensors:
        return config
    from kvcached.integrations.vllm.geometry import PlanError, blocks_per_page

    settings = STATE.settings
    try:
        config, shapes = _paged(vllm_config, config, settings.contiguous_layout)
        bpp = blocks_per_page(shapes, settings.page_size)
    except PlanError:
        return config  # the workers find the same and stay native
    if config.num_blocks % bpp == 0:
        return config
    # vLLM's own override of the block count (may_override_num_blocks reads it in
    # every release) carries the rounded count into its config builder.
    cache_config = vllm_config.cache_config
    override = cache_config.num_gpu_blocks_override
    cache_config.num_gpu_blocks_override = -(-config.num_blocks // bpp) * bpp
    try:
        rounded = orig(vllm_config, kv_cache_groups, available_memory)
        return _paged(vllm_config, rounded, settings.contiguous_layout)[0]
    finally:
        cache_config.num_gpu_blocks_override = override


def _paged(vllm_config: Any, config: Any, contiguous: bool | None) -> tuple[Any, list[Any]]:
    """The KV config the workers will get, and its tensors' byte geometry.
    ``kv_alloc = "views"``: vLLM's config under its resolved layout. ``"raw"``
    (0.26): with ``contiguous`` (``KVCACHED_CONTIGUOUS_LAYOUT``) true the config
    in vLLM's packed layout where its backends can view that (:func:`.raw_kv.pack`)."""
    from kvcached.integrations.vllm.geometry import tensor_shapes
    from kvcached.integrations.vllm.releases import row

    if row(STATE.version).kv_alloc == "views":
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        return config, tensor_shapes(config, layout)
    from kvcached.integrations.vllm import raw_kv

    if contiguous:
        packed = raw_kv.pack(config)
        if packed is not None:
            config = packed
        elif not raw_kv.is_packed(config):
            log.info(
                "KVCACHED_CONTIGUOUS_LAYOUT=true: vLLM %s cannot view this model's KV "
                "cache packed (tensors of several sizes, or a backend that does not index "
                "KV by the block stride); keeping its per-layer layout",
                STATE.version,
            )
    return config, raw_kv.raw_shapes(config)[0]


def _resolve_kv_cache_layout(
    vllm_config: Any, supported_layouts: list[list[str]], kv_cache_specs: Any = None
) -> Any:
    """vLLM's layout choice, with ``KVCACHED_CONTIGUOUS_LAYOUT`` as a preference:
    ``true`` takes the attention backends' most preferred block-outermost layout
    (every layer of a block side by side, one handle per page), ``false`` their
    most preferred layer-outermost one, ``auto`` (and any layout the user set,
    by ``VLLM_KV_CACHE_LAYOUT`` or in the config) is vLLM's own choice. A
    preference no backend supports is said once and vLLM's choice kept."""
    orig = original(_resolve_kv_cache_layout)
    from vllm import envs

    want = STATE.settings.contiguous_layout
    if (
        not STATE.active
        or want is None
        or envs.VLLM_KV_CACHE_LAYOUT is not None
        or vllm_config.cache_config.kv_cache_layout is not None
        or not supported_layouts
    ):
        return orig(vllm_config, supported_layouts, kv_cache_specs)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    names = [
        n
        for n in supported_layouts[0]
        if n in KVCacheLayout.__members__ and KVCacheLayout[n].is_block_outermost == want
    ]
    for name in names:  # the backends' order of preference
        filtered = [[n for n in per_worker if n == name] for per_worker in supported_layouts]
        if all(filtered):
            try:
                return orig(vllm_config, filtered, kv_cache_specs)
            except ValueError:  # vLLM's own constraints (mixed page sizes, ...) refuse it
                vllm_config.cache_config.kv_cache_layout = None
    layout = orig(vllm_config, supported_layouts, kv_cache_specs)
    log.info(
        "KVCACHED_CONTIGUOUS_LAYOUT=%s: the attention backends support no %s KV "
        "layout (%s); keeping vLLM's %s",
        str(want).lower(),
        "block-outermost" if want else "layer-outermost",
        ", ".join(supported_layouts[0]),
        layout.name,
    )
    return layout


def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
    orig = original(_initialize_kv_caches)
    if not STATE.active:
        return orig(self, vllm_config)
    reason = refusal_reason(vllm_config)
    if reason is not None:
        log.warning(
            "vLLM %s engine core: kvcached does not serve this configuration (%s); "
            "vLLM runs with its own KV cache",
            STATE.version,
            reason,
        )
        return orig(self, vllm_config)
    ENGINE.sizing = True
    try:
        kv_cache_config = orig(self, vllm_config)
    finally:
        ENGINE.sizing = False
    descs = self.collective_rpc("kvcached_describe")
    oks = [bool(d.get("ok")) for d in descs]
    if not any(oks):
        log.warning(
            "vLLM %s engine core: the workers keep native KV caches (%s); vLLM runs "
            "with its own KV cache",
            STATE.version,
            descs[0].get("reason"),
        )
        return kv_cache_config
    if not all(oks):
        raise KVCachedError(f"kvcached holds the KV cache of some workers only: {descs}")
    ENGINE.block_size = vllm_config.cache_config.block_size
    scheduler = getattr(vllm_config, "scheduler_config", None)
    step_tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
    context = build_context(kv_cache_config, descs, STATE.settings, step_tokens=step_tokens)
    # Idle data-parallel ranks run dummy batches that may read the null block
    # (docs/vllm-integration.md, open points): keep its page mapped there.
    parallel = getattr(vllm_config, "parallel_config", None)
    context.park_null_ok = int(getattr(parallel, "data_parallel_size", 1) or 1) <= 1
    context.bind_engine(self)
    context.planner.rpc = lambda ops: self.collective_rpc("kvcached_apply_page_ops", args=(ops,))
    ENGINE.pending = context
    return kv_cache_config


def step_reserve(
    step_tokens: int, tokens_per_page: int, num_pages: int, min_pages: int, max_pages: int
) -> tuple[int, int]:
    """The planner's reserve ``(min, max)`` in pages: at least one step's token
    budget (vLLM's ``max_num_batched_tokens``), so that a step, even a whole
    prompt's prefill, takes pages already mapped while the refill runs beside it;
    at least ``KVCACHED_MIN/MAX_RESERVED_PAGES``; idle pages are kept up to twice
    that before the surplus is unmapped, so a load that swings by a step's worth
    does not map and unmap the same pages. Never more than a quarter of the
    cache's pages (a small cache is not all reserve)."""
    step_pages = -(-max(0, step_tokens) // max(1, tokens_per_page))
    cap = max(min_pages, num_pages // 4)
    low = min(cap, max(min_pages, step_pages))
    high = min(max(cap, max_pages), max(max_pages, 2 * low))
    return low, max(low, high)


def build_context(
    kv_cache_config: Any, descs: list[dict[str, Any]], settings: Config, *, step_tokens: int = 0
) -> Any:
    """Ledger pools for every rank, the planner, and the control instance, as
    ``settings`` say (ledger directory, margin, reserve, overlap);
    ``step_tokens`` sizes the reserve (:func:`step_reserve`)."""
    from kvcached.control.instance import get_instance
    from kvcached.integrations.vllm.control import EngineContext
    from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
    from kvcached.ledger import Ledger
    from kvcached.memory.composite_budget import CompositeBudget

    first = descs[0]
    keys = ("num_pages", "blocks_per_page", "page_bytes", "granularity")
    for d in descs[1:]:
        if any(d[k] != first[k] for k in keys):
            raise KVCachedError(f"ranks disagree on the KV pages: {first} vs {d}")
    if first["num_pages"] * first["blocks_per_page"] != kv_cache_config.num_blocks:
        raise KVCachedError(
            f"the workers' {first['num_pages']} pages of {first['blocks_per_page']} blocks are "
            f"not vLLM's {kv_cache_config.num_blocks} blocks"
        )
    instance = get_instance(
        "vllm", STATE.version, ipc_name=settings.ipc_name, yield_idle=settings.yield_idle
    )
    ledgers: dict[str, Any] = {}
    pools: list[Any] = []
    try:
        for d in descs:
            device = d["device_id"]
            if device not in ledgers:
                ledgers[device] = Ledger.open(
                    device,
                    _ReportedMemInfo(d["free"], d["total"]),
                    directory=settings.ledger_dir,
                    gpu_utilization=settings.gpu_utilization,
                )
            pools.append(ledgers[device].register_pool(instance.name))
        budget = CompositeBudget(pools, devices=[d["device_id"] for d in descs])
        geometry = planner_geometry(
            first["num_pages"], first["blocks_per_page"], first["page_bytes"], first["granularity"]
        )
        min_reserved, max_reserved = step_reserve(
            step_tokens,
            first["blocks_per_page"] * ENGINE.block_size,
            first["num_pages"],
            settings.min_reserved_pages,
            settings.max_reserved_pages,
        )
        planner = StepPlanner(
            geometry,
            budget,
            world_size=len(descs),
            min_reserved=min_reserved,
            max_reserved=max_reserved,
            beside_steps=settings.beside_steps,
        )
    except BaseException:
        for pool in pools:
            try:
                pool.close()
            except Exception:  # the setup's own error is the one to raise
                log.warning(
                    "closing a ledger pool after a failed engine setup failed", exc_info=True
                )
        raise
    return EngineContext(
        planner,
        instance=instance,
        devices=[d["device_id"] for d in descs],
        backend=first["backend"],
        pools=pools,
        ledgers=list(ledgers.values()),
    )


# -- the block pool ------------------------------------------------------------------------------
def _make_block_pool(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``BlockPool(...)`` in the coordinator: a ``KvcachedBlockPool`` when
    the engine core prepared a planner of that many blocks, else native."""
    native = _NATIVE_BLOCK_POOL
    context = ENGINE.pending
    if context is None or not STATE.active:
        return native(*args, **kwargs)
    params = inspect.signature(native.__init__).bind(None, *args, **kwargs)
    params.apply_defaults()
    values = dict(params.arguments)
    values.pop("self", None)
    if values["num_gpu_blocks"] != context.planner.num_blocks:
        return native(*args, **kwargs)
    from kvcached.integrations.vllm.block_pool import KvcachedBlockPool

    ENGINE.pending = None
    max_tokens = STATE.settings.max_cached_tokens
    cap = max_tokens // ENGINE.block_size if max_tokens >= 0 else -1
    pool = KvcachedBlockPool(context.planner, cap_blocks=cap, **values)
    pool.kvcached = context
    context.attach_pool(pool)
    planner = context.planner
    g = planner.geometry
    devices = sorted(set(context.devices))
    log.info(
        "vLLM %s engine core: block pool, allocate_slots, schedule, update_from_output, "
        "reset_prefix_cache patched; %d blocks of %d tokens, %d pages of %d blocks (%s per "
        "rank), virtual %s per rank, %d rank%s on %s, cache cap %s tokens, reserve %d-%d "
        "pages, page ops %s (KVCACHED_BESIDE_STEPS=%d), instance %s",
        STATE.version,
        planner.num_blocks,
        ENGINE.block_size,
        g.num_pages,
        g.blocks_per_page,
        format_bytes(g.page_bytes),
        format_bytes(g.num_pages * g.page_bytes),
        len(context.devices),
        "" if len(context.devices) == 1 else "s",
        ",".join(devices),
        "unlimited" if cap < 0 else cap * ENGINE.block_size,
        planner.pages.min_reserved,
        planner.pages.max_reserved,
        "beside the step" if planner.overlap else "before the step",
        planner.beside_steps,
        context.instance.name,
    )
    return pool


def _get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
    need = wrapped(_get_num_blocks_to_allocate)(self, *args, **kwargs)
    extra = getattr(self.block_pool, "alloc_extra", None)
    # A decode step that stays inside its last block needs nothing (15 of 16
    # steps at 16-token blocks): nothing to reserve, and no call to pay for.
    if extra is not None and need + extra > 0:
        self.block_pool.reserve(need + extra)
    return need


# On a kvcached pool, note the blocks vLLM keeps back beyond the need for the
# call's duration: ``reserved_blocks``, and the watermark, which vLLM applies
# only to waiting or preempted requests and only when others are scheduled
# (kv_cache_manager.allocate_slots). Inline, not a helper's call: this runs on
# every running request's every step.
_ALLOCATE_SLOTS_BODY = """
def allocate_slots({signature}):
    pool = self.block_pool
    if getattr(pool, "kvcached", None) is None:
        return orig({arguments})
    if has_scheduled_reqs and request.status in waiting:
        pool.alloc_extra = reserved_blocks + self.watermark_blocks
    else:
        pool.alloc_extra = reserved_blocks
    try:
        return orig({arguments})
    finally:
        pool.alloc_extra = None
"""


def allocate_slots_wrapper(native: Any, waiting: tuple[Any, ...]) -> Any:
    """A wrapper of ``KVCacheManager.allocate_slots`` (``native``) with exactly
    its parameters and defaults, which notes the blocks vLLM keeps back
    (:data:`_ALLOCATE_SLOTS_BODY`) for the duration of the call; ``waiting``:
    the request states vLLM's watermark applies to. Generated from the
    signature because the parameter list differs between releases
    (:mod:`.releases`) and the call is on every request's every step, where
    ``*args`` binding would cost."""
    params = inspect.signature(native).parameters
    defaults = {f"_d{i}": p.default for i, p in enumerate(params.values())}
    signature = ", ".join(
        name if p.default is inspect.Parameter.empty else f"{name}=_d{i}"
        for i, (name, p) in enumerate(params.items())
    )
    namespace: dict[str, Any] = {"orig": native, "waiting": waiting, **defaults}
    exec(  # noqa: S102 - the source is the fixed body above and vLLM's parameter names
        _ALLOCATE_SLOTS_BODY.format(signature=signature, arguments=", ".join(params)), namespace
    )
    return namespace["allocate_slots"]


# -- steps ----------------------------------------------------------------------------------------
def _schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
    orig = wrapped(_schedule)
    context = _context_of(self)
    if context is None:
        return orig(self, *args, **kwargs)
    began = time.perf_counter()
    context.instance.note_step()
    context.serve_control()
    native_began = time.perf_counter()
    output = orig(self, *args, **kwargs)
    native_ended = time.perf_counter()
    ops, step, sync = context.planner.ops_for_step()
    output.kvcached_step = step
    output.kvcached_wait = context.planner.step_waits
    if ops is not None:
        output.kvcached_ops = ops
        output.kvcached_sync = sync
    ended = time.perf_counter()
    context.step_cost.step(ended - began, ended - native_ended + native_began - began)
    return output


def _update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
    context = _context_of(self)
    if context is not None:
        step = getattr(scheduler_output, "kvcached_step", 0)
        if step:
            began = time.perf_counter()
            context.planner.step_done(step, scheduler_output.total_num_scheduled_tokens > 0)
            context.step_cost.output(time.perf_counter() - began)
    return wrapped(_update_from_output)(self, scheduler_output, model_runner_output)


# -- the engine core loop -----------------------------------------------------------------------
def _reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(_reset_prefix_cache)(self, *args, **kwargs)
    context = _context_of(self.scheduler)
    if context is not None:
        context.flush_if_idle()
    return result


def _handle_client_request(self: Any, request_type: Any, request: Any) -> None:
    original(_handle_client_request)(self, request_type, request)
    context = _context_of(getattr(self, "scheduler", None))
    if context is not None:
        context.serve_control()
        context.flush_if_idle()


def _process_input_queue(self: Any) -> Any:
    context = _context_of(getattr(self, "scheduler", None))
    if context is not None and not self.has_work():
        context.serve_control()
        context.flush_if_idle()
    return wrapped(_process_input_queue)(self)


def _shutdown(self: Any) -> None:
    context = _context_of(getattr(self, "scheduler", None))
    workers_gone = False
    try:
        original(_shutdown)(self)
        from kvcached.integrations.vllm.worker import WORKER

        if WORKER.executor is not None:  # a worker in this very process (UniProcExecutor)
            WORKER.executor.close()
            WORKER.executor = None
        workers_gone = True
    finally:
        if context is not None:
            try:
                context.close(workers_gone=workers_gone)
            except Exception:  # shutdown goes on; an error of vLLM's own shutdown wins
                log.exception("closing kvcached's engine context at shutdown failed")


# -- patch groups (their parameter lists come from the release's row, :mod:`.releases`) ----------
def check_kv_cache_utils(module: ModuleType, row: Release) -> str | None:
    return check_params(
        module,
        "get_kv_cache_config_from_groups",
        ("vllm_config", "kv_cache_groups", "available_memory"),
    ) or check_params(  # what reads num_gpu_blocks_override, the rounding's carrier
        module, "may_override_num_blocks", ("vllm_config", "num_blocks")
    )


def install_kv_cache_utils(patcher: Patcher, module: ModuleType, row: Release) -> None:
    patcher.replace(module, "get_kv_cache_config_from_groups", _get_kv_cache_config_from_groups)


def check_coordinator(module: ModuleType, row: Release) -> str | None:
    pool = getattr(module, "BlockPool", None)
    if pool is None:
        return "kv_cache_coordinator has no BlockPool"
    return check_params(original(pool), "__init__", row.block_pool) or check_params(
        module.KVCacheCoordinator, "get_num_blocks_to_allocate", row.blocks_to_allocate
    )


def install_coordinator(patcher: Patcher, module: ModuleType, row: Release) -> None:
    global _NATIVE_BLOCK_POOL
    _NATIVE_BLOCK_POOL = patcher.replace(module, "BlockPool", _make_block_pool)
    patcher.replace(
        module.KVCacheCoordinator, "get_num_blocks_to_allocate", _get_num_blocks_to_allocate
    )


def check_kv_cache_manager(module: ModuleType, row: Release) -> str | None:
    reason = check_params(module.KVCacheManager, "allocate_slots", row.allocate_slots)
    if reason is not None:
        return reason
    params = inspect.signature(original(module.KVCacheManager.allocate_slots)).parameters
    for name in ("reserved_blocks", "has_scheduled_reqs"):  # what the wrapper reads
        if params[name].default is inspect.Parameter.empty:
            return f"allocate_slots' {name} has no default"
    return None


def install_kv_cache_manager(patcher: Patcher, module: ModuleType, row: Release) -> None:
    from vllm.v1.request import RequestStatus

    cls = module.KVCacheManager
    waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    patcher.replace(
        cls, "allocate_slots", allocate_slots_wrapper(original(cls.allocate_slots), waiting)
    )


def check_scheduler(module: ModuleType, row: Release) -> str | None:
    cls = module.Scheduler
    return check_params(cls, "schedule", ("self", "throttle_prefills")) or check_params(
        cls, "update_from_output", ("self", "scheduler_output", "model_runner_output")
    )


def install_scheduler(patcher: Patcher, module: ModuleType, row: Release) -> None:
    patcher.replace(module.Scheduler, "schedule", _schedule)
    patcher.replace(module.Scheduler, "update_from_output", _update_from_output)


def check_engine_core(module: ModuleType, row: Release) -> str | None:
    core, proc = module.EngineCore, module.EngineCoreProc
    reason = (
        check_params(core, "_initialize_kv_caches", ("self", "vllm_config"))
        or check_params(
            core, "reset_prefix_cache", ("self", "reset_running_requests", "reset_connector")
        )
        or check_params(core, "shutdown", ("self",))
        or check_params(proc, "_handle_client_request", ("self", "request_type", "request"))
        or check_params(proc, "_process_input_queue", ("self",))
    )
    if reason is None and row.kv_alloc == "views":
        reason = check_params(
            module,
            "resolve_kv_cache_layout",
            ("vllm_config", "supported_layouts", "kv_cache_specs"),
        )
    return reason


def install_engine_core(patcher: Patcher, module: ModuleType, row: Release) -> None:
    core, proc = module.EngineCore, module.EngineCoreProc
    patcher.replace(core, "_initialize_kv_caches", _initialize_kv_caches)
    patcher.replace(core, "reset_prefix_cache", _reset_prefix_cache)
    patcher.replace(core, "shutdown", _shutdown)
    patcher.replace(proc, "_handle_client_request", _handle_client_request)
    patcher.replace(proc, "_process_input_queue", _process_input_queue)
    if row.kv_alloc == "views":  # 0.26 has no KVCacheLayout to choose
        patcher.replace(module, "resolve_kv_cache_layout", _resolve_kv_cache_layout)
