"""The vLLM integration's parts that need no vLLM: page geometry of vLLM's
layouts, the engine core's StepPlanner, the worker's PageExecutor."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvcached.driver.host import HostDriver
from kvcached.errors import KVCachedError
from kvcached.integrations.vllm import executor as executor_module
from kvcached.integrations.vllm import planner as planner_module
from kvcached.integrations.vllm import stalls as stalls_module
from kvcached.integrations.vllm import worker as worker_module
from kvcached.integrations.vllm.executor import PageExecutor
from kvcached.integrations.vllm.geometry import (
    PlanError,
    TensorShape,
    blocks_per_page,
    lanes_of,
    merge_runs,
    strided_runs,
)
from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
from kvcached.memory.planned import MAP, UNMAP
from kvcached.units import KIB, MIB
from tests.budgets import ExactBudget

G = 2 * MIB
HOST_INDEX = 29  # apart from device 0, which other suites share


# -- geometry ----------------------------------------------------------------------------------
def test_strided_runs_join_inner_axes_and_enumerate_outer_ones() -> None:
    # [L=2, B=3, C=4 bytes], layer-outermost: each layer is one run of 12 bytes.
    assert strided_runs(0, (2, 3, 4), (100, 4, 1)) == [(0, 12), (100, 12)]
    # The same blocks block-outermost with a 10-byte block stride: a run per block.
    assert strided_runs(5, (1, 3, 4), (4, 10, 1)) == [(5, 4), (15, 4), (25, 4)]
    with pytest.raises(PlanError):
        strided_runs(0, (2, 4), (8, 2))


def test_merge_runs_rounds_out_and_joins() -> None:
    assert merge_runs([(10, 5), (0, 3), (14, 10)]) == [(0, 3), (10, 14)]
    assert merge_runs([(1, 2), (5, 2), (9, 1)], granularity=4) == [(0, 12)]


def _layer_outer(layers: int, heads: int, tokens: int, cell: int, blocks: int) -> TensorShape:
    page = heads * tokens * cell
    return TensorShape(
        0,
        (layers, blocks, heads, tokens, cell),
        (blocks * page, page, tokens * cell, cell, 1),
        page,
    )


def test_lanes_of_a_layer_outermost_cache_are_per_layer_regions() -> None:
    t = _layer_outer(2, 2, 32, 128, 512)  # 8 KiB per layer and block
    assert blocks_per_page([t], 2 * MIB) == 256
    lanes = lanes_of([t], 2 * 512 * 8 * KIB, 512, 2 * MIB)
    assert lanes.lanes == ((0, G), (2 * G, G)) and lanes.num_pages == 2
    assert lanes.page_bytes == 4 * MIB


def test_lanes_of_a_block_outermost_cache_are_whole_block_runs() -> None:
    page = 8 * KIB
    t = TensorShape(0, (2, 512, 2, 32, 128), (page, 2 * page, 32 * 128, 128, 1), page)
    lanes = lanes_of([t], 512 * 2 * page, 512, 2 * MIB)
    assert lanes.lanes == ((0, 2 * G),) and lanes.blocks_per_page == 256


def test_lanes_of_a_heads_outer_layout_are_per_layer_and_head() -> None:
    # LHBNC: [L, H, B, N, C]; a block of one head is 4 KiB, so 512 blocks a page.
    head_block = 32 * 128
    t = TensorShape(
        0,
        (2, 1024, 2, 32, 128),
        (2 * 1024 * head_block, head_block, 1024 * head_block, 128, 1),
        8 * KIB,
    )
    lanes = lanes_of([t], 2 * 2 * 1024 * head_block, 1024, 2 * MIB)
    assert lanes.blocks_per_page == 512 and len(lanes.lanes) == 4
    assert all(span == G for _, span in lanes.lanes)


def test_lanes_refuse_blocks_that_do_not_fill_pages() -> None:
    t = _layer_outer(2, 2, 32, 128, 300)
    with pytest.raises(PlanError, match="multiple"):
        lanes_of([t], 2 * 300 * 8 * KIB, 300, 2 * MIB)


# -- the planner ---------------------------------------------------------------------------------
def make_planner(
    num_pages: int = 16,
    budget_pages: int = 16,
    world_size: int = 1,
    min_reserved: int = 0,
    max_reserved: int = 0,
    overlap: bool = False,  # the order every op before its step; vLLM's planner overlaps
    beside_steps: int = planner_module.BESIDE_STEPS_MAX,
) -> tuple[StepPlanner, ExactBudget]:
    g = planner_geometry(num_pages, 8, 4 * MIB, G)
    budget = ExactBudget(budget_pages * g.page_bytes)
    sent: list = []
    planner = StepPlanner(
        g,
        budget,
        world_size=world_size,
        min_reserved=min_reserved,
        max_reserved=max_reserved,
        rpc=sent.append,
        overlap=overlap,
        beside_steps=beside_steps,
    )
    planner.sent = sent  # type: ignore[attr-defined]
    return planner, budget


def test_reserve_grants_before_the_check_and_misses_when_denied() -> None:
    planner, budget = make_planner(budget_pages=4)
    assert planner.ready_blocks() == 7  # page 0 minus the null block
    assert planner.reserve(20)
    assert planner.ready_blocks() >= 20 and budget.used == 3 * planner.page_bytes
    assert not planner.reserve(40)  # the budget stops at 4 pages
    assert planner.ready_blocks() == 31
    planner.note_miss()
    assert planner.misses == 1
    ids = planner.alloc(31)
    assert ids is not None and planner.live_blocks() == 31


def test_ops_ride_the_step_and_refund_after_its_output() -> None:
    planner, budget = make_planner()
    planner.reserve(15)
    ids = planner.alloc(15)
    ops, step, _ = planner.ops_for_step()
    assert ops == [(MAP, 1, 1)] and step == 1
    planner.free(ids)  # pages empty; no reserve kept: released
    ops, step, _ = planner.ops_for_step()
    assert ops == [(UNMAP, 1, 1)] and step == 2
    assert budget.used == 2 * planner.page_bytes
    planner.step_done(2, forward=True)
    assert budget.used == planner.page_bytes


def test_a_confirmed_refund_is_flushed_to_the_ledger_at_once() -> None:
    """A busy engine never idles to flush: batched refunds would stay usable
    by this instance alone (the multi-model benchmark's shared budget)."""
    planner, budget = make_planner()
    planner.reserve(15)
    ids = planner.alloc(15)
    _, step, _ = planner.ops_for_step()
    before = budget.flushes
    planner.step_done(step, forward=True)
    assert budget.flushes == before, "a step that refunds nothing flushes nothing"
    planner.free(ids)
    _, step, _ = planner.ops_for_step()
    before = budget.flushes
    planner.step_done(step, forward=True)
    assert budget.flushes == before + 1 and budget.used == planner.page_bytes


def test_with_several_ranks_only_a_forward_step_confirms() -> None:
    planner, budget = make_planner(world_size=2)
    planner.reserve(15)
    ids = planner.alloc(15)
    planner.ops_for_step()
    planner.free(ids)
    _, step, _ = planner.ops_for_step()
    planner.step_done(step, forward=False)
    assert budget.used == 2 * planner.page_bytes, "no collective proved the ranks applied it"
    planner.step_done(step + 1, forward=True)
    assert budget.used == planner.page_bytes


def test_idle_flush_sends_ops_and_confirms_everything() -> None:
    planner, budget = make_planner(world_size=2)
    planner.reserve(15)
    ids = planner.alloc(15)
    planner.ops_for_step()
    planner.free(ids)
    assert planner.pending
    assert planner.flush()
    assert planner.sent == [[(UNMAP, 1, 1)]]  # type: ignore[attr-defined]
    assert budget.used == planner.page_bytes and budget.flushes >= 1
    assert not planner.flush()


def test_unused_reserve_beyond_the_maximum_is_cancelled_at_the_end_of_schedule() -> None:
    planner, budget = make_planner(max_reserved=1)
    planner.reserve(40)  # five pages planned for a request that then missed
    assert planner.pages.n_idle == 5 and budget.used == 6 * planner.page_bytes
    ops, _, _ = planner.ops_for_step()
    # The five pages were one run, over the maximum: released whole, and since
    # their map never left, cancelled with nothing sent and everything refunded.
    assert ops is None and planner.backend.cancelled == 1
    assert planner.pages.n_idle == 0 and budget.used == planner.page_bytes


def test_without_overlap_every_op_precedes_the_step() -> None:
    planner, _ = make_planner(min_reserved=2, max_reserved=4)
    planner.reserve(15)
    planner.alloc(15)
    ops, _, sync = planner.ops_for_step()
    assert len(ops) == 2 and sync == 2


def test_overlap_leaves_the_refill_the_step_does_not_use_to_run_beside_it() -> None:
    planner, budget = make_planner(min_reserved=2, max_reserved=4, overlap=True)
    assert planner.pages.n_idle == 2  # the reserve, pages 1-2 (one run)
    ids = planner.alloc(15)  # takes page 1; the reserve refills with page 3
    ops, _, sync = planner.ops_for_step()
    assert ops == [(MAP, 1, 2), (MAP, 3, 1)]
    assert sync == 1, "the run of page 1 precedes the step (page 2 with it); page 3 overlaps"
    assert planner.overlapped_ops == 1
    # The next step takes the reserve's pages without an op of its own (the
    # worker finishes the overlapped maps before it runs that step) ...
    more = planner.alloc(16)
    assert more is not None and {b // 8 for b in more} == {2, 3}
    ops, _, sync = planner.ops_for_step()
    assert ops == [(MAP, 4, 2)] and sync == 0, "... and its refill alone overlaps it whole"
    assert planner.overlapped_ops == 2
    planner.free(ids + more)
    assert budget.used == 6 * planner.page_bytes


def test_overlap_keeps_queue_order_before_the_last_map_a_step_uses() -> None:
    planner, _ = make_planner(max_reserved=0, overlap=True)
    planner.reserve(23)
    first = planner.alloc(23)  # pages 1-2, one run
    planner.ops_for_step()
    planner.free(first)  # the run is released: its unmap is queued
    planner.reserve(15)
    assert planner.alloc(15) is not None  # page 1 again, a run of its own
    ops, _, sync = planner.ops_for_step()
    # The step uses page 1, whose map must follow the unmap of its old run.
    assert ops == [(UNMAP, 1, 2), (MAP, 1, 1)] and sync == 2


def _release_a_page_beside_a_step(planner: StepPlanner) -> int:
    """Map a page for a step, run it, free it: the next step's ops are its
    unmap alone, overlapped. Returns that step, whose output has been processed."""
    planner.reserve(15)
    ids = planner.alloc(15)
    _, step, _ = planner.ops_for_step()
    planner.step_done(step, forward=True)
    planner.free(ids)
    ops, step, sync = planner.ops_for_step()
    assert ops == [(UNMAP, 1, 1)] and sync == 0
    planner.step_done(step, forward=True)
    return step


def test_an_overlapped_unmap_is_refunded_by_the_first_step_that_waits_or_an_idle_flush() -> None:
    planner, budget = make_planner(max_reserved=0, overlap=True)
    step = _release_a_page_beside_a_step(planner)
    assert budget.used == 2 * planner.page_bytes, "the unmap may still be running"
    assert planner.pending, "an idle engine must flush to confirm it"
    # Steps that use nothing the unmap touches run beside it without waiting;
    # their outputs confirm nothing of it.
    for _ in range(planner_module.BESIDE_STEPS_MAX - 1):
        _, step, _ = planner.ops_for_step()
        assert not planner.step_waits
        planner.step_done(step, forward=True)
        assert budget.used == 2 * planner.page_bytes
    # The last step the bound allows waits: its output confirms the unmap.
    _, step, _ = planner.ops_for_step()
    assert planner.step_waits and planner.beside_waits == 1
    assert budget.used == 2 * planner.page_bytes
    planner.step_done(step, forward=True)
    assert budget.used == planner.page_bytes and not planner.pending
    # Idle instead of a next step: the flush's RPC waits for the overlapped ops.
    _release_a_page_beside_a_step(planner)
    assert planner.flush() and planner.sent[-1] == []  # type: ignore[attr-defined]
    assert budget.used == planner.page_bytes and not planner.pending


def test_a_step_waits_for_ops_beside_earlier_steps_only_when_it_takes_a_page_they_map() -> None:
    planner, _ = make_planner(min_reserved=2, max_reserved=4, overlap=True)
    first = planner.alloc(15)  # the rest of page 0 and page 1; the refill maps page 3
    ops, _, sync = planner.ops_for_step()
    assert sync == 1 and ops[sync:] == [(MAP, 3, 1)], "page 1's run before the step, 3 beside"
    assert planner.beside_waits == 0, "nothing was in flight"
    # A decode step that takes no new page: page 3's map may run on beside it.
    assert planner.ops_for_step()[0] is None and not planner.step_waits
    # A step that takes blocks on page 2 (mapped before) still need not wait ...
    second = planner.alloc(8)
    assert {b // 8 for b in second} == {2}
    ops, _, sync = planner.ops_for_step()
    assert not planner.step_waits and planner.beside_waits == 0
    assert ops is not None and sync == 0, "... and its own refill runs beside it"
    # ... one that takes page 3 must: its map may still be running.
    third = planner.alloc(8)
    assert {b // 8 for b in third} == {3}
    planner.ops_for_step()
    assert planner.steps - 1 < planner_module.BESIDE_STEPS_MAX, "not the bound's wait"
    assert planner.step_waits and planner.beside_waits == 1
    planner.free(first + second + third)


@pytest.mark.parametrize("beside_steps", [1, 2, 6])
def test_kvcached_beside_steps_bounds_the_steps_that_run_beside_ops_in_flight(
    beside_steps: int,
) -> None:
    planner, _ = make_planner(max_reserved=0, overlap=True, beside_steps=beside_steps)
    _release_a_page_beside_a_step(planner)  # its unmap runs beside that step
    waited = []
    for _ in range(beside_steps + 1):
        _, step, _ = planner.ops_for_step()
        waited.append(planner.step_waits)
        planner.step_done(step, forward=True)
    # 1 (the order before 3636916): the very next step waits.
    assert waited == [False] * (beside_steps - 1) + [True, False]


def test_a_step_with_ops_before_it_waits_for_every_op_in_flight() -> None:
    planner, _ = make_planner(max_reserved=0, overlap=True)
    _release_a_page_beside_a_step(planner)  # page 1's unmap is in flight
    planner.reserve(15)
    assert planner.alloc(15) is not None  # page 1 again: mapped before the step
    ops, _, sync = planner.ops_for_step()
    assert ops == [(MAP, 1, 1)] and sync == 1
    assert planner.step_waits, "its map must follow the unmap still in flight"


def test_control_requests_merge_until_served() -> None:
    planner, _ = make_planner()
    planner.post_control("reclaim", 10)
    planner.post_control("reclaim", 4)
    planner.post_control("limit", ("gpu-a", 100))
    planner.post_control("limit", ("gpu-b", None))
    assert planner.take_control() == {"reclaim": 10, "limit": {"gpu-a": 100, "gpu-b": None}}
    assert planner.take_control() == {}


# -- the worker's executor -----------------------------------------------------------------------
@pytest.fixture
def host():
    driver = HostDriver(HOST_INDEX, capacity=16 * MIB)
    yield driver
    driver.close()


def _lanes():
    t = _layer_outer(2, 2, 32, 128, 2048)
    return lanes_of([t], 2 * 2048 * 8 * KIB, 2048, 2 * MIB)


def test_executor_maps_page0_and_applies_ops_in_order(host) -> None:
    lanes = _lanes()
    ex = PageExecutor(host, lanes, calibrate=False)
    try:
        buf = ex.buffer()
        assert buf.dtype == torch.int8 and buf.numel() == lanes.size
        assert ex.mapped_pages == 1 and host.own_bytes() == lanes.page_bytes
        buf[:16].fill_(3)  # page 0 is mapped: the null block is writable
        assert ex.apply([(MAP, 1, 2), (UNMAP, 1, 2), (MAP, 1, 1)])
        assert ex.mapped_pages == 2
        off = lanes.run_ranges(1, 1)[1][0]
        buf[off : off + 64].fill_(9)
        assert int(buf[off + 63]) == 9
        assert ex.apply([(UNMAP, 1, 1)])
        assert int(buf[off]) == 0 and host.own_bytes() == lanes.page_bytes
        desc = ex.describe()
        assert desc["ok"] and desc["num_pages"] == lanes.num_pages
        assert desc["device_id"] == f"host-{HOST_INDEX}" and desc["backend"] == "host"
    finally:
        ex.close()
    assert host.own_bytes() == 0


def test_executor_reports_a_map_the_device_refuses(host, monkeypatch) -> None:
    monkeypatch.setattr(executor_module, "MAP_RETRY_S", 0.1)
    lanes = _lanes()
    ex = PageExecutor(host, lanes, calibrate=False)
    try:
        # 16 MiB of capacity, 4 MiB pages: page 0 plus 3 more fit, not 4.
        assert not ex.apply([(MAP, 1, 4)])
        assert ex.failed_maps >= 1 and ex.mapped_pages == 1
        assert ex.apply([(MAP, 1, 3)])
    finally:
        ex.close()


def test_executor_overlaps_batches_in_queue_order_and_finishes_them_all(host) -> None:
    ex = PageExecutor(host, _lanes(), calibrate=False)
    try:
        assert not ex.overlapping and ex.finish(), "nothing in flight: finish returns at once"
        ex.overlap([(MAP, 1, 2)])
        assert ex.overlapping and ex.overlapped_maps
        assert ex.finish() and not ex.overlapping and not ex.overlapped_maps
        assert ex.mapped_pages == 3 and ex.maps == 1
        ex.overlap([(UNMAP, 1, 2)])
        assert not ex.overlapped_maps
        # A second batch queues behind the first (a later step's, sent before
        # any step waited): the unmap of pages 1-2 lands before page 1's map.
        ex.overlap([(MAP, 1, 1)])
        assert ex.overlapped_maps
        assert ex.finish() and not ex.overlapping and not ex.overlapped_maps
        assert ex.mapped_pages == 2 and ex.unmaps == 1 and ex.maps == 2
        ex.overlap([(UNMAP, 1, 1)])
        assert ex.finish() and ex.mapped_pages == 1
        names = {t.name for t in threading.enumerate()}
        assert any(n.startswith("kvcached-page-ops") for n in names)
    finally:
        ex.close()
    assert host.own_bytes() == 0


def test_an_overlapped_failure_is_reported_by_finish(host, monkeypatch) -> None:
    monkeypatch.setattr(executor_module, "MAP_RETRY_S", 0.1)
    ex = PageExecutor(host, _lanes(), calibrate=False)
    try:
        ex.overlap([(MAP, 1, 4)])  # 16 MiB of capacity: page 0 plus 3 more fit, not 4
        assert not ex.finish() and ex.failed_maps >= 1

        def broken(spans):
            raise RuntimeError("driver gone")

        monkeypatch.setattr(ex.mapper, "map_runs", broken)
        ex.overlap([(MAP, 1, 1)])
        ex.overlap([(MAP, 2, 1)])  # a later batch behind the broken one
        with pytest.raises(RuntimeError, match="driver gone"):
            ex.finish()
        assert not ex.overlapping, "every batch is finished: the next step may go on"
    finally:
        monkeypatch.undo()
        ex.close()
    assert host.own_bytes() == 0


def test_the_switch_interval_is_short_only_while_overlapped_ops_run(host, monkeypatch) -> None:
    """A page thread beside a step busy in Python gets the GIL back at the switch
    interval: the executor shortens it for the overlapped ops alone."""
    before = sys.getswitchinterval()
    seen: list[float] = []
    release = threading.Event()
    ex = PageExecutor(host, _lanes(), calibrate=False)
    real = ex.apply

    def slow(ops):
        seen.append(sys.getswitchinterval())
        release.wait(5)
        return real(ops)

    monkeypatch.setattr(ex, "apply", slow)
    try:
        ex.overlap([(MAP, 1, 2)])
        short = executor_module.OVERLAP_SWITCH_INTERVAL_S
        assert sys.getswitchinterval() == pytest.approx(short, rel=1e-3) and short < before
        release.set()
        assert ex.finish() and ex.mapped_pages == 3
        assert seen == [pytest.approx(short, rel=1e-3)]
        assert sys.getswitchinterval() == before, "the process' interval is back once they end"

        def broken(ops):
            raise RuntimeError("driver gone")

        monkeypatch.setattr(ex, "apply", broken)
        ex.overlap([(MAP, 3, 1)])
        with pytest.raises(RuntimeError, match="driver gone"):
            ex.finish()
        assert sys.getswitchinterval() == before, "a failed batch puts it back too"
    finally:
        release.set()
        monkeypatch.undo()
        ex.close()
        sys.setswitchinterval(before)


def test_close_waits_for_overlapped_ops_then_unmaps_everything(host) -> None:
    ex = PageExecutor(host, _lanes(), calibrate=False)
    ex.overlap([(MAP, 1, 3)])
    ex.close()
    assert host.own_bytes() == 0 and not ex.overlapping


@pytest.fixture
def worker_executor(host, monkeypatch):
    ex = PageExecutor(host, _lanes(), calibrate=False)
    monkeypatch.setattr(worker_module.WORKER, "executor", ex)
    monkeypatch.setattr(worker_module.WORKER, "world_size", 1)
    yield ex
    ex.close()


def test_worker_applies_the_sync_prefix_then_overlaps_the_rest(worker_executor) -> None:
    ex = worker_executor
    worker_module._apply_ops([(MAP, 1, 1), (MAP, 2, 2)], sync=1)
    assert ex.overlapping, "the refill runs beside the step"
    worker_module._apply_ops([(UNMAP, 2, 2)], sync=0)  # finishes the maps first, in order
    assert ex.maps == 2
    worker_module._apply_ops([])  # a step without ops still finishes the last one's
    assert not ex.overlapping and ex.mapped_pages == 2 and ex.unmaps == 1
    worker_module._apply_ops([(MAP, 2, 1)])  # no split given: everything before the step
    assert not ex.overlapping and ex.mapped_pages == 3


def test_worker_lets_ops_run_on_beside_steps_the_planner_does_not_make_wait(
    worker_executor, monkeypatch
) -> None:
    ex = worker_executor
    gate = threading.Event()
    apply = ex.apply

    def held(ops):  # the page thread is still busy when the next steps come
        gate.wait(5)
        return apply(ops)

    monkeypatch.setattr(ex, "apply", held)
    step = SimpleNamespace(kvcached_ops=[(MAP, 1, 1)], kvcached_sync=0, kvcached_wait=False)
    worker_module.apply_step_ops(step)
    worker_module.apply_step_ops(SimpleNamespace(kvcached_wait=False))  # a step without ops
    worker_module.apply_step_ops(
        SimpleNamespace(kvcached_ops=[(MAP, 2, 1)], kvcached_sync=0, kvcached_wait=False)
    )
    assert ex.overlapping and len(ex._overlapped) == 2 and ex.maps == 0, "nobody waited"
    gate.set()
    worker_module.apply_step_ops(SimpleNamespace(kvcached_wait=True))
    assert not ex.overlapping and ex.maps == 2 and ex.mapped_pages == 3
    # Ops the step needs before it are applied after everything in flight,
    # whatever the flag says (an engine core that sent none means: wait).
    gate.clear()
    worker_module.apply_step_ops(
        SimpleNamespace(kvcached_ops=[(UNMAP, 2, 1)], kvcached_sync=0, kvcached_wait=False)
    )
    gate.set()
    worker_module.apply_step_ops(
        SimpleNamespace(kvcached_ops=[(MAP, 2, 1)], kvcached_sync=1, kvcached_wait=False)
    )
    assert not ex.overlapping and ex.unmaps == 1 and ex.maps == 3 and ex.mapped_pages == 3


def test_worker_raises_at_the_next_step_when_an_overlapped_map_failed(
    worker_executor, monkeypatch
) -> None:
    monkeypatch.setattr(executor_module, "MAP_RETRY_S", 0.1)
    worker_module._apply_ops([(MAP, 1, 4)], sync=0)
    with pytest.raises(KVCachedError, match="refused"):
        worker_module._apply_ops([])
    assert not worker_executor.overlapping


def test_the_worker_times_what_its_steps_wait_for_page_ops(worker_executor, monkeypatch) -> None:
    ex = worker_executor
    gate = threading.Event()
    apply = ex.apply

    def held(ops):  # the page thread is still busy when the step that waits comes
        gate.wait(5)
        return apply(ops)

    monkeypatch.setattr(ex, "apply", held)
    worker_module.apply_step_ops(
        SimpleNamespace(kvcached_ops=[(MAP, 1, 1)], kvcached_sync=0, kvcached_wait=False)
    )
    worker_module.apply_step_ops(SimpleNamespace(kvcached_wait=False))  # goes on beside it
    threading.Timer(0.05, gate.set).start()
    worker_module.apply_step_ops(SimpleNamespace(kvcached_wait=True))  # waits for the gate
    total = ex.stalls.total
    assert [total.get(k, 0) for k in ("steps", "waits", "syncs", "beside")] == [3, 1, 0, 1]
    assert 0.04 <= total["wait_s"] == ex.stalls.max_wait_s < 5
    assert total["beside_s"] >= total["wait_s"], "the batch ran at least as long as the wait"
    monkeypatch.setattr(ex, "apply", apply)
    worker_module.apply_step_ops(
        SimpleNamespace(kvcached_ops=[(MAP, 2, 1)], kvcached_sync=1, kvcached_wait=False)
    )
    total = ex.stalls.total
    assert [total[k] for k in ("steps", "waits", "syncs")] == [4, 1, 1] and total["sync_s"] > 0
    every = stalls_module.LOG_EVERY_S
    line = ex.stalls.maybe_log(now=time.monotonic() + every)
    assert line is not None and "4 steps; 1 waited" in line and "1 applied ops first" in line
    assert "ran 1 batches beside steps" in line
    worker_module.apply_step_ops(SimpleNamespace(kvcached_wait=False))
    assert ex.stalls.maybe_log(now=time.monotonic() + 2 * every) is None, (
        "a period in which no step waited logs nothing"
    )
    assert ex.stalls.total["steps"] == 5


def test_the_engine_core_times_schedule_and_its_hooks() -> None:
    cost = stalls_module.ScheduleCost()
    assert cost.maybe_log(now=time.monotonic() + stalls_module.LOG_EVERY_S) is None, "no steps"
    cost.step(0.004, 0.001)
    cost.step(0.002, 0.0005)
    cost.output(0.0005)
    line = cost.maybe_log(now=time.monotonic() + 2 * stalls_module.LOG_EVERY_S)
    assert line is not None and "2 steps; schedule() took 3.000 ms a step" in line
    assert "kvcached's hooks 1.000 ms a step" in line
    assert cost.total == pytest.approx({"steps": 2, "schedule_s": 0.006, "hooks_s": 0.002})
