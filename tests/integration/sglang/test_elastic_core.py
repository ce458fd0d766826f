"""The SGLang integration's kvcached side, without SGLang: buffers as SGLang
shapes them, the slot allocator (logical cap, reservations, clear), the
prefix-cache cap and the control source (limits, reclaim through the
scheduler thread). Host backend, real ledgers."""

from __future__ import annotations

import time

import pytest
import torch

from kvcached.config import get_config
from kvcached.driver.host import HostDriver
from kvcached.errors import BlockError, ConfigError
from kvcached.integrations.sglang.control import register_pool
from kvcached.integrations.sglang.elastic_kv import ElasticKV, KVShape
from kvcached.integrations.sglang.groups import enforce_cache_cap
from kvcached.integrations.sglang.slots import SlotAllocator
from kvcached.units import MIB

# 2048 bytes per token and buffer: 1024 tokens per 2 MiB kvcached page.
SHAPE = dict(layers=2, heads=8, head_dim=128, dtype=torch.float16)


@pytest.fixture
def env(tmp_path, monkeypatch):
    from kvcached import config

    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_IPC_NAME", "sglang-core")
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "WARNING")
    config.reload_config()
    yield tmp_path
    config.reload_config()


def make(
    page_size: int,
    size: int,
    *,
    capacity_mib: int = 256,
    index: int = 72,
    register: bool = False,
    **kw,
) -> tuple[ElasticKV, SlotAllocator]:
    from kvcached.ledger import open_pool_budget

    driver = HostDriver(index=index, capacity=capacity_mib * MIB)
    budget = open_pool_budget(driver, "sglang-core", calibrate=False, config=get_config())
    kw.setdefault("min_reserved", 0)
    kw.setdefault("max_reserved", 0)
    kv = ElasticKV(
        KVShape(block_tokens=page_size, size=size, **SHAPE),
        driver=driver,
        budget=budget,
        register=register_pool if register else None,
        background=False,
        max_handle_bytes=0,
        **kw,
    )
    return kv, SlotAllocator(kv, size // page_size)


def test_mha_buffers_are_sglangs_fused_layout_over_kvcached_pages(env):
    kv, slots = make(1, 3000)
    try:
        k, v = kv.mha_buffers()
        assert kv.rows >= 3001 and kv.rows % 1024 == 0
        assert k[0].shape == v[0].shape == (kv.rows, 8, 128)
        assert k[0].stride() == (8 * 128, 128, 1) and k[0].is_contiguous()
        # V follows K at a fixed distance, like SGLang's (2, rows, H, D) buffer.
        assert v[0].data_ptr() - k[0].data_ptr() == kv.rows * 8 * 128 * 2
        ids = slots.alloc_blocks(1500)
        assert ids is not None and kv.cache.usage().pages_used == 2
        idx = torch.tensor(ids)
        data = torch.randn(1500, 8, 128, dtype=torch.float16)
        k[1][idx] = data
        assert torch.equal(kv.cache.tensors.key_view(1).view(-1, 8, 128)[idx], data)
        assert not k[0][idx].any() and not v[1][idx].any()  # no aliasing across layers/buffers
    finally:
        kv.close()


def test_separate_v_head_dim_and_mla_shapes(env):
    driver = HostDriver(index=73, capacity=256 * MIB)
    from kvcached.memory.free_budget import DriverFreeBudget

    kv = ElasticKV(
        KVShape(
            layers=1,
            block_tokens=1,
            size=64,
            heads=4,
            head_dim=128,
            v_head_dim=64,
            dtype=torch.bfloat16,
        ),
        driver=driver,
        budget=DriverFreeBudget(driver),
        register=None,
        background=False,
    )
    mla = ElasticKV(
        KVShape(
            layers=3,
            block_tokens=1,
            size=64,
            heads=1,
            head_dim=576,
            dtype=torch.bfloat16,
            kv_buffers=1,
        ),
        driver=driver,
        budget=DriverFreeBudget(driver),
        register=None,
        background=False,
    )
    try:
        k, v = kv.mha_buffers()
        assert k[0].shape[1:] == (4, 128) and v[0].shape[1:] == (4, 64)
        assert [b.shape[1:] for b in mla.mla_buffers()] == [(1, 576)] * 3
        with pytest.raises(ConfigError, match="kv_buffers"):
            mla.mha_buffers()
    finally:
        kv.close()
        mla.close()


def test_logical_capacity_and_physical_budget_both_bound_allocation(env):
    # 16 MiB budget = 4 pages of 4 MiB (2 layers x K,V x 2 MiB): 4 * 1024 - 1 tokens.
    kv, slots = make(1, 10_000, capacity_mib=16)
    try:
        room = slots.available_tokens()
        assert 0 < room < 10_000
        assert slots.alloc_blocks(room + 1) is None and slots.misses == 1
        ids = slots.alloc_blocks(room)
        assert ids is not None and slots.available_tokens() == 0
        slots.free_blocks(ids[:10])
        assert slots.available_tokens() == 10
    finally:
        kv.close()
    kv, slots = make(4, 64)
    try:
        assert slots.available_tokens() == 64  # SGLang's size, not the larger virtual range
        assert slots.alloc_blocks(17) is None and slots.alloc_blocks(16) is not None
    finally:
        kv.close()


def test_bad_frees_raise_and_change_nothing(env):
    kv, slots = make(1, 64)
    try:
        ids = slots.alloc_blocks(4)
        with pytest.raises(BlockError):
            slots.free_blocks([0])  # the padding page
        slots.free_blocks(ids[:2])
        with pytest.raises(BlockError):
            slots.free_blocks(ids[1:3])  # ids[1] was freed already
        assert slots.n_live == 2
        with pytest.raises(ConfigError, match="capacity"):
            SlotAllocator(kv, kv.cache.num_blocks)
    finally:
        kv.close()


def test_reservation_is_held_through_a_shrink_and_released_at_round_end(env):
    kv, slots = make(16, 16 * 200, capacity_mib=64)
    try:
        slots.begin_round()
        assert slots.reserve(70)  # 70 pages of 16 tokens: two kvcached pages
        assert slots.stashed == 70
        available = slots.available_tokens()
        # Another engine takes everything the ledger has left.
        from kvcached.ledger import open_pool_budget

        other = open_pool_budget(kv.driver, "other-engine", calibrate=False, config=get_config())
        taken = kv.budget.headroom() // (2 * MIB) * (2 * MIB)
        assert other.grant(taken)
        got = slots.alloc_blocks(70)  # served from the reservation
        assert got is not None and slots.stashed == 0
        assert slots.available_tokens() == available - 70 * 16
        slots.end_round()
        other.refund(taken)
        other.close()
        slots.begin_round()
        assert slots.reserve(5) and slots.stashed == 5
        slots.end_round()
        assert slots.stashed == 0
    finally:
        kv.close()


def test_clear_frees_everything_and_unmaps(env):
    kv, slots = make(1, 5000, max_reserved=8)
    try:
        assert slots.alloc_blocks(4000) is not None
        assert kv.cache.usage().pages_mapped == 4
        released = slots.clear()
        assert released == 3 and kv.cache.usage().pages_mapped == 1  # the padding page stays
        assert slots.n_live == 0 and slots.available_tokens() == 5000
    finally:
        kv.close()


class Tree:
    """A prefix cache of ``cached`` evictable tokens held in ``ids``."""

    def __init__(self, slots: SlotAllocator, ids: list[int]) -> None:
        self.slots, self.ids = slots, ids
        self.evicted: list[int] = []

    def evictable_size(self) -> int:
        return len(self.ids) * self.slots.block_tokens

    def evict(self, tokens: int) -> int:
        n = min(len(self.ids), -(-tokens // self.slots.block_tokens))
        gone, self.ids = self.ids[:n], self.ids[n:]
        self.slots.free_blocks(gone)
        self.evicted.append(tokens)
        return n * self.slots.block_tokens


def test_cache_cap_evicts_whole_kvcached_pages_of_tokens(env):
    kv, slots = make(1, 8000)
    try:
        tree = Tree(slots, slots.alloc_blocks(3000))
        slots.evictor = tree.evict
        assert enforce_cache_cap(slots, tree, -1) == 0  # below 0: unlimited
        assert enforce_cache_cap(slots, tree, 5000) == 0
        got = enforce_cache_cap(slots, tree, 2500)  # 500 over: one page of 1024 tokens
        assert tree.evicted == [1024] and got == 1024 and tree.evictable_size() == 3000 - 1024
        assert enforce_cache_cap(slots, tree, 0) == 3000 - 1024  # 0: keep nothing
    finally:
        kv.close()


def test_control_source_limits_and_reclaims_through_the_scheduler_round(env):
    from kvcached.control.instance import current_instance
    from kvcached.control.limits import set_limit
    from kvcached.ledger.snapshot import LimitStatus

    kv, slots = make(1, 8000, register=True, max_reserved=8)
    source = kv.source
    source.slots = slots
    try:
        tree = Tree(slots, slots.alloc_blocks(5000))  # 5 kvcached pages, all cached
        slots.evictor = tree.evict
        source.prefix_cache_tokens = tree.evictable_size
        usage = source.pool_usage()
        assert usage.pages_mapped == 5 and usage.prefix_cache_bytes == 5000 * 2 * 2 * 2048
        assert source in current_instance().pools
        page = kv.cache.geometry.page_bytes
        result = set_limit("sglang-core", 2 * page, directory=str(env), wait_s=0)
        assert result.status in (LimitStatus.APPLIED, LimitStatus.DEFERRED), result
        # The control thread asked for an eviction; the scheduler thread runs it.
        deadline = time.monotonic() + 5
        while slots._evict_wanted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slots._evict_wanted > 0 and tree.evicted == []  # not from the control thread
        # Freed slots return memory when whole pages empty, so the instance
        # keeps asking until the pool is under its limit; rounds keep evicting.
        deadline = time.monotonic() + 10
        while kv.cache.usage().pages_mapped > 2 and time.monotonic() < deadline:
            slots.begin_round()
            slots.end_round()
            time.sleep(0.1)
        assert tree.evicted and slots.evicted_tokens > 0
        assert kv.cache.usage().pages_mapped <= 2
        assert slots.alloc_blocks(3000) is None  # growth past the limit is a miss
        set_limit("sglang-core", None, directory=str(env))
    finally:
        kv.close()
    assert source not in current_instance().pools


def test_the_factory_passes_the_registration_in_and_close_leaves_once(env):
    """ElasticKV does not import the control layer: whoever builds it passes
    the registration in (pools.build_joined passes control.register_pool),
    the pool keeps what it returned and leaves through it on close, once."""
    import functools

    from kvcached.control.instance import current_instance
    from kvcached.integrations.sglang.elastic_kv import build_elastic_kv

    calls = []

    class Joined:
        def leave(self) -> None:
            calls.append("leave")

    joined = Joined()

    def register(kv):
        calls.append(kv)
        return joined

    shape = KVShape(block_tokens=1, size=1000, **SHAPE)
    kv = build_elastic_kv(shape, device="cpu", name="joined", register=register)
    assert kv is not None and kv.source is joined and calls == [kv]
    kv.close()
    kv.close()
    assert calls == [kv, "leave"]

    kv = build_elastic_kv(
        shape,
        device="cpu",
        name="joined",
        register=functools.partial(register_pool, engine_version="0.5.23"),
    )
    assert kv is not None
    try:
        assert kv.source in current_instance().pools and kv.source.kv is kv
    finally:
        kv.close()
    assert kv.source not in current_instance().pools
