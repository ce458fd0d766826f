"""The null block's page parked while an idle vLLM engine is held at zero
(``kvcached serve``'s ``kv`` sleep), and back, through the real StepPlanner
and the real worker-side PageExecutor on the host backend (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
from kvcached.memory.planned import MAP, UNMAP
from kvcached.units import MIB
from tests.budgets import ExactBudget

G = 2 * MIB


def make_planner(num_pages: int = 16, budget_pages: int = 16) -> tuple[StepPlanner, ExactBudget]:
    g = planner_geometry(num_pages, 8, 4 * MIB, G)
    budget = ExactBudget(budget_pages * g.page_bytes)
    sent: list = []
    planner = StepPlanner(g, budget, rpc=sent.append)
    planner.sent = sent  # type: ignore[attr-defined]
    return planner, budget


def drain(planner: StepPlanner) -> list:
    """Carry the queued ops (as an idle flush would) and confirm them."""
    assert planner.flush() or not planner.pending
    return [op for batch in planner.sent for op in batch]  # type: ignore[attr-defined]


def test_parked_null_block_holds_nothing_and_comes_back_as_block_zero() -> None:
    planner, budget = make_planner()
    page = planner.page_bytes
    ids = planner.alloc(20)
    assert ids is not None and 0 not in ids
    planner.free(ids)
    planner.blocks.set_limit(1)  # held at zero: idle pages go
    planner.pages.trim()
    drain(planner)
    assert budget.used == page  # only the null block's page is left
    assert planner.unpark_null()  # a no-op when not parked
    assert planner.park_null()
    assert planner.null_parked and not planner.park_null()
    ops = drain(planner)
    assert (UNMAP, 0, 1) in ops and budget.used == 0
    assert planner.live_blocks() == 0 and planner.blocks.usage().blocks_used == 0
    planner.blocks.check()
    assert planner.alloc(1) is None  # nothing is handed out while block 0 is away
    assert not planner.unpark_null()  # the cap still allows no page
    planner.blocks.set_limit(None)
    assert planner.alloc(1) is None  # not before the null block is back
    assert planner.unpark_null() and not planner.null_parked
    planner.sent.clear()  # type: ignore[attr-defined]
    assert drain(planner) == [(MAP, 0, 1)] and budget.used == page
    planner.blocks.check()
    got = planner.alloc(3)
    assert got is not None and 0 not in got and planner.blocks.usage().blocks_used == 3
    planner.blocks.check()


def test_no_park_while_another_block_lives_on_page_zero() -> None:
    planner, budget = make_planner()
    ids = planner.alloc(1)  # best fit: page 0 holds it beside the null block
    assert ids is not None and planner.blocks.page_of(ids[0]) == 0
    planner.blocks.set_limit(1)
    assert not planner.park_null() and not planner.backend.release_page0
    planner.free(ids)
    assert planner.park_null()


def test_unpark_waits_for_the_budget() -> None:
    planner, budget = make_planner(budget_pages=1)
    planner.blocks.set_limit(1)
    assert planner.park_null()
    drain(planner)
    budget.capacity = 0  # another engine took the GPU meanwhile
    planner.blocks.set_limit(None)
    assert not planner.unpark_null() and planner.null_parked
    assert planner.alloc(1) is None
    budget.capacity = planner.page_bytes
    assert planner.unpark_null()
    assert planner.alloc(1) is not None


def test_the_worker_unmaps_and_maps_page_zero_again() -> None:
    pytest.importorskip("torch")
    from kvcached.driver.host import HostDriver
    from kvcached.integrations.vllm.executor import PageExecutor
    from kvcached.integrations.vllm.geometry import TensorShape, lanes_of

    page = 2 * 32 * 128  # heads x tokens x bytes per cell: 8 KiB per layer and block
    t = TensorShape(0, (2, 512, 2, 32, 128), (512 * page, page, 32 * 128, 128, 1), page)
    lanes = lanes_of([t], 2 * 512 * 8 * 1024, 512, G)
    driver = HostDriver(capacity=64 * MIB, index=31)
    ex = PageExecutor(driver, lanes, calibrate=False)
    try:
        assert ex.mapped_pages == 1
        assert ex.apply([(UNMAP, 0, 1)]) and ex.mapped_pages == 0
        assert ex.apply([(MAP, 0, 1)]) and ex.mapped_pages == 1
        buf = ex.buffer()
        buf[:16] = 7  # page 0 is writable again
        assert int(buf[:16].sum()) == 7 * 16
    finally:
        ex.close()
        driver.close()
