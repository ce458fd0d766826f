"""Memory that one process plans and others map: PageLanes / RangeKVTensors,
PlannedPages, CompositeBudget and PrechargedBudget (the vLLM integration's parts)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcached.errors import ConfigError, MappingError
from kvcached.memory.blocks import BlockManager
from kvcached.memory.composite_budget import CompositeBudget, PrechargedBudget
from kvcached.memory.mapper import PageMapper
from kvcached.memory.pages import PageAllocator
from kvcached.memory.planned import MAP, UNMAP, PlannedPages
from kvcached.memory.ranges import PageLanes, RangeKVTensors
from kvcached.memory.spec import KVLayout, PageGeometry, PageShape, plan_pages
from kvcached.memory.tensors import PagedTensors, VirtualKVTensors
from kvcached.units import MIB
from tests.memory.kvmem_helpers import ExactBudget, small_spec

G = 2 * MIB


def two_layer_lanes(num_pages: int = 8, bpp: int = 4) -> PageLanes:
    """Two layer regions of ``num_pages`` pages of 2 MiB, back to back."""
    region = num_pages * G
    return PageLanes(
        size=2 * region,
        lanes=((0, G), (region, G)),
        num_pages=num_pages,
        blocks_per_page=bpp,
        granularity=G,
    )


def geometry(num_pages: int = 8, bpp: int = 4, page_bytes: int = 2 * G) -> PageGeometry:
    return PageGeometry(
        layout=KVLayout.CONTIGUOUS,
        num_layers=1,
        buffer_block_bytes=(page_bytes // bpp,),
        blocks_per_page=bpp,
        num_pages=num_pages,
        granularity=G,
    )


@pytest.mark.parametrize("layout", [KVLayout.PER_LAYER, KVLayout.CONTIGUOUS])
def test_both_geometries_speak_one_page_vocabulary(host, layout) -> None:
    """PageGeometry and PageLanes are both a PageShape, VirtualKVTensors and
    RangeKVTensors both PagedTensors: a page is the same offset in every lane,
    its bytes are its lanes' strides, and an extent is one range per lane."""
    g = plan_pages(small_spec(2, 2), layout=layout, granularity=G, page_size=G, num_blocks=32)
    lanes = two_layer_lanes()
    assert isinstance(g, PageShape) and isinstance(lanes, PageShape)
    assert not isinstance(object(), PageShape) and not isinstance(lanes, PagedTensors)
    with VirtualKVTensors(host, small_spec(2, 2), g) as vt, RangeKVTensors(host, lanes) as rt:
        for t in (vt, rt):
            assert isinstance(t, PagedTensors)
            strides = t.handle_strides()
            assert sum(stride for _, stride in strides) == t.geometry.page_bytes
            assert t.extent_ranges(1, 2) == [(va + s, 2 * s) for va, s in strides]
        assert len(vt.handle_strides()) == (1 if layout is KVLayout.CONTIGUOUS else 4)
        assert len(rt.handle_strides()) == 2


def test_page_lanes_validate_alignment_overlap_and_bounds() -> None:
    lanes = two_layer_lanes()
    assert lanes.page_bytes == 2 * G and lanes.num_blocks == 32
    assert lanes.run_ranges(2, 3) == [(2 * G, 3 * G), (10 * G, 3 * G)]
    with pytest.raises(ConfigError, match="multiples of the granularity"):
        PageLanes(size=16 * G, lanes=((1, G),), num_pages=2, blocks_per_page=1, granularity=G)
    with pytest.raises(ConfigError, match="do not overlap"):
        PageLanes(
            size=16 * G, lanes=((0, G), (G, G)), num_pages=2, blocks_per_page=1, granularity=G
        )
    with pytest.raises(ConfigError, match="past the"):
        PageLanes(
            size=3 * G, lanes=((0, G), (2 * G, G)), num_pages=2, blocks_per_page=1, granularity=G
        )
    with pytest.raises(MappingError):
        lanes.run_ranges(7, 2)


