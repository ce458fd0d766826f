"""The patch groups for SGLang 0.5.17 and 0.5.20-0.5.23 (targets and reasons: docs/sglang-integration.md).

Each ``_install_*`` receives a :class:`~kvcached.integrations.patching.Patcher`
and its trigger module, and makes every change through the patcher (so a
failure halfway is undone). A wrapper calls SGLang's own function, found with
:func:`~kvcached.integrations.patching.original`, so installing twice wraps once. Nothing here imports SGLang at module level: the
SGLang-facing classes (``pools.py``) load when the ``pools`` group installs.

* ``pools`` (``mem_cache.kv_cache_configurator``): the configurator resolves
  the elastic pool classes for the plain MHA / MLA kinds (which also reaches
  the full-attention pool of hybrid linear-attention models), builds elastic
  allocators over elastic pools, and sizes the cache from a *virtual* budget
  instead of this GPU's free memory. 0.5.22/0.5.23 resolve every pool class
  through one method; 0.5.20/0.5.21 name the classes in the builders, so their
  group (:func:`_install_pools_by_name`) wraps the builders instead.
* ``startup-runner`` / ``startup-args``: SGLang's own post-capture VMM KV
  backing is switched off (kvcached owns the address range).
* ``scheduler`` (``managers.scheduler``): every scheduling round opens an
  agreement round on the allocator (TP budget, reservations, the prefix-cache
  cap and the control thread's eviction requests), prefill reserves its pages
  before allocating, and a prefill that cannot be reserved waits in the queue
  with its retraction history untouched. The same on every release but for
  where a request's extend bounds are read (:func:`extend_bounds`,
  :func:`extend_bounds_by_range`).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvcached.integrations.patching import Patcher, PatchGroup, original
from kvcached.integrations.sglang.state import group_states

#: Groups an elastic pool depends on: when one of these failed to install,
#: pools stay native (SGLang is never half kvcached).
REQUIRED_FOR_POOLS = ("pools", "scheduler")


class KVCacheMiss(Exception):
    """A prefill batch whose pages could not be reserved (control flow inside
    the integration: raised before the batch touches any memory, caught by the
    patched ``_get_new_batch_prefill_raw``, which requeues the batch)."""

    def __init__(self, reqs: list[Any]) -> None:
        super().__init__(f"{len(reqs)} request(s) wait for KV memory")
        self.reqs = reqs


def elastic_allowed() -> bool:
    """No group an elastic pool needs has failed in this process."""
    states = group_states()
    return all(not states.get(name, "pending").startswith("failed") for name in REQUIRED_FOR_POOLS)


# -- pools ------------------------------------------------------------------------------------


def _configurator_supported(conf: Any, module: ModuleType) -> str | None:
    """Why the configurator's pools must stay native, or ``None``."""
    try:
        memory = module.get_memory()
        parallel = module.get_parallel()
    except Exception as exc:  # global server args not set: not a real engine
        return f"SGLang's global arguments are not readable ({exc})"
    checks = [
        (
            getattr(conf, "is_draft_worker", False),
            "a draft worker (it shares the target's allocator)",
        ),
        (getattr(conf, "is_hybrid_swa", False), "hybrid SWA pools"),
        (getattr(conf, "kv_shard_rank", None) is not None, "KV cache sharding"),
        (getattr(parallel, "dcp_enabled", False), "decode context parallelism"),
        (getattr(memory, "enable_hisparse", False), "HiSparse"),
        (getattr(memory, "enable_unified_memory", False), "SGLang's unified memory pool"),
        (getattr(conf, "post_capture_kv_active", False), "SGLang's post-capture KV backing"),
        (getattr(module, "_is_npu", False), "an NPU"),
        (not elastic_allowed(), "a patch group kvcached needs failed to install"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


def _elastic_class(conf: Any, module: ModuleType, cls: type, default: type) -> type:
    """The class a pool of ``cls`` is built from: kvcached's elastic one when
    ``cls`` is exactly SGLang's plain MHA / MLA pool and the configuration is
    one kvcached covers, ``cls`` itself otherwise."""
    from kvcached.integrations.sglang import pools

    # SGLang's classes from memory_pool: on 0.5.20/0.5.21 the configurator's
    # own ``MLATokenToKVPool`` name is kvcached's factory once patched.
    elastic = {
        pools.MHATokenToKVPool: pools.ElasticMHATokenToKVPool,
        pools.MLATokenToKVPool: pools.ElasticMLATokenToKVPool,
    }.get(cls)
    if elastic is None or cls is not default:
        return cls  # a platform's own class, page-major, DSA: native
    why = _configurator_supported(conf, module)
    if why is not None:
        _log_once(f"SGLang's KV pools stay native: {why}")
        return cls
    return elastic


def _install_sizing_and_allocators(p: Patcher, module: ModuleType) -> None:
    """What every release's ``pools`` group shares: the virtual budget and
    the two allocator names the configurator calls."""
    from kvcached.integrations.sglang import pools

    conf_cls = module.KVCacheConfigurator
    profile = original(conf_cls._profile_available_bytes)

    @functools.wraps(profile)
    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
        if _configurator_supported(self, module) is not None:
            return profile(self, pre_model_load_memory)
        return _virtual_budget(self, module, profile, pre_model_load_memory)

    p.replace(conf_cls, "_profile_available_bytes", _profile_available_bytes)
    p.replace(module, "TokenToKVPoolAllocator", pools.token_allocator)
    p.replace(module, "PagedTokenToKVPoolAllocator", pools.paged_allocator)


def _install_pools(p: Patcher, module: ModuleType) -> None:
    """0.5.22 and 0.5.23: every builder gets its pool class from
    ``KVCacheConfigurator._resolve_kv_pool_class``, one seam for all."""
    conf_cls = module.KVCacheConfigurator
    resolve = original(conf_cls._resolve_kv_pool_class)

    @functools.wraps(resolve)
    def _resolve_kv_pool_class(self: Any, *, kind: str, default: type) -> type:
        return _elastic_class(self, module, resolve(self, kind=kind, default=default), default)

    p.replace(conf_cls, "_resolve_kv_pool_class", _resolve_kv_pool_class)
    _install_sizing_and_allocators(p, module)


#: Set while an old configurator's ``_build_mla_kv_pool`` builds a pool kvcached
#: covers (see :func:`_install_pools_by_name`); a context variable, so another
#: thread's pool build never sees it.
_ELASTIC_MLA: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvcached_elastic_mla", default=False
)


def _install_pools_by_name(p: Patcher, module: ModuleType) -> None:
    """0.5.20 and 0.5.21 have no ``_resolve_kv_pool_class``: the configurator
    names the pool classes itself. ``_build_token_to_kv_pool`` hands
    ``MHATokenToKVPool`` (or page-major) to ``_build_mha_kv_pool`` and
    ``_build_hybrid_linear_kv_pool`` as ``mha_pool_class``, so those two get
    the elastic class in that argument; ``_build_mla_kv_pool`` calls the
    module's ``MLATokenToKVPool`` by name, so that name becomes a factory that
    builds the elastic class only inside that builder, once the configuration
    was checked (the hybrid MLA + SWA builder passes the same name as a class
    and keeps SGLang's)."""
    from kvcached.integrations.sglang import pools

    conf_cls = module.KVCacheConfigurator
    native_mha, native_mla = pools.MHATokenToKVPool, pools.MLATokenToKVPool

    def with_elastic_mha(build: Any) -> Any:
        @functools.wraps(build)
        def wrapper(self: Any, **kwargs: Any) -> Any:
            cls = kwargs.get("mha_pool_class")
            kwargs["mha_pool_class"] = _elastic_class(self, module, cls, native_mha)
            return build(self, **kwargs)

        return wrapper

    mha = original(conf_cls._build_mha_kv_pool)
    linear = original(conf_cls._build_hybrid_linear_kv_pool)
    mla = original(conf_cls._build_mla_kv_pool)

    @functools.wraps(mla)
    def _build_mla_kv_pool(self: Any, **kwargs: Any) -> Any:
        elastic = _elastic_class(self, module, native_mla, native_mla) is not native_mla
        token = _ELASTIC_MLA.set(elastic)
        try:
            return mla(self, **kwargs)
        finally:
            _ELASTIC_MLA.reset(token)

    def mla_pool(*args: Any, **kwargs: Any) -> Any:
        cls = pools.ElasticMLATokenToKVPool if _ELASTIC_MLA.get() else native_mla
        return cls(*args, **kwargs)

    p.replace(conf_cls, "_build_mha_kv_pool", with_elastic_mha(mha))
    p.replace(conf_cls, "_build_hybrid_linear_kv_pool", with_elastic_mha(linear))
    p.replace(conf_cls, "_build_mla_kv_pool", _build_mla_kv_pool)
    p.replace(module, "MLATokenToKVPool", mla_pool)
    _install_sizing_and_allocators(p, module)


def _virtual_budget(conf: Any, module: ModuleType, native: Any, pre_model_load_memory: int) -> int:
    """The KV budget SGLang would compute on a GPU it had to itself:
    ``total * mem_fraction_static - this process' resident bytes``, MIN over
    the same world group with the same one collective. It only sizes the
    virtual reservation; physical use is bounded by the ledger at run time."""
    import torch

    from kvcached.config import get_config
    from kvcached.driver import get_driver

    dev = torch.device(conf.device)
    index = dev.index if dev.index is not None else int(getattr(conf, "gpu_id", 0) or 0)
    total = get_driver(index, config=get_config()).info().total_bytes
    resident = torch.cuda.memory_reserved(index) if dev.type == "cuda" else 0
    fraction = module.get_schedule().mem_fraction_static
    budget = int(total * fraction) - int(resident)
    parallel = module.get_parallel()
    if _world_size(parallel) > 1:
        import torch.distributed as dist

        t = torch.tensor([budget], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parallel.world_group.cpu_group)
        budget = int(t.item())
    if getattr(conf, "mambaish_config", None) is not None:
        budget = int(conf._handle_max_mamba_cache(budget / (1 << 30)) * (1 << 30))
    if budget <= 0:
        return native(conf, pre_model_load_memory)  # SGLang's own error message
    _log_once(
        f"KV cache sized from a virtual budget of {budget / (1 << 30):.2f} GiB "
        f"(total x {fraction} - {resident / (1 << 30):.2f} GiB resident); "
        "physical memory is mapped on demand"
    )
    return budget


def _world_size(parallel: Any) -> int:
    """The launch's world size, as this release's configurator reads it:
    ``launch_world_size`` (0.5.22 on, fixed across elastic scale-up), else the
    world group's size (0.5.17 to 0.5.21 have no such field; their
    ``ParallelContext`` raises ``AttributeError`` for it)."""
    try:
        return int(parallel.launch_world_size)
    except AttributeError:
        return int(parallel.world_size)


def _install_startup_runner(p: Patcher, module: ModuleType) -> None:
    import importlib

    runtime = importlib.import_module(
        "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"
    )

    def is_post_capture_kv_active(*args: Any, **kwargs: Any) -> bool:
        return False  # kvcached owns the KV address range

    p.replace(module, "is_post_capture_kv_active", is_post_capture_kv_active)
    p.replace(runtime, "is_post_capture_kv_active", is_post_capture_kv_active)


def _install_startup_args_method(p: Patcher, module: ModuleType) -> None:
    """0.5.17: ``post_capture_kv_sizing_planned`` is a ``ServerArgs`` method
    (``server_args.py``), read by ``__post_init__``'s memory heuristic and by
    ``kv_pool_runtime.is_post_capture_kv_active``."""

    def post_capture_kv_sizing_planned(self: Any) -> bool:
        return False

    p.replace(module.ServerArgs, "post_capture_kv_sizing_planned", post_capture_kv_sizing_planned)


def _install_startup_args(p: Patcher, module: ModuleType) -> None:
    import importlib

    overrides = importlib.import_module("sglang.srt.arg_groups.overrides")

    def post_capture_kv_sizing_planned(*args: Any, **kwargs: Any) -> bool:
        return False

    p.replace(module, "post_capture_kv_sizing_planned", post_capture_kv_sizing_planned)
    p.replace(overrides, "post_capture_kv_sizing_planned", post_capture_kv_sizing_planned)


# -- scheduler -----------------------------------------------------------------------------------


def slots_of(scheduler: Any) -> Any:
    return getattr(getattr(scheduler, "token_to_kv_pool_allocator", None), "kvcached_slots", None)


def _bind_scheduler(scheduler: Any, slots: Any) -> None:
    """First round of this scheduler: the TP reducer, the radix-cache hooks."""
    from kvcached.integrations.sglang.tp_agreement import GroupReducer

    groups = [
        getattr(scheduler, "attn_tp_cpu_group", None),
        getattr(scheduler, "attn_cp_cpu_group", None),
    ]
    slots.attach(GroupReducer([g for g in groups if g is not None]))
    tree = scheduler.tree_cache
    slots.evictor = functools.partial(evict_tokens, tree)
    source = slots.kv.source
    if source is not None:
        # Read by the control thread: a figure the scheduler thread wrote, not
        # a call into the tree (which belongs to the scheduler thread).
        source.prefix_cache_tokens = lambda: slots.prefix_cached_tokens
    slots.bound_scheduler = True


def evict_tokens(tree: Any, tokens: int) -> int:
    """Evict ``tokens`` of unreferenced prefix cache through SGLang's own
    ``evict`` (its LRU order, metrics, KV events and rank checks stay right)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if tokens <= 0 or tree.evictable_size() <= 0:
        return 0
    result = tree.evict(EvictParams(num_tokens=int(tokens)))
    return int(getattr(result, "num_tokens_evicted", 0) or 0)


def enforce_cache_cap(slots: Any, tree: Any, cap: int) -> int:
    """Evict the prefix cache down to ``cap`` tokens (``cap < 0``: unlimited),
    at least one whole kvcached page of tokens at a time, so what is evicted
    can come back as whole pages. The tree is identical on every TP rank, so
    every rank evicts the same without a collective. Returns tokens evicted."""
    if cap < 0 or slots.evictor is None:
        return 0
    excess = tree.evictable_size() - cap
    if excess <= 0:
        return 0
    g = slots.kv.cache.geometry
    page_tokens = g.blocks_per_page * slots.block_tokens
    want = -(-excess // page_tokens) * page_tokens
    got = slots.evictor(want)
    slots.evicted_tokens += got
    return got


def extend_bounds(req: Any) -> tuple[int, int]:
    """A request's ``(prefix length, end of this round's extend)`` as
    ``ScheduleBatch.prepare_for_extend`` of 0.5.22 and 0.5.23 reads them."""
    return req.prefix_len, req.extend_end


def extend_bounds_by_range(req: Any) -> tuple[int, int]:
    """The same on 0.5.20 and 0.5.21, whose ``prepare_for_extend`` takes
    ``len(req.prefix_indices)`` and ``req.extend_range.end`` (``Req`` has no
    ``extend_end`` there)."""
    return len(req.prefix_indices), req.extend_range.end


def _install_scheduler(
    p: Patcher, module: ModuleType, bounds: Callable[[Any], tuple[int, int]] = extend_bounds
) -> None:
    from kvcached.config import get_config

    scheduler_cls = module.Scheduler
    batch_cls = module.ScheduleBatch
    next_batch = original(scheduler_cls.get_next_batch_to_run)
    prefill_raw = original(scheduler_cls._get_new_batch_prefill_raw)
    prepare_extend = original(batch_cls.prepare_for_extend)
    on_idle = original(scheduler_cls.on_idle)
    cap = get_config().max_cached_tokens

    @functools.wraps(next_batch)
    def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        slots = slots_of(self)
        if slots is None:
            return next_batch(self, *args, **kwargs)
        if not slots.bound_scheduler:
            _bind_scheduler(self, slots)
        if slots.blocks.null_parked:  # before the round's forecast and any forward
            slots.unpark_padding()
        _note_step()
        slots.begin_round()
        try:
            enforce_cache_cap(slots, self.tree_cache, cap)
            slots.prefix_cached_tokens = self.tree_cache.evictable_size()
            return next_batch(self, *args, **kwargs)
        finally:
            slots.end_round()

    @functools.wraps(prefill_raw)
    def _get_new_batch_prefill_raw(self: Any, *args: Any, **kwargs: Any) -> Any:
        slots = slots_of(self)
        if slots is None:
            return prefill_raw(self, *args, **kwargs)
        snapshot = AdmissionSnapshot(self)
        slots.prefill_guard = True
        try:
            return prefill_raw(self, *args, **kwargs)
        except KVCacheMiss as miss:
            snapshot.requeue(self, miss.reqs)
            running = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
            return None, running
        finally:
            slots.prefill_guard = False

    @functools.wraps(prepare_extend)
    def prepare_for_extend(self: Any) -> Any:
        allocator = self.token_to_kv_pool_allocator
        slots = getattr(allocator, "kvcached_slots", None)
        if slots is not None and not self.is_dllm():
            reserve_for_extend(slots, allocator, self.tree_cache, self.reqs, bounds)
        return prepare_extend(self)

    @functools.wraps(on_idle)
    def on_idle_parking(self: Any, *args: Any, **kwargs: Any) -> Any:
        slots = slots_of(self)
        if slots is not None and not slots.blocks.null_parked:
            park_padding_if_idle(self, slots)
        return on_idle(self, *args, **kwargs)

    p.replace(scheduler_cls, "get_next_batch_to_run", get_next_batch_to_run)
    p.replace(scheduler_cls, "on_idle", on_idle_parking)
    p.replace(scheduler_cls, "_get_new_batch_prefill_raw", _get_new_batch_prefill_raw)
    p.replace(batch_cls, "prepare_for_extend", prepare_for_extend)
    _install_pool_accounting(p)


def park_padding_if_idle(scheduler: Any, slots: Any) -> bool:
    """SGLang's idle round (``Scheduler.on_idle``, before its own checks and any
    sleep): park the padding page (:meth:`SlotAllocator.park_padding`) when the
    scheduler is fully idle (nothing running, waiting, chunked or in the
    overlap queue: no forward in flight, none before the next round's unpark)
    and not under DP attention, whose idle ranks run dummy forwards."""
    if slots.blocks.limit_pages >= 1 or getattr(scheduler, "enable_dp_attention", False):
        return False
    if not scheduler.is_fully_idle():
        return False
    if slots.park_padding():
        _log_once(
            "the padding page is released while the instance is held at zero "
            "(kvctl limit or serve's kv sleep); it is mapped again once a page is allowed"
        )
        return True
    return False


def _note_step() -> None:
    """The instance's per-step look at its limits (``Instance.note_step``);
    imported here, not with this module, which SGLang imports at start-up in
    every process (the ``.pth`` line), pools or not."""
    from kvcached.control.instance import note_step

    note_step()


def unbacked_tokens(slots: Any, total: int, available: int) -> int:
    """The tokens of SGLang's pool of ``total`` that are neither held (SGLang's
    live blocks) nor ``available`` (what the allocator reported): capacity the
    physical budget does not back now. A static pool has none; an elastic one
    has all of it that other processes hold or that was never mapped."""
    return total - slots.n_live * slots.block_tokens - available


#: The elastic allocator's slots while SGLang checks its full pool (``_check_full_pool``).
_FULL_POOL_SLOTS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "kvcached_full_pool_slots", default=None
)


def _install_pool_accounting(p: Patcher) -> None:
    """SGLang's invariant checker (idle, and busy when asked) accounts the pool
    as ``available + evictable + protected + session_held + uncached == total``
    and raises on a difference by default (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``).
    Over an elastic allocator ``available`` is what the physical budget allows,
    below ``total`` whenever memory is elsewhere, so the unbacked rest is
    counted with ``uncached``: the check then is SGLang's own over what is held
    (cached + protected + in flight == SGLang's live blocks), and still fails
    on a real leak. The rest is counted where SGLang compares (its static
    ``_check_pool_invariant``, the ``full`` pool, inside ``_check_full_pool``),
    against the ``total`` SGLang chose: ``max_total_num_tokens`` for a plain pool,
    the allocator's size for hybrid linear attention (0.5.17; 0.5.23 its
    ``schedulable_token_capacity``). Hybrid SWA pools stay native."""
    from sglang.srt.managers.scheduler_components import invariant_checker as module

    checker_cls = module.SchedulerInvariantChecker
    check_full = original(checker_cls._check_full_pool)
    check_invariant = original(checker_cls._check_pool_invariant)

    @functools.wraps(check_full)
    def _check_full_pool(self: Any, ps: Any, uncached: int = 0) -> Any:
        slots = getattr(self.token_to_kv_pool_allocator, "kvcached_slots", None)
        if slots is None or getattr(self, "is_hybrid_swa", False):
            return check_full(self, ps, uncached=uncached)
        token = _FULL_POOL_SLOTS.set(slots)
        try:
            return check_full(self, ps, uncached=uncached)
        finally:
            _FULL_POOL_SLOTS.reset(token)

    @functools.wraps(check_invariant)
    def _check_pool_invariant(
        pool_name: str,
        available: int,
        evictable: int,
        protected: int,
        session_held: int,
        total: int,
        uncached: int = 0,
    ) -> Any:
        slots = _FULL_POOL_SLOTS.get()
        if slots is not None and pool_name == "full":
            uncached += unbacked_tokens(slots, total, available)
        return check_invariant(
            pool_name, available, evictable, protected, session_held, total, uncached
        )

    p.replace(checker_cls, "_check_full_pool", _check_full_pool)
    p.replace(checker_cls, "_check_pool_invariant", staticmethod(_check_pool_invariant))


def _install_scheduler_with_decode_gate(p: Patcher, module: ModuleType) -> None:
    """0.5.17: the scheduler group of 0.5.20/0.5.21, and the decode gate.
    0.5.17's ``ScheduleBatch.check_decode_mem`` evicts and compares
    ``available_size()`` itself (its allocators have no
    ``check_decode_capacity`` hook, 0.5.20 on), so over an elastic allocator
    it asks the allocator's hook instead: the step's pages are reserved, and
    a shortage still answers ``False`` for SGLang's own retraction."""
    _install_scheduler(p, module, bounds=extend_bounds_by_range)
    batch_cls = module.ScheduleBatch
    check = original(batch_cls.check_decode_mem)

    @functools.wraps(check)
    def check_decode_mem(self: Any, selected_indices: Any = None) -> bool:
        allocator = self.token_to_kv_pool_allocator
        if getattr(allocator, "kvcached_slots", None) is None:
            return check(self, selected_indices)
        num_tokens = self.new_tokens_required_next_decode(selected_indices)
        return bool(
            allocator.check_decode_capacity(num_tokens=num_tokens, tree_cache=self.tree_cache)
        )

    p.replace(batch_cls, "check_decode_mem", check_decode_mem)


