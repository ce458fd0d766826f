"""kvcached's elastic pools and allocators inside the real SGLang, on the host backend.

* SGLang's own construction path (``KVCacheConfigurator._build_mha_kv_pool``,
  ``_build_mla_kv_pool``, ``_build_token_to_kv_pool_allocator``) builds the
  elastic classes once the ``pools`` group is installed, and SGLang's classes
  otherwise;
* ``set_kv_buffer`` / ``get_key_buffer`` round-trip data through kvcached pages;
* the allocator reference model (``allocator_model.Driver``) runs randomized
  sequences against the elastic allocators: the same observable behaviour as
  SGLang's native classes where capacity allows, and misses (``None``) where
  the physical budget is smaller, never an error;
* a prefill whose pages cannot be reserved is requeued with each real
  ``Req``'s retraction history as it was.

Skips without SGLang; fails instead under ``KVCACHED_REQUIRE_ENGINES=sglang``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.engines import require_engine

require_engine("sglang", "sglang.srt.mem_cache.kv_cache_configurator")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache import kv_cache_configurator as kc  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvcached.driver.host import HostDriver  # noqa: E402
from kvcached.integrations.patching import Patcher, PatchGroup, release  # noqa: E402
from kvcached.integrations.sglang import groups, pools  # noqa: E402
from kvcached.integrations.sglang.elastic_kv import ElasticKV, KVShape  # noqa: E402
from kvcached.integrations.sglang.patch import sglang_version  # noqa: E402
from kvcached.units import MIB  # noqa: E402
from tests.budgets import ExactBudget  # noqa: E402
from tests.integration.sglang.allocator_model import Driver, Op  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STUBS = Path(__file__).resolve().parent / "stubs"
VERSION = release(sglang_version() or "")
#: 0.5.22/0.5.23 resolve pool classes through ``_resolve_kv_pool_class``;
#: 0.5.20/0.5.21 name them in the builders (docs/sglang-integration.md, "Versions").
RESOLVES = VERSION in groups.RESOLVED


def group_for_this_release(name: str) -> PatchGroup:
    """The patch group ``name`` that ``apply()`` would install on this SGLang."""
    (group,) = [g for g in groups.GROUPS if g.name == name and g.applies_to(VERSION)]
    return group


@pytest.fixture(autouse=True)
def host_env(tmp_path, monkeypatch):
    """Every pool on the host backend, its ledger in a fresh directory."""
    from kvcached import config

    monkeypatch.setenv("KVCACHED_DRIVER", "host")
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_IPC_NAME", "sglang-test")
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "WARNING")
    # No background refill racing the exact figures below (it maps reserved
    # pages, which are briefly in flight and then count as available).
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")
    config.reload_config()
    yield
    config.reload_config()


# -- the configurator builds the elastic classes ------------------------------------


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def _configurator(monkeypatch, page_size: int, *, draft: bool = False) -> kc.KVCacheConfigurator:
    """A configurator as the model runner would have made it for a tiny
    model on CPU, with SGLang's global argument bags stood in for."""
    schedule = NS(page_size=page_size, prefill_only_disable_kv_cache=False, mem_fraction_static=0.5)
    parallel = NS(attn_tp_size=1, attn_dcp_size=1, dcp_enabled=False, launch_world_size=1)
    for name, value in {
        "get_schedule": schedule,
        "get_parallel": parallel,
        "get_memory": NS(enable_hisparse=False, enable_unified_memory=False),
        "get_exec": NS(
            features=NS(enable_memory_saver=False), kernel=NS(attention_backend="torch_native")
        ),
        "get_disagg": NS(disaggregation_mode="null", enable_pdmux=False),
        "get_spec": NS(speculative_algorithm=None),
    }.items():
        monkeypatch.setattr(kc, name, lambda value=value: value)
    conf = object.__new__(kc.KVCacheConfigurator)
    model = NS(
        get_num_kv_heads=lambda tp, dcp=1: 8,
        head_dim=128,
        v_head_dim=128,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
    )
    fields = dict(
        model_config=model,
        device="cpu",
        gpu_id=0,
        kv_cache_dtype=torch.float16,
        kv_cache_dtype_str="auto",
        page_size=page_size,
        is_draft_worker=draft,
        is_hybrid_swa=False,
        kv_shard_rank=None,
        kv_shard_size=1,
        kv_shard_spec=None,
        kv_shard_group=None,
        post_capture_kv_active=False,
        use_mla_backend=False,
        mambaish_config=None,
        layer_info=NS(num_effective_layers=2, start_layer=0, end_layer=2),
        # 0.5.17 reads the DCP size from its server arguments (loc_space_scale)
        server_args=NS(dcp_size=1, attention_backend="torch_native"),
    )
    slots = set(kc.KVCacheConfigurator.__dataclass_fields__)
    for name, value in fields.items():  # a slotted dataclass: one slot at a time
        if name in slots:  # 0.5.17-0.5.21 have no KV sharding fields
            setattr(conf, name, value)
    return conf