def test_range_tensors_map_pages_under_one_buffer(host) -> None:
    """Pages mapped through the lanes hold data at the buffer offsets a flat
    view addresses; unmapped pages read as zeros; memory is given back."""
    lanes = two_layer_lanes()
    tensors = RangeKVTensors(host, lanes)
    mapper = PageMapper(tensors, PrechargedBudget(), max_handle_bytes=8 * G)
    buf = tensors.buffer(torch.uint8)
    assert buf.numel() == lanes.size and buf.data_ptr() == tensors.va
    assert mapper.map_run(1, 2)
    for off, n in lanes.run_ranges(1, 2):
        buf[off : off + n].fill_(7)
    assert int(buf[lanes.run_ranges(1, 1)[1][0]]) == 7
    assert int(buf[0]) == 0  # page 0 is not mapped: zeros
    used = host.own_bytes()
    assert used == 2 * lanes.page_bytes
    assert mapper.unmap_run(1, 2)
    assert host.own_bytes() == 0
    assert int(buf[lanes.run_ranges(1, 1)[0][0]]) == 0
    tensors.close()
    tensors.close()  # idempotent


def test_range_tensors_refuse_a_plan_finer_than_the_driver(host) -> None:
    lanes = PageLanes(
        size=4096 * 4, lanes=((0, 4096),), num_pages=4, blocks_per_page=1, granularity=4096
    )
    with pytest.raises(ConfigError, match="granularity"):
        RangeKVTensors(host, lanes)


def test_composite_budget_is_all_or_nothing() -> None:
    a, b = ExactBudget(10), ExactBudget(6)
    budget = CompositeBudget([a, b])
    assert budget.grant(5)
    assert (a.used, b.used) == (5, 5)
    assert not budget.grant(2)  # b would pass 6
    assert (a.used, b.used) == (5, 5) and budget.denials == 1
    budget.refund(5)
    assert (a.used, b.used) == (0, 0)
    assert budget.headroom() == 6


def test_composite_budget_headroom_shares_a_device() -> None:
    """Two ranks on one device draw on one budget: a page per rank costs two."""
    shared = ExactBudget(100)
    budget = CompositeBudget([shared, shared], devices=["host-3", "host-3"])
    assert budget.headroom() == 50
    assert budget.grant(40)
    assert shared.used == 80 and budget.headroom() == 10


def test_precharged_budget_always_grants_and_counts() -> None:
    b = PrechargedBudget()
    assert b.grant(5) and b.grant(7)
    b.refund(5)
    assert (b.granted, b.released) == (12, 5) and b.headroom() > 1 << 40


def planned_stack(
    num_pages: int = 16,
    budget_pages: int = 16,
    min_reserved: int = 0,
    max_reserved: int = 0,
    max_run: int = 4,
):
    g = geometry(num_pages)
    budget = ExactBudget(budget_pages * g.page_bytes)
    backend = PlannedPages(g, budget, max_run_pages=max_run)
    pages = PageAllocator(
        backend, min_reserved=min_reserved, max_reserved=max_reserved, background=False
    )
    blocks = BlockManager(pages, thread_safe=False)
    return g, budget, backend, pages, blocks


def test_planned_pages_record_ops_and_premap_page0() -> None:
    g, budget, backend, pages, blocks = planned_stack()
    # Page 0 (the null block) was granted but is the workers' to map: no op.
    assert backend.take_ops() == ([], 0)
    assert budget.used == g.page_bytes
    got = blocks.alloc(2 * g.blocks_per_page)
    assert got is not None
    ops, refund = backend.take_ops()
    assert ops == [(MAP, 1, 2)] and refund == 0
    blocks.free(got)  # pages empty, max_reserved=0: released at once
    ops, refund = backend.take_ops()
    assert ops == [(UNMAP, 1, 2)] and refund == 2 * g.page_bytes
    assert budget.used == 3 * g.page_bytes, "refunded only once the workers confirmed"
    backend.confirm(refund)
    assert budget.used == g.page_bytes


