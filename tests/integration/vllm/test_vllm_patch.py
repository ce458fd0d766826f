"""The vLLM patch against vLLM's own classes, in this process (no server):

* ``allocate_kv_cache``'s replacement gives exactly vLLM's views (shapes,
  strides, storage offsets, dtypes) for every ``KVCacheLayout``, and every
  byte of a block lies in the pages kvcached maps for it;
* ``KvcachedBlockPool`` under vLLM's ``KVCacheManager`` finds the same prefix
  hits as the native pool while memory suffices, keeps the cap on idle cached
  blocks by evicting whole pages, misses (never raises) when memory runs out,
  and gives every page back on ``reset_prefix_cache``;
* a signature vLLM changed switches kvcached off instead of half patching.

vLLM is imported here with ``os.environ`` restored afterwards (importing it
sets a few variables that must not leak into other tests).
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from kvcached.config import Config, defaults
from kvcached.integrations import vllm as vllm_plugin
from kvcached.integrations.patching import MARKER, PatchGroup, original
from kvcached.integrations.vllm import engine, worker
from kvcached.integrations.vllm.geometry import blocks_per_page, plan_lanes, tensor_shapes
from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
from kvcached.integrations.vllm.state import STATE
from kvcached.memory.planned import MAP
from kvcached.units import MIB
from tests.budgets import ExactBudget
from tests.engines import require_engine_version

VLLM_VERSION = require_engine_version("vllm")
_env = dict(os.environ)
try:
    import torch
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils

    from tests.integration.vllm.vllm_requests import run_requests as run_vllm_requests
finally:
    os.environ.clear()
    os.environ.update(_env)


HOST_INDEX = 31
BLOCK = 32
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


@pytest.fixture
def kvcached_on(monkeypatch, tmp_path):
    """kvcached switched on in this process, on a host device and ledger of its
    own: the settings an entry point would hand the patch (``STATE.settings``)."""
    settings = Config.from_env(
        {
            "KVCACHED_LEDGER_DIR": str(tmp_path),
            "KVCACHED_HOST_DEVICE": str(HOST_INDEX),
            "KVCACHED_HOST_CAPACITY": "256M",
            "KVCACHED_MIN_RESERVED_PAGES": "0",
            "KVCACHED_MAX_RESERVED_PAGES": "0",
        }
    )
    saved = (STATE.active, STATE.off_reason, STATE.version, STATE.settings)
    STATE.active, STATE.off_reason, STATE.version = True, None, VLLM_VERSION
    STATE.settings = settings
    yield settings
    STATE.active, STATE.off_reason, STATE.version, STATE.settings = saved


def vllm_config_for(layout, num_blocks: int) -> SimpleNamespace:
    """The few fields get_kv_cache_config_from_groups reads."""
    return SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
    )


def kv_config(layout, num_blocks: int = 1024, hybrid: bool = False):
    groups = [KVCacheGroupSpec(["a0", "a1"], SPEC)]
    if hybrid:
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
        )
        groups.append(KVCacheGroupSpec(["s0", "s1"], window))
    return get_kv_cache_config_from_groups(vllm_config_for(layout, num_blocks), groups, 0)


@pytest.mark.parametrize("page_mib", [2, 4])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_engine_core_sizing_rounds_num_blocks_up_to_whole_pages(
    kvcached_on, layout, page_mib
) -> None:
    """While the engine core sizes the KV cache, vLLM's config builder is asked
    again with its own ``num_gpu_blocks_override`` at the count rounded up to
    whole pages of the page size the entry point handed in (``STATE.settings``);
    the override set before is back afterwards."""
    setattr(
        engine._get_kv_cache_config_from_groups,
        MARKER,
        original(get_kv_cache_config_from_groups),
    )
    STATE.settings = kvcached_on.replace(page_size=page_mib * MIB)
    vllm_config = vllm_config_for(layout, 1000)
    groups = [KVCacheGroupSpec(["a0", "a1"], SPEC)]
    engine.ENGINE.sizing = True
    try:
        config = engine._get_kv_cache_config_from_groups(vllm_config, groups, 0)
    finally:
        engine.ENGINE.sizing = False
    bpp = blocks_per_page(tensor_shapes(config, layout), page_mib * MIB)
    assert 1000 % bpp, "the case needs a count that is not a whole number of pages"
    assert config.num_blocks == -(-1000 // bpp) * bpp, (config.num_blocks, bpp)
    assert all(t.size % config.num_blocks == 0 for t in config.kv_cache_tensors)
    assert vllm_config.cache_config.num_gpu_blocks_override == 1000
    # outside the engine core's sizing (a worker's own call) nothing is rounded
    assert engine._get_kv_cache_config_from_groups(vllm_config, groups, 0).num_blocks == 1000


def kvcached_views(config, layout):
    # The wrapper finds vLLM's function by its mark, as installed.
    setattr(worker.allocate_kv_cache, MARKER, original(worker_utils.allocate_kv_cache))
    worker.WORKER.allocating, worker.WORKER.native_reason = True, None
    try:
        return worker.allocate_kv_cache(config, torch.device("cpu"), layout)
    finally:
        worker.WORKER.allocating = False


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_views_are_vllms_own_over_pages_kvcached_maps(kvcached_on, layout, hybrid) -> None:
    config = kv_config(layout, hybrid=hybrid)
    native = original(worker_utils.allocate_kv_cache)
    want = native(config, torch.device("cpu"), layout)
    got = kvcached_views(config, layout)
    executor = worker.WORKER.executor
    try:
        assert set(got) == set(want)
        base = next(iter(got.values())).untyped_storage().data_ptr()
        assert base == executor.tensors.va
        for name, view in want.items():
            ours = got[name]
            assert (ours.shape, ours.stride(), ours.dtype, ours.storage_offset()) == (
                view.shape,
                view.stride(),
                view.dtype,
                view.storage_offset(),
            ), name
        lanes = plan_lanes(config, layout, 2 * MIB)
        rng = random.Random(1)
        blocks = sorted(rng.sample(range(1, config.num_blocks), 12))
        pages = sorted({b // lanes.blocks_per_page for b in blocks} - {0})
        assert executor.apply([(MAP, p, 1) for p in pages])
        native_buf = next(iter(want.values())).untyped_storage()
        for name in want:  # the same values through both views land on the same bytes
            for b in blocks:
                values = torch.randn(want[name][b].shape).to(want[name].dtype)
                want[name][b].copy_(values)
                got[name][b].copy_(values)
        ours_buf = executor.buffer()
        theirs = torch.empty(0, dtype=torch.int8).set_(native_buf, 0, (native_buf.nbytes(),), (1,))
        for p in [0, *pages]:
            for off, n in lanes.run_ranges(p, 1):
                assert torch.equal(ours_buf[off : off + n], theirs[off : off + n]), (p, off)
        executor.apply([("unmap", p, 1) for p in pages])
    finally:
        executor.close()
        worker.WORKER.executor = None


# -- the block pool under vLLM's KVCacheManager ----------------------------------------------------
class FakeContext:
    """What _make_block_pool needs of an EngineContext."""

    def __init__(self, planner) -> None:
        self.planner = planner
        self.devices = ["host-test"]
        self.instance = SimpleNamespace(name="unit")
        self.pool = None

    def attach_pool(self, pool) -> None:
        self.pool = pool


@pytest.fixture(scope="module")
def engine_patched():
    """The engine-core patch groups installed into vLLM's modules (they pass
    through for native pools, so the native managers below stay native)."""
    saved = STATE.active
    STATE.active = True
    # The plugin's own groups for the installed release: their checks differ
    # by version (0.30's get_num_blocks_to_allocate has no prefill_end).
    modules = {"kv_cache_coordinator": kv_cache_coordinator, "kv_cache_manager": kv_cache_manager}
    chosen = [g for g in vllm_plugin.groups(VLLM_VERSION) if g.name in modules]
    assert sorted(g.name for g in chosen) == sorted(modules), chosen
    for group in chosen:
        assert STATE.install(group, modules[group.name]), STATE.off_reason
    yield
    STATE.active = saved


NUM_BLOCKS = 2048  # 8 pages of 256 blocks


def make_manager(budget_pages: int | None = None, cap_tokens: int = -1):
    """vLLM's ``KVCacheManager``, over a kvcached pool when ``budget_pages`` is
    given, with ``KVCACHED_MAX_CACHED_TOKENS`` = ``cap_tokens`` in the settings
    the pool is built with."""
    config = kv_config(KVCacheLayout.LBHNC, NUM_BLOCKS)
    planner = None
    if budget_pages is not None:
        g = planner_geometry(NUM_BLOCKS // 256, 256, 4 * MIB, 2 * MIB)
        planner = StepPlanner(g, ExactBudget(budget_pages * g.page_bytes))
        engine.ENGINE.pending = FakeContext(planner)
        engine.ENGINE.block_size = BLOCK
    saved = STATE.settings
    STATE.settings = defaults().replace(max_cached_tokens=cap_tokens)
    try:
        manager = kv_cache_manager.KVCacheManager(
            config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK
        )
    finally:
        STATE.settings = saved
        engine.ENGINE.pending = None
    return manager, planner


def run_requests(manager, prompts: list[list[int]], concurrent: int = 1) -> list[int | None]:
    return run_vllm_requests(manager, prompts, concurrent, BLOCK)


def shared_prefix_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 500) for _ in range(rng.randint(100, 900))] for _ in range(4)]
    return [
        rng.choice(docs) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 200))]
        for _ in range(n)
    ]


def test_block_pool_hits_like_native_while_memory_suffices(engine_patched) -> None:
    native, _ = make_manager()
    ours, planner = make_manager(budget_pages=8)
    assert type(ours.block_pool).__name__ == "KvcachedBlockPool"
    assert type(native.block_pool).__name__ == "BlockPool"
    prompts = shared_prefix_prompts(3, 60)
    want = run_requests(native, prompts, concurrent=3)
    got = run_requests(ours, prompts, concurrent=3)
    assert got == want and any(want)
    planner.blocks.check()
    pool = ours.block_pool
    assert planner.live_blocks() == pool.num_idle_cached  # only cached blocks stay live
    assert pool.get_num_free_blocks() >= 0 and 0.0 <= pool.get_usage() < 1.0


def test_cap_evicts_whole_pages_of_idle_cached_blocks(engine_patched) -> None:
    ours, planner = make_manager(budget_pages=8, cap_tokens=60 * BLOCK)
    prompts = shared_prefix_prompts(4, 40)
    hits = run_requests(ours, prompts, concurrent=2)
    pool = ours.block_pool
    assert all(h is not None for h in hits)
    assert pool.num_idle_cached <= 60 and pool.evicted_pages > 0
    planner.blocks.check()


def test_out_of_memory_is_a_miss_not_an_exception(engine_patched) -> None:
    ours, planner = make_manager(budget_pages=2)  # page 0 + one more: 511 blocks
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(6000)] for _ in range(3)]  # 188 blocks each
    hits = run_requests(ours, prompts, concurrent=3)
    assert hits[:2] == [0, 0] and hits[2] is None and planner.misses > 0
    small = run_requests(ours, [[5] * 100], concurrent=1)
    assert small == [0]


def test_reset_prefix_cache_gives_every_page_back(engine_patched) -> None:
    ours, planner = make_manager(budget_pages=8)
    rng = random.Random(5)
    run_requests(ours, [[rng.randrange(3, 500) for _ in range(1000)] for _ in range(12)], 4)
    assert planner.backend.mapped_pages > 1
    assert ours.reset_prefix_cache()
    assert planner.backend.mapped_pages == 1  # the null block's page
    assert ours.block_pool.num_idle_cached == 0 and planner.live_blocks() == 0
    rng = random.Random(5)
    assert run_requests(ours, [[rng.randrange(3, 500) for _ in range(1000)]]) == [0]


# -- version and signature gates ---------------------------------------------------------------------
def test_a_changed_signature_switches_kvcached_off(kvcached_on) -> None:
    fake = SimpleNamespace(allocate_kv_cache=lambda cfg, device: None, __name__="fake")
    group = next(g for g in vllm_plugin.groups(VLLM_VERSION) if g.name == "gpu_model_runner")
    group = PatchGroup("fake", "fake", group.install, group.check)
    try:
        assert not STATE.install(group, fake)
        assert not STATE.active and "allocate_kv_cache" in (STATE.off_reason or "")
        assert not hasattr(fake.allocate_kv_cache, "__kvcached_original__")
    finally:
        STATE.off_reason = None


# -- KVCACHED_CONTIGUOUS_LAYOUT as a layout preference -------------------------------------------------
@pytest.mark.parametrize(
    ("want", "supported", "expect"),
    [
        ("auto", ["LBNHC", "LBHNC", "BLHNC"], "LBNHC"),
        ("true", ["LBNHC", "LBHNC", "BLHNC"], "BLHNC"),
        ("false", ["BLHNC", "LBHNC"], "LBHNC"),
        ("true", ["LBHNC"], "LBHNC"),  # the CPU backend: nothing block-outermost, vLLM's kept
    ],
)
def test_contiguous_layout_picks_among_what_the_backends_support(
    kvcached_on, monkeypatch, want, supported, expect
) -> None:
    from vllm.v1.attention.backends import utils as backend_utils

    STATE.settings = Config.from_env({"KVCACHED_CONTIGUOUS_LAYOUT": want})
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(
        engine._resolve_kv_cache_layout,
        "__kvcached_original__",
        backend_utils.resolve_kv_cache_layout,
        raising=False,
    )
    config = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None), kv_transfer_config=None
    )
    layout = engine._resolve_kv_cache_layout(config, [supported, list(supported)], [SPEC])
    assert layout.name == expect and config.cache_config.kv_cache_layout == expect


# -- startup memory checks (GPU code paths, driven with stand-ins here) ---------------------------------
GIB = 1 << 30


def fake_vllm_config(**parallel: int) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**parallel),
        cache_config=SimpleNamespace(),
        model_config=SimpleNamespace(),
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


def test_request_memory_no_longer_refuses_a_device_another_engine_uses(kvcached_on) -> None:
    """vLLM refuses to start when free memory is below total x utilization,
    i.e. whenever another engine already uses the GPU; kvcached's KV cache
    takes nothing at start, so the request becomes an upper bound."""
    snapshot = SimpleNamespace(total_memory=80 * GIB, free_memory=20 * GIB, device_="cuda:0")
    cache = SimpleNamespace(gpu_memory_utilization=0.9)
    vllm_request_memory = getattr(
        worker_utils.request_memory, "__kvcached_original__", worker_utils.request_memory
    )
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        vllm_request_memory(snapshot, cache)
    assert worker._request_memory(snapshot, cache) == int(80 * GIB * 0.9)


def test_gpu_sizing_profiles_without_the_free_memory_assertion(kvcached_on, monkeypatch) -> None:
    """The GPU worker profiles on vLLM's ``kv_cache_memory_bytes`` path (which
    compiles but asserts nothing about free memory) and reports the virtual
    capacity total x KVCACHED_GPU_UTILIZATION."""
    seen = []

    def vllm_determine(self):
        seen.append(self.cache_config.kv_cache_memory_bytes)
        return 123

    monkeypatch.setattr(
        worker._gpu_determine_available_memory,
        "__kvcached_original__",
        vllm_determine,
        raising=False,
    )
    me = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None),
        init_snapshot=SimpleNamespace(total_memory=80 * GIB),
        vllm_config=fake_vllm_config(),
        device="cuda:0",
    )
    got = worker._gpu_determine_available_memory(me)
    assert seen == [int(80 * GIB * 0.95)] and got == int(80 * GIB * 0.95)
    assert me.cache_config.kv_cache_memory_bytes is None, "the user's setting is restored"
    me.cache_config.kv_cache_memory_bytes = 7 * GIB  # the user's own size is kept
    assert worker._gpu_determine_available_memory(me) == 123 and seen[-1] == 7 * GIB


def test_cpu_sizing_skips_the_node_memory_check(kvcached_on, monkeypatch) -> None:
    def vllm_determine(self):
        raise AssertionError("vLLM's check against the node's free memory must not run")

    monkeypatch.setattr(
        worker._cpu_determine_available_memory,
        "__kvcached_original__",
        vllm_determine,
        raising=False,
    )
    me = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=64 * GIB),
        vllm_config=fake_vllm_config(),
        _should_warm_up_model=lambda: False,
    )
    assert worker._cpu_determine_available_memory(me) == 64 * GIB


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline"),
        ({"nnodes": 2}, "across nodes"),
        ({"decode_context_parallel_size": 2}, "context parallel"),
    ],
)
def test_unsupported_parallelism_is_refused(change, reason) -> None:
    assert reason in worker.refusal_reason(fake_vllm_config(**change))


def test_kv_connectors_hisparse_and_sleep_mode_are_refused() -> None:
    config = fake_vllm_config()
    assert worker.refusal_reason(config) is None
    config.kv_transfer_config = object()
    assert "KV connectors" in worker.refusal_reason(config)
    config = fake_vllm_config()
    config.attention_config.hisparse_config = object()
    assert "HiSparse" in worker.refusal_reason(config)
    config = fake_vllm_config()
    config.model_config.enable_sleep_mode = True
    assert "sleep mode" in worker.refusal_reason(config)