@pytest.fixture
def pools_group():
    """This release's ``pools`` patch group installed on the real configurator, undone after."""
    patcher = Patcher()
    group_for_this_release("pools").install(patcher, kc)
    yield
    patcher.undo()


def _pool(conf: kc.KVCacheConfigurator, size: int, kind: str = "mha"):
    """The pool ``_build_token_to_kv_pool`` builds for a plain MHA / MLA model,
    through the same calls it makes on this release."""
    if RESOLVES:
        if kind == "mha":
            cls = conf._resolve_kv_pool_class(kind="mha", default=MHATokenToKVPool)
            return conf._build_mha_kv_pool(max_total_num_tokens=size, mha_pool_class=cls)
        cls = conf._resolve_kv_pool_class(kind="mla", default=MLATokenToKVPool)
        return conf._build_mla_kv_pool(max_total_num_tokens=size, mla_pool_class=cls)
    if kind == "mha":  # 0.5.20/0.5.21 pass their module's MHATokenToKVPool here
        return conf._build_mha_kv_pool(max_total_num_tokens=size, mha_pool_class=MHATokenToKVPool)
    return conf._build_mla_kv_pool(max_total_num_tokens=size)  # the class named inside


def _build(conf: kc.KVCacheConfigurator, size: int, kind: str = "mha"):
    pool = _pool(conf, size, kind)
    allocator = conf._build_token_to_kv_pool_allocator(
        sizes=NS(max_total_num_tokens=size),
        token_to_kv_pool=pool,
        is_dsv4_model=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )
    return pool, allocator


@pytest.mark.parametrize(
    ("page_size", "allocator_cls"),
    [(1, pools.ElasticTokenToKVPoolAllocator), (16, pools.ElasticPagedTokenToKVPoolAllocator)],
)
def test_configurator_builds_elastic_mha(monkeypatch, pools_group, page_size, allocator_cls):
    conf = _configurator(monkeypatch, page_size)
    pool, allocator = _build(conf, 4096)
    try:
        assert type(pool) is pools.ElasticMHATokenToKVPool
        assert type(allocator) is allocator_cls
        kv = pool.kvcached
        assert kv is not None and allocator.kvcached_slots.kv is kv
        assert allocator.size == 4096 and allocator.available_size() == 4096
        # SGLang's own descriptors and data pointers were built on the views.
        assert int(pool.k_data_ptrs[0]) == kv.cache.tensors.block_address(0, 0, 0)
        assert int(pool.v_data_ptrs[1]) == kv.cache.tensors.block_address(1, 1, 0)
        assert pool.k_buffer[0].shape == (pool.size + page_size, 8, 128)
        # Nothing but the padding page is mapped until SGLang allocates.
        assert kv.cache.usage().pages_used == 1
    finally:
        pool.kvcached.close()