def reserve_for_extend(
    slots: Any,
    allocator: Any,
    tree_cache: Any,
    reqs: list[Any],
    bounds: Callable[[Any], tuple[int, int]] = extend_bounds,
) -> bool:
    """Reserve the pages a prefill batch will allocate (evicting prefix cache
    first, as SGLang's allocation would). ``bounds`` reads a request's prefix
    and extend end as this SGLang release does. Inside the patched admission a
    failure raises :class:`KVCacheMiss` before the batch touches memory;
    elsewhere SGLang's own path runs on (and fails as it would natively)."""
    prefix, ends = zip(*(bounds(r) for r in reqs), strict=True) if reqs else ((), ())
    blocks = slots.blocks_for_extend(list(prefix), list(ends))
    if blocks <= 0:
        return True
    from kvcached.integrations.sglang.pools import evict_to_free_tokens

    evict_to_free_tokens(allocator, tree_cache, blocks * slots.block_tokens)
    if slots.available_tokens() < blocks * slots.block_tokens:
        slots.misses += 1  # the same verdict on every rank: no collective
        ok = False
    else:
        ok = slots.reserve(blocks)
    if not ok and slots.prefill_guard:
        raise KVCacheMiss(list(reqs))
    return ok


class AdmissionSnapshot:
    """What one admission pass may change and a requeue must put back.

    A request that waits for memory was not retracted: its ``is_retracted``,
    ``retracted_stain`` and ``retraction_count`` are restored exactly as they
    were before the pass (including for a request SGLang itself had retracted
    earlier: its history is kept, not reset and not counted twice)."""

    FIELDS = ("is_retracted", "retracted_stain", "retraction_count")

    def __init__(self, scheduler: Any) -> None:
        self.chunked_req = scheduler.chunked_req
        reqs = list(scheduler.waiting_queue)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        self.history = {id(r): (r, tuple(getattr(r, f) for f in self.FIELDS)) for r in reqs}

    def requeue(self, scheduler: Any, batch: list[Any]) -> None:
        """Undo an admission whose pages could not be reserved: the batch's
        requests go back to the head of the waiting queue in their order (a
        continuing chunked request stays the scheduler's chunked request)."""
        current = scheduler.chunked_req
        if current is not None:
            current.inflight_middle_chunks -= 1
        scheduler.chunked_req = self.chunked_req
        back = [r for r in batch if r is not self.chunked_req]
        waiting = [r for r in scheduler.waiting_queue if all(r is not b for b in back)]
        scheduler.waiting_queue = back + waiting
        for req, values in self.history.values():
            for field, value in zip(self.FIELDS, values, strict=True):
                setattr(req, field, value)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        from kvcached.log import get_logger

        get_logger("integrations.sglang").info("%s", message)