def test_planned_pages_cancel_ops_that_never_left() -> None:
    """A run mapped and unmapped between two takes costs nothing and sends
    nothing; an unmap and a re-map of one run cancel out too."""
    g, budget, backend, pages, blocks = planned_stack()
    got = blocks.alloc(g.blocks_per_page)
    blocks.free(got)
    assert backend.take_ops() == ([], 0)
    assert budget.used == g.page_bytes and backend.cancelled == 1
    got = blocks.alloc(g.blocks_per_page)
    backend.take_ops()
    blocks.free(got)  # unmap queued
    again = blocks.alloc(g.blocks_per_page)  # same run mapped again before it was sent
    assert again is not None
    assert backend.take_ops() == ([], 0)
    assert budget.used == 2 * g.page_bytes


def test_planned_pages_deny_growth_without_budget() -> None:
    g, budget, backend, pages, blocks = planned_stack(budget_pages=3)
    assert blocks.alloc(3 * g.blocks_per_page - 1) is not None  # all but the null block
    assert blocks.ready_size() == 0
    assert blocks.alloc(1) is None  # a miss, not an exception


def test_planned_pages_refuse_to_unmap_page0_or_part_of_a_run() -> None:
    g, budget, backend, pages, blocks = planned_stack()
    with pytest.raises(MappingError, match="never unmapped"):
        backend.unmap_runs([(0, 1)])
    assert pages.map_idle(3) == 3
    with pytest.raises(MappingError, match="not one planned run"):
        backend.unmap_runs([(1, 1)])


def test_map_idle_stops_at_the_budget_and_the_cap() -> None:
    g, budget, backend, pages, blocks = planned_stack(budget_pages=5)
    assert pages.map_idle(10) == 4
    assert blocks.ready_size() == 4 * g.blocks_per_page + g.blocks_per_page - 1
    pages.trim()
    blocks.set_limit(2 * g.page_bytes)
    assert pages.map_idle(10) == 1


def test_replayed_ops_keep_a_real_mapper_in_step(host) -> None:
    """Random allocs and frees on the planner; its ops, applied in order to a
    real mapper over a RangeKVTensors, always leave the same pages mapped, and
    the budget ends where it started once every refund is confirmed."""
    lanes = two_layer_lanes(num_pages=16, bpp=4)
    tensors = RangeKVTensors(host, lanes)
    real = PageMapper(tensors, PrechargedBudget(), max_handle_bytes=16 * G)
    assert real.map_run(0, 1)
    g, budget, backend, pages, blocks = planned_stack(
        num_pages=16, budget_pages=12, min_reserved=2, max_reserved=3
    )
    rng = random.Random(5)
    live: list[int] = []
    for _ in range(300):
        if rng.random() < 0.55:
            got = blocks.alloc(rng.randint(1, 9))
            if got:
                live += got
        elif live:
            rng.shuffle(live)
            k = rng.randint(1, len(live))
            blocks.free(live[:k])
            del live[:k]
        if rng.random() < 0.1:
            pages.trim()
        ops, refund = backend.take_ops()
        for kind, first, count in ops:
            if kind == MAP:
                assert real.map_run(first, count)
            else:
                assert real.unmap_run(first, count)
        backend.confirm(refund)
        assert real.mapped_pages == backend.mapped_pages
        for p in range(g.num_pages):
            assert (real.extent_of(p) is None) == (backend.extent_of(p) is None), p
        blocks.check()
    blocks.free(live)
    pages.trim()
    ops, refund = backend.take_ops()
    for kind, first, count in ops:
        assert kind == UNMAP and real.unmap_run(first, count)
    backend.confirm(refund)
    assert budget.used == g.page_bytes  # page 0 only
    assert real.mapped_pages == 1
    real.unmap_all()
    tensors.close()