def test_configurator_builds_elastic_mla(monkeypatch, pools_group):
    conf = _configurator(monkeypatch, 1)
    conf.use_mla_backend = True
    pool, allocator = _build(conf, 1024, kind="mla")
    try:
        assert type(pool) is pools.ElasticMLATokenToKVPool
        assert type(allocator) is pools.ElasticTokenToKVPoolAllocator
        assert [tuple(b.shape) for b in pool.kv_buffer] == [(pool.size + 1, 1, 96)] * 2
        loc = allocator.alloc(3)
        nope = torch.randn(3, 1, 64, dtype=torch.float16)
        rope = torch.randn(3, 1, 32, dtype=torch.float16)
        pool.kv_buffer[1][loc] = torch.cat([nope, rope], dim=-1)
        assert torch.equal(pool.get_value_buffer(1)[loc], nope)
    finally:
        pool.kvcached.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_device_kvcached_does_not_serve_keeps_sglangs_buffers_said_once(
    monkeypatch, pools_group, kind
):
    said: list[str] = []
    monkeypatch.setattr(pools, "build_joined", lambda shape, device, name: None)
    monkeypatch.setattr(pools.log, "warning", lambda msg, *args: said.append(msg % args))
    monkeypatch.setattr(pools, "_logged", set())
    conf = _configurator(monkeypatch, 1)
    conf.use_mla_backend = kind == "mla"
    first, second = _pool(conf, 64, kind), _pool(conf, 64, kind)
    cls = pools.ElasticMHATokenToKVPool if kind == "mha" else pools.ElasticMLATokenToKVPool
    assert type(first) is cls and type(second) is cls
    assert first.kvcached is None and first.size == 64
    buffers = first.k_buffer if kind == "mha" else first.kv_buffer
    assert buffers[0].shape[0] == 64 + 1  # SGLang's own: size plus the padding page
    why = "device not served by kvcached's driver"
    assert said == [f"{cls.__name__} keeps SGLang's own KV buffers: {why}"]