#: Where a group differs between releases, a group of the same name per set
#: of releases (docs/sglang-integration.md, "Versions").
RESOLVED = frozenset({"0.5.22", "0.5.23"})
BY_NAME = frozenset({"0.5.17", "0.5.20", "0.5.21"})
#: 0.5.17: ``post_capture_kv_sizing_planned`` is a ``ServerArgs`` method (there
#: is no ``arg_groups.memory_hook`` yet).
ARGS_METHOD = frozenset({"0.5.17"})
ARG_GROUPS = frozenset({"0.5.20", "0.5.21", "0.5.22", "0.5.23"})
#: 0.5.17: ``ScheduleBatch.check_decode_mem`` decides decode capacity itself
#: (its allocators have no ``check_decode_capacity`` hook yet).
BATCH_DECODE_GATE = frozenset({"0.5.17"})

GROUPS: tuple[PatchGroup, ...] = (
    PatchGroup(
        "pools", "sglang.srt.mem_cache.kv_cache_configurator", _install_pools, versions=RESOLVED
    ),
    PatchGroup(
        "pools",
        "sglang.srt.mem_cache.kv_cache_configurator",
        _install_pools_by_name,
        versions=BY_NAME,
    ),
    PatchGroup(
        "startup-args",
        "sglang.srt.arg_groups.memory_hook",
        _install_startup_args,
        versions=ARG_GROUPS,
    ),
    PatchGroup(
        "startup-args",
        "sglang.srt.server_args",
        _install_startup_args_method,
        versions=ARGS_METHOD,
    ),
    PatchGroup("startup-runner", "sglang.srt.model_executor.model_runner", _install_startup_runner),
    PatchGroup("scheduler", "sglang.srt.managers.scheduler", _install_scheduler, versions=RESOLVED),
    PatchGroup(
        "scheduler",
        "sglang.srt.managers.scheduler",
        functools.partial(_install_scheduler, bounds=extend_bounds_by_range),
        versions=BY_NAME - BATCH_DECODE_GATE,
    ),
    PatchGroup(
        "scheduler",
        "sglang.srt.managers.scheduler",
        _install_scheduler_with_decode_gate,
        versions=BATCH_DECODE_GATE,
    ),
)