def test_without_the_group_or_for_a_draft_worker_sglang_builds_its_own(monkeypatch, pools_group):
    conf = _configurator(monkeypatch, 1, draft=True)  # shares the target's allocator
    pool = _pool(conf, 64)
    assert type(pool) is MHATokenToKVPool
    conf.use_mla_backend = True
    assert type(_pool(conf, 64, kind="mla")) is MLATokenToKVPool
    if not RESOLVES:
        # The by-name group's MLA factory builds SGLang's class outside
        # _build_mla_kv_pool (the hybrid MLA + SWA builder passes it as a class).
        assert kc.MLATokenToKVPool is not MLATokenToKVPool  # the factory is installed
        native = kc.MLATokenToKVPool(
            64,
            page_size=1,
            dtype=torch.float16,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        assert type(native) is MLATokenToKVPool
    assert (
        type(
            pools.token_allocator(
                64, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False
            )
        )
        is TokenToKVPoolAllocator
    )
    assert (
        type(
            pools.paged_allocator(
                64, page_size=4, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False
            )
        )
        is PagedTokenToKVPoolAllocator
    )


def test_hybrid_linear_pool_gets_an_elastic_full_attention_pool():
    """SGLang's hybrid linear-attention pool builds its full-attention pool
    from the class the configurator resolved; the allocator finds it."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    pool = HybridLinearKVPool(
        size=4096,
        dtype=torch.float16,
        page_size=1,
        head_num=8,
        head_dim=128,
        full_attention_layer_ids=[1, 3],
        device="cpu",
        mamba_pool=None,
        full_kv_pool_class=pools.ElasticMHATokenToKVPool,
    )
    kv = pools.elastic_kv_of(pool)
    try:
        assert kv is pool.full_kv_pool.kvcached and kv is not None
        alloc = pools.token_allocator(
            4096, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False
        )
        assert type(alloc) is pools.ElasticTokenToKVPoolAllocator
        loc = alloc.alloc(10)
        k = torch.randn(10, 8, 128, dtype=torch.float16)
        pool.set_kv_buffer(_Layer(3), loc, k, -k)  # global layer 3 = full-attention layer 1
        assert torch.equal(kv.cache.tensors.key_view(1).view(-1, 8, 128)[loc], k)
        assert torch.equal(pool.get_value_buffer(3)[loc], -k)
    finally:
        kv.close()


# -- data through kvcached pages -----------------------------------------------------


def test_set_kv_buffer_round_trips_through_mapped_pages(monkeypatch, pools_group):
    conf = _configurator(monkeypatch, 1)
    pool, allocator = _build(conf, 4096)
    kv = pool.kvcached
    try:
        loc = allocator.alloc(1500)  # spans two kvcached pages (1024 tokens each)
        assert kv.cache.usage().pages_used == 2
        for layer in range(2):
            k = torch.randn(1500, 8, 128, dtype=torch.float16)
            v = torch.randn(1500, 8, 128, dtype=torch.float16)
            pool.set_kv_buffer(_Layer(layer), loc, k, v)
            assert torch.equal(pool.get_key_buffer(layer)[loc], k)
            assert torch.equal(pool.get_value_buffer(layer)[loc], v)
            # The bytes are where kvcached mapped them: read through its own views.
            raw_k = kv.cache.tensors.key_view(layer).view(-1, 8, 128)
            raw_v = kv.cache.tensors.value_view(layer).view(-1, 8, 128)
            assert torch.equal(raw_k[loc], k) and torch.equal(raw_v[loc], v)
        allocator.free(loc)
        assert allocator.available_size() == 4096
        allocator.clear()  # flush_cache: the pages go back
        assert kv.cache.usage().pages_mapped == 1
    finally:
        kv.close()


# -- the allocator reference model ---------------------------------------------------

# 128 KiB per token and buffer: 16 tokens per 2 MiB kvcached page.
HEADS, HEAD_DIM = 64, 512


def elastic_allocator(size: int, page_size: int, budget_pages: int | None):
    driver = HostDriver(index=71, capacity=512 * MIB)
    shape = KVShape(
        layers=1,
        block_tokens=page_size,
        size=size,
        heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
    )
    budget = ExactBudget(10**12 if budget_pages is None else budget_pages * 4 * MIB)
    kv = ElasticKV(
        shape,
        driver=driver,
        budget=budget,
        register=None,
        min_reserved=1,
        max_reserved=2,
        background=False,
        max_handle_bytes=0,
    )
    kvcache = NS(kvcached=kv)
    if page_size == 1:
        alloc = pools.token_allocator(
            size, dtype=torch.float32, device="cpu", kvcache=kvcache, need_sort=False
        )
    else:
        alloc = pools.paged_allocator(
            size,
            page_size=page_size,
            dtype=torch.float32,
            device="cpu",
            kvcache=kvcache,
            need_sort=False,
        )
    bpp = kv.cache.blocks_per_page
    usable = None if budget_pages is None else (budget_pages * bpp - 1) * page_size
    return alloc, kv, usable


ops = st.lists(
    st.builds(
        Op,
        kind=st.sampled_from(
            ["new", "new", "extend", "decode", "decode", "finish", "group_free", "clear"]
        ),
        a=st.integers(0, 40),
        b=st.integers(0, 3),
    ),
    max_size=40,
)
_settings = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(
    ops=ops, page_size=st.sampled_from([1, 2, 4, 16]), budget_pages=st.sampled_from([None, 2, 3])
)
def test_elastic_allocators_match_the_model(ops, page_size, budget_pages):
    size = 48 if page_size == 1 else 64
    alloc, kv, usable = elastic_allocator(size, page_size, budget_pages)
    try:
        driver = Driver(alloc, budget=usable)
        driver.run(ops)
        kv.blocks.check()
        if budget_pages is not None:
            # Never more mapped than the budget allowed.
            assert kv.budget.used <= budget_pages * 4 * MIB
    finally:
        kv.close()


def test_a_small_budget_misses_where_the_native_class_allocates():
    alloc, kv, usable = elastic_allocator(48, 1, budget_pages=2)
    native = pools.TokenToKVPoolAllocator(
        48, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
    )
    try:
        assert usable == 31 and alloc.available_size() == 31
        assert native.alloc(40) is not None
        assert alloc.alloc(40) is None  # a miss, not an error
        assert alloc.alloc(31) is not None and alloc.available_size() == 0
    finally:
        kv.close()


def test_decode_capacity_reserves_the_pages_it_promised():
    """A True from check_decode_capacity survives another process taking
    the memory before the decode allocation."""
    alloc, kv, _ = elastic_allocator(64, 4, budget_pages=None)
    try:
        full = alloc.alloc(4)  # one page, full: the next decode token needs a new page
        slots = alloc.kvcached_slots
        slots.begin_round()
        assert alloc.check_decode_capacity(num_tokens=4, tree_cache=None)
        assert slots.stashed == 1
        kv.budget.capacity = kv.budget.used  # someone else took everything
        out = alloc.alloc_decode(
            torch.tensor([5]), torch.tensor([5]), torch.tensor([int(full[-1])])
        )
        assert out is not None and int(out[0]) % 4 == 0
        slots.end_round()
        assert slots.stashed == 0
        rest = alloc.alloc(alloc.available_size())  # the free pages of mapped kvcached pages
        assert rest is not None and alloc.available_size() == 0
        assert alloc.check_decode_capacity(num_tokens=4, tree_cache=None) is False
    finally:
        kv.close()


# -- admission miss: the request waits, its retraction history untouched -------------


def _req(rid: str, retractions: int) -> Req:
    req = Req(rid, "", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4))
    for _ in range(retractions):  # SGLang's own bookkeeping of a real retraction
        req.retraction_count += 1
        req.is_retracted = req.retracted_stain = True
    return req


def _set_extend(req: Req, prefix: int, end: int) -> None:
    """What SGLang's adder sets before ``prepare_for_extend``, on this release."""
    if RESOLVES:
        req.prefix_len, req.extend_end = prefix, end
    else:  # 0.5.20/0.5.21: prefix_indices and an extend range
        req.prefix_indices = torch.arange(prefix, dtype=torch.int64)
        req.set_extend_range(prefix, end)


def _extend_end(req: Req) -> int:
    return req.extend_end if RESOLVES else req.extend_range.end


class _Batch:
    """Stands in for ScheduleBatch: prepare_for_extend is where SGLang allocates."""

    def __init__(self, reqs: list, allocator, tree) -> None:
        self.reqs, self.token_to_kv_pool_allocator, self.tree_cache = reqs, allocator, tree
        self.allocated = None

    def is_dllm(self) -> bool:
        return False

    def prepare_for_extend(self) -> None:
        pages = sum(-(-_extend_end(r) // 4) for r in self.reqs)
        self.allocated = self.token_to_kv_pool_allocator.alloc(pages * 4)
        assert self.allocated is not None, "SGLang would raise 'Out of memory' here"

    def new_tokens_required_next_decode(self, selected_indices=None) -> int:
        return 4 * len(self.reqs if selected_indices is None else selected_indices)

    def check_decode_mem(self, selected_indices=None) -> bool:
        """0.5.17's own gate: compare available_size(), reserve nothing."""
        need = self.new_tokens_required_next_decode(selected_indices)
        return self.token_to_kv_pool_allocator.available_size() >= need


class _Scheduler:
    """Stands in for SGLang's Scheduler around the methods the group wraps:
    admission takes two requests off the queue and, as SGLang's adder does,
    clears ``is_retracted`` of what it admits."""

    def __init__(self, allocator, reqs: list) -> None:
        self.token_to_kv_pool_allocator = allocator
        # A tree with nothing to share, as each release asks it (0.5.20/0.5.21:
        # is_chunk_cache; 0.5.22 on: supports_prefix_sharing).
        self.tree_cache = NS(
            evictable_size=lambda: 0,
            evict=None,
            supports_prefix_sharing=lambda: False,
            is_chunk_cache=lambda: True,
        )
        self.waiting_queue = list(reqs)
        self.chunked_req = None

    def get_next_batch_to_run(self, running_batch, last_batch):
        return self._get_new_batch_prefill_raw(None, running_batch=running_batch)

    def is_fully_idle(self) -> bool:
        return not self.waiting_queue and self.chunked_req is None

    def on_idle(self) -> None:
        self.idle_rounds = getattr(self, "idle_rounds", 0) + 1

    def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
        batch, self.waiting_queue = self.waiting_queue[:2], self.waiting_queue[2:]
        for r in batch:
            r.is_retracted = False
        new = _Batch(batch, self.token_to_kv_pool_allocator, self.tree_cache)
        new.prepare_for_extend()
        return new, running_batch


@pytest.fixture
def scheduler_group():
    module = NS(Scheduler=_Scheduler, ScheduleBatch=_Batch)
    patcher = Patcher()
    group_for_this_release("scheduler").install(patcher, module)
    yield
    patcher.undo()


def test_a_prefill_that_cannot_reserve_waits_with_its_retraction_history(scheduler_group):
    """The scheduler group's wrappers around admission: a batch whose pages
    cannot be reserved goes back to the head of the queue, each real ``Req``
    with its retraction history as it was; once memory is there it runs."""
    alloc, kv, _ = elastic_allocator(64, 4, budget_pages=2)  # 7 pages of 4 tokens usable
    try:
        fresh, retracted, third = _req("a", 0), _req("b", 2), _req("c", 0)
        for r in (fresh, retracted, third):
            _set_extend(r, 0, 16)  # 4 pages each: two do not fit
        sched = _Scheduler(alloc, [fresh, retracted, third])
        running = object()
        assert sched.get_next_batch_to_run(running, None) == (None, running)
        assert sched.waiting_queue == [fresh, retracted, third]
        assert (fresh.is_retracted, fresh.retracted_stain, fresh.retraction_count) == (
            False,
            False,
            0,
        )
        assert (retracted.is_retracted, retracted.retracted_stain, retracted.retraction_count) == (
            True,
            True,
            2,
        )
        slots = alloc.kvcached_slots
        assert slots.stashed == 0 and slots.n_live == 0 and slots.misses == 1
        # Memory came back (another engine left): the same batch now runs.
        kv.budget.capacity *= 4
        batch, _ = sched.get_next_batch_to_run(running, None)
        assert batch.reqs == [fresh, retracted] and batch.allocated.numel() == 32
        assert sched.waiting_queue == [third] and retracted.retraction_count == 2
        assert slots.stashed == 0  # the reservation was used, nothing left held
    finally:
        kv.close()


# -- inert without ENABLE_KVCACHED ----------------------------------------------------


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))
    }
    environment.update(env, PYTHONPATH=f"{STUBS}{os.pathsep}{ROOT}")
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_patch_is_inert_without_enable_kvcached():
    proc = _run("""
        import sys
        from kvcached.integrations.sglang import apply
        result = apply()
        import sglang.srt.mem_cache.kv_cache_configurator as kc
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        assert not result.applied, result
        assert kc.TokenToKVPoolAllocator is TokenToKVPoolAllocator
        assert "kvcached.integrations.sglang.pools" not in sys.modules
        print("inert")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "inert"
    assert "[kvcached]" not in proc.stderr


def test_patch_installs_every_group_on_the_real_sglang():
    proc = _run(
        """
        import importlib
        from kvcached.integrations.sglang import apply, patch
        from kvcached.integrations.sglang.groups import GROUPS
        result = apply()
        assert result.applied
        import sglang.srt.managers.scheduler as sched
        import sglang.srt.mem_cache.kv_cache_configurator as kc
        from kvcached.integrations.sglang import pools
        assert kc.TokenToKVPoolAllocator is pools.token_allocator
        assert sched.Scheduler.get_next_batch_to_run.__wrapped__ is not None
        for group in GROUPS:  # every trigger of this release, so every group installs
            if group.applies_to(result.sglang_version):
                importlib.import_module(group.module)
        print(sorted(patch.group_states().items()))
    """,
        ENABLE_KVCACHED="true",
        KVCACHED_DRIVER="host",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = dict(eval(proc.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own repr
    assert set(states) == {g.name for g in groups.GROUPS}, states
    assert set(states.values()) == {"installed"}, states


@pytest.mark.skipif(
    VERSION not in groups.BATCH_DECODE_GATE,
    reason="0.5.20 on: SGLang's check_decode_mem asks the allocator's hook itself",
)
def test_the_batch_decode_gate_reserves_through_the_elastic_allocator(scheduler_group):
    """0.5.17: ``ScheduleBatch.check_decode_mem`` decides itself; patched, it
    asks the elastic allocator, so a True holds the step's pages (a native
    allocator keeps SGLang's own comparison)."""
    alloc, kv, _ = elastic_allocator(64, 4, budget_pages=None)
    try:
        alloc.alloc(4)
        slots = alloc.kvcached_slots
        tree = NS(is_chunk_cache=lambda: True)
        batch = _Batch([_req("a", 0)], alloc, tree)
        slots.begin_round()
        assert batch.check_decode_mem() is True
        assert slots.stashed == 1  # reserved, not merely counted
        slots.end_round()
        alloc.alloc(alloc.available_size())
        assert batch.check_decode_mem() is False
        native = NS(available_size=lambda: 3)
        assert _Batch([_req("b", 0)], native, tree).check_decode_mem() is False
    finally:
        kv.close()


# -- startup: the cache is sized from a virtual budget --------------------------------


def test_profiling_ignores_memory_other_engines_hold(monkeypatch, pools_group, tmp_path):
    """``_profile_available_bytes`` (patched) sizes the pool as if the device
    were this engine's alone: another engine charging most of the device on
    its ledger neither shrinks the cache nor makes SGLang refuse to start."""
    from kvcached.config import get_config
    from kvcached.driver import get_driver
    from kvcached.ledger import open_pool_budget

    conf = _configurator(monkeypatch, 1)
    driver = get_driver(0, config=get_config())
    total = driver.info().total_bytes
    alone = conf._profile_available_bytes(pre_model_load_memory=total)
    assert alone == int(total * 0.5)
    other = open_pool_budget(driver, "other-engine", calibrate=False, config=get_config())
    try:
        grab = other.headroom() // (2 * MIB) * (2 * MIB)
        assert other.grant(grab)
        assert conf._profile_available_bytes(pre_model_load_memory=total) == alone
    finally:
        other.refund(grab)
        other.close()


# -- SGLang's pool invariant check over an elastic pool --------------------------------------


def _invariant_checker(alloc, total: int, protected: int, hybrid_ssm: bool = False):
    """SGLang's own ``SchedulerInvariantChecker`` over ``alloc`` (the state its
    ``_check_full_pool`` reads, for a plain pool, or with ``hybrid_ssm`` the
    full-attention pool of a hybrid linear-attention model, whose ``total`` is
    the allocator's size: ``schedulable_token_capacity`` of it on 0.5.23)."""
    from sglang.srt.managers.scheduler_components.invariant_checker import (
        SchedulerInvariantChecker,
    )

    state = {
        "token_to_kv_pool_allocator": alloc,
        "max_total_num_tokens": total,
        "is_hybrid_swa": False,
        "is_hybrid_ssm": hybrid_ssm,
        "page_size": alloc.page_size,
        "tree_cache": NS(
            protected_size=lambda: protected,
            full_protected_size=lambda: protected,
            supports_mamba=lambda: True,
        ),
        "req_to_token_pool": NS(schedulable_token_capacity=lambda size: size),
        "pool_stats_observer": NS(session_held_tokens=lambda: 0),
        "server_args": NS(dcp_size=1),
    }
    # A slotted dataclass whose fields differ between releases: ours where we
    # have them, None for what this check does not read.
    fields = dataclasses.fields(SchedulerInvariantChecker)
    return SchedulerInvariantChecker(
        **{f.name: state.get(f.name) for f in fields if f.name in state or _required(f)}
    )


def _single_process():
    """0.5.22 on reads the decode-context-parallel width from a published
    parallel config; one process, none published: say it is off."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # 0.5.17-0.5.21: the check reads server_args.dcp_size
        return contextlib.nullcontext()
    return get_parallel().override(dcp_enabled=False)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def test_sglangs_idle_pool_check_counts_what_the_budget_does_not_back(scheduler_group):
    """A real H100 run (results/h100/sglang-0.5.17/models-1) died at the first
    idle moment: SGLang's strict check (on by default) found ``available +
    cached + held != total`` because an elastic pool's ``available`` is what
    the physical budget allows. With the scheduler group the unbacked rest is
    counted, the check passes on an exact account and still finds a real leak."""
    alloc, kv, usable = elastic_allocator(48, 1, budget_pages=2)
    try:
        assert usable == 31
        assert alloc.alloc(10) is not None  # held: 4 tokens cached, 6 protected
        available = alloc.available_size()
        assert available == 21
        ps = NS(full_available_size=available, full_evictable_size=4, full_capacity=48)
        with _single_process():
            leak, msg = _invariant_checker(alloc, 48, protected=6)._check_full_pool(ps)
            assert not leak, msg
            leak, msg = _invariant_checker(alloc, 48, protected=3)._check_full_pool(ps)
        assert leak, "three held tokens that nothing accounts for are a leak"
    finally:
        kv.close()


def test_a_hybrid_linear_attention_models_full_pool_is_accounted_too(scheduler_group):
    """A hybrid linear-attention model (Qwen3-Next's kind) keeps its full-attention
    KV in an elastic pool too; SGLang checks it against the allocator's size, and
    the unbacked rest is counted there as for a plain pool."""
    alloc, kv, _ = elastic_allocator(48, 1, budget_pages=2)
    try:
        assert alloc.size == 48 and alloc.alloc(10) is not None
        ps = NS(full_available_size=alloc.available_size(), full_evictable_size=4, full_capacity=48)
        with _single_process():
            leak, msg = _invariant_checker(alloc, 48, 6, hybrid_ssm=True)._check_full_pool(ps)
            assert not leak, msg
            leak, msg = _invariant_checker(alloc, 48, 3, hybrid_ssm=True)._check_full_pool(ps)
        assert leak, "three held tokens that nothing accounts for are a leak"
    finally:
        kv.close()


def test_without_the_scheduler_group_sglangs_check_calls_an_elastic_pool_a_leak():
    alloc, kv, _ = elastic_allocator(48, 1, budget_pages=2)
    try:
        assert alloc.alloc(10) is not None
        ps = NS(full_available_size=alloc.available_size(), full_evictable_size=4, full_capacity=48)
        with _single_process():
            leak, _ = _invariant_checker(alloc, 48, protected=6)._check_full_pool(ps)
        assert leak  # what the H100 run met: the reason for the group's wrapper
    finally:
        kv.close()


def test_held_at_zero_an_idle_scheduler_gives_back_the_padding_page(scheduler_group):
    """A real H100 run (results/h100/sglang-0.5.17/models-serve-2) found one page
    (the padding page, block 0's) still mapped under serve's ``kv`` sleep. With
    the limit below one page and the scheduler fully idle, SGLang's idle round
    gives it back: the instance holds nothing and SGLang's idle pool check still
    passes; once the limit is lifted the next round maps it before admission,
    and a request runs as before."""
    alloc, kv, _ = elastic_allocator(64, 4, budget_pages=None)
    try:
        slots = alloc.kvcached_slots
        req = _req("a", 0)
        _set_extend(req, 0, 16)
        sched = _Scheduler(alloc, [req])
        running = object()
        kv.cache.set_limit(1)  # serve's kv sleep: one byte
        kv.cache.trim()
        sched.waiting_queue = [req]
        sched.on_idle()  # not fully idle: a request waits
        assert not slots.blocks.null_parked and sched.idle_rounds == 1
        sched.waiting_queue = []
        sched.on_idle()
        assert slots.blocks.null_parked and sched.idle_rounds == 2
        assert kv.cache.usage().bytes_mapped == 0
        ps = NS(full_available_size=alloc.available_size(), full_evictable_size=0,
                full_capacity=64)  # fmt: skip
        with _single_process():
            leak, msg = _invariant_checker(alloc, 64, protected=0)._check_full_pool(ps)
        assert not leak, msg
        sched.waiting_queue = [req]
        assert sched.get_next_batch_to_run(running, None) == (None, running)  # still held
        assert slots.blocks.null_parked and sched.waiting_queue == [req]
        kv.cache.set_limit(None)  # the wake
        batch, _ = sched.get_next_batch_to_run(running, None)
        assert not slots.blocks.null_parked and batch.reqs == [req]
        assert all(int(s) >= 4 for s in batch.allocated)  # block 0 stays the padding page
    finally:
        kv.close()


def test_the_padding_page_stays_while_a_block_lives_or_a_page_is_allowed(scheduler_group):
    alloc, kv, _ = elastic_allocator(64, 4, budget_pages=None)
    try:
        slots = alloc.kvcached_slots
        sched = _Scheduler(alloc, [])
        sched.on_idle()  # no limit: nothing parks
        assert not slots.blocks.null_parked
        held = alloc.alloc(4)
        kv.cache.set_limit(1)
        sched.on_idle()  # a block lives (the prefix cache, say): page 0 may hold it
        assert not slots.blocks.null_parked
        alloc.free(held)
        sched.enable_dp_attention = True
        sched.on_idle()  # DP attention: idle ranks run dummy forwards
        assert not slots.blocks.null_parked
        sched.enable_dp_attention = False
        sched.on_idle()
        assert slots.blocks.null_parked
    finally:
        kv.close()
