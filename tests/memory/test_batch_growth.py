"""Growth in batches: PageMapper.map_runs (one claim, one grant, one publish
for several extents) and the page pool's use of it, including the fallback for
a PageBackend without it, a budget that says no at grant time, and an
interrupt in the middle of a batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcached.driver.faulty import FaultyDriver
from kvcached.errors import MappingError
from kvcached.memory import KVLayout, PageAllocator, PageMapper, VirtualKVTensors, plan_pages
from kvcached.memory.pages import IDLE, QUARANTINED, UNMAPPED, USED
from kvcached.units import MIB
from tests.memory.kvmem_helpers import ExactBudget, check_pattern, small_spec, write_pattern

G = 2 * MIB


def _parts(
    driver,
    *,
    pages=8,
    layers=2,
    buffers=2,
    budget_pages=None,
    max_handle=0,
    layout=KVLayout.PER_LAYER,
):
    spec = small_spec(layers, buffers)
    g = plan_pages(spec, layout=layout, granularity=G, page_size=G, num_blocks=pages * 4)
    budget = ExactBudget((budget_pages if budget_pages is not None else pages) * g.page_bytes)
    tensors = VirtualKVTensors(driver, spec, g)
    mapper = PageMapper(tensors, budget, max_handle_bytes=max_handle)
    return tensors, mapper, budget


@pytest.mark.parametrize("layout", [KVLayout.PER_LAYER, KVLayout.CONTIGUOUS])
def test_map_runs_maps_every_span_behind_one_grant(host, layout):
    faulty = FaultyDriver(host)
    t, m, budget = _parts(faulty, layout=layout, max_handle=64 * MIB)
    assert m.map_runs([(0, 1), (2, 3), (6, 2)]) == 3
    assert budget.grants == 1 and budget.used == 6 * m.page_bytes == host.own_bytes()
    assert [m.extent_of(p) for p in (0, 3, 7)] == [(0, 1), (2, 3), (6, 2)]
    assert all(m.is_mapped(p) for p in (0, 2, 3, 4, 6, 7)) and not m.is_mapped(1)
    per_extent = 1 if layout is KVLayout.CONTIGUOUS else 4
    assert faulty.calls["create"] == faulty.calls["set_access"] == 3 * per_extent
    assert m.held_bytes() == budget.used
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


def test_map_runs_misuse_changes_nothing(host):
    t, m, budget = _parts(host, max_handle=64 * MIB)
    assert m.map_run(3, 1)
    for spans in (
        [(0, 1), (3, 1)],
        [(0, 2), (1, 1)],
        [(0, 1), (7, 2)],
        [(0, 1), (-1, 1)],
        [(0, 1), (1, 0)],
        [(0, 1), (1.0, 1)],
    ):
        with pytest.raises(MappingError):
            m.map_runs(spans)
        assert m.mapped_pages == 1 and budget.used == m.page_bytes, spans
        assert all(m.extent_of(p) is None for p in (0, 1, 2, 7)), spans
    assert m.map_runs([]) == 0
    assert m.unmap_all()
    t.close()


def test_map_runs_denied_by_the_budget_touches_nothing(host):
    faulty = FaultyDriver(host)
    t, m, budget = _parts(faulty, budget_pages=2)
    assert m.map_runs([(0, 1), (1, 1), (2, 1)]) == 0
    assert faulty.calls["create"] == 0 and budget.used == 0 and m.mapped_pages == 0
    assert budget.denials == 1
    t.close()


@pytest.mark.parametrize("call, nth", [("create", 5), ("map", 6), ("set_access", 8)])
def test_map_runs_stops_at_the_first_failure_and_refunds_the_rest(host, call, nth):
    # 4 handles per page, spans apart: the 5th create / 6th map / 8th set_access
    # is in the 2nd span
    faulty = FaultyDriver(host, fail_nth={call: nth})
    t, m, budget = _parts(faulty)
    assert m.map_runs([(0, 1), (2, 1), (4, 1), (6, 1)]) == 1
    assert m.is_mapped(0) and all(m.extent_of(p) is None for p in (2, 4, 6))
    assert budget.used == m.page_bytes == host.own_bytes() == m.held_bytes()
    assert m.mapped_pages == 1
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


@pytest.mark.parametrize("layout", [KVLayout.PER_LAYER, KVLayout.CONTIGUOUS])
def test_adjacent_spans_take_one_set_access_per_range_and_one_unmap(host, layout):
    faulty = FaultyDriver(host)
    t, m, budget = _parts(faulty, layout=layout)
    ranges = 1 if layout is KVLayout.CONTIGUOUS else 4
    assert m.map_runs([(0, 1), (1, 1), (2, 1), (3, 1), (5, 1)]) == 5
    # pages 0-3 are one run (one set_access per range), page 5 its own
    assert faulty.calls["create"] == faulty.calls["map"] == 5 * ranges
    assert faulty.calls["set_access"] == 2 * ranges
    assert [m.extent_of(p) for p in range(6)] == [(0, 1), (1, 1), (2, 1), (3, 1), None, (5, 1)]
    view = SimpleNamespace(tensors=t, geometry=t.geometry)  # what the pattern helpers read
    blocks = [b for b in range(6 * 4) if b // 4 != 4]
    write_pattern(view, blocks)
    check_pattern(view, blocks)
    # released together, in any order: one unmap per range of the run 1-3, page 5 alone
    assert m.unmap_runs([(5, 1), (3, 1), (1, 1), (2, 1)]) == [True] * 4
    assert faulty.calls["unmap"] == 4 * ranges and faulty.calls["release"] == 4 * ranges
    assert budget.used == m.page_bytes == host.own_bytes() == m.held_bytes()
    check_pattern(view, list(range(4)))  # page 0 kept its data
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


@pytest.mark.parametrize("call, nth", [("create", 7), ("map", 7), ("set_access", 4)])
def test_a_failure_in_a_run_undoes_the_whole_run_only(host, call, nth):
    # 4 ranges: run 0-1 is created, mapped and enabled range by range (8 creates,
    # 4 set_access); run 3-4 follows; each nth lands in the 2nd run
    faulty = FaultyDriver(host, fail_nth={call: nth + (8 if call != "set_access" else 4)})
    t, m, budget = _parts(faulty)
    assert m.map_runs([(0, 1), (1, 1), (3, 1), (4, 1)]) == 2
    assert m.is_mapped(0) and m.is_mapped(1)
    assert all(m.extent_of(p) is None for p in (3, 4))
    assert budget.used == 2 * m.page_bytes == host.own_bytes() == m.held_bytes()
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


@pytest.mark.parametrize(
    "handles, faults, kept",
    [
        # 4 ranges, runs [0, 2) then [3, 5): the 16th create or map is the last
        # range of page 4, so page 3 is whole (every range mapped) and kept
        (4, {"create": 16}, 3),
        (4, {"map": 16}, 3),
        (4, {"create": 14}, 2),  # the 3rd range: no extent of the run is whole
        # one handle a page, runs [0, 2) then [3, 6): every range is the last
        (1, {"create": 4}, 3),
        (1, {"map": 5}, 4),
        (1, {"create": 4, "set_access": 2}, 2),  # enabling page 3 fails: undone too
    ],
)
def test_a_run_that_fails_in_its_last_range_keeps_its_whole_extents(host, handles, faults, kept):
    """_build_run: the extents before the failed call are whole when it failed
    in the last range; they are enabled and kept (what one call per page would
    have kept), and the rest of the run and the spans after it are undone and
    refunded."""
    faulty = FaultyDriver(host, fail_nth=faults)
    side = 2 if handles == 4 else 1
    t, m, budget = _parts(faulty, layers=side, buffers=side)
    spans = [(0, 1), (1, 1), (3, 1), (4, 1), (5, 1)][: 4 if handles == 4 else 5]
    assert m.map_runs(spans) == kept
    assert all(m.is_mapped(p) for p, _ in spans[:kept])
    assert all(m.extent_of(p) is None for p, _ in spans[kept:])
    assert budget.used == kept * m.page_bytes == host.own_bytes() == m.held_bytes()
    assert m.mapped_pages == kept and not m.quarantined_extents()
    view = SimpleNamespace(tensors=t, geometry=t.geometry)
    blocks = [b for p, _ in spans[:kept] for b in range(4 * p, 4 * p + 4)]
    write_pattern(view, blocks)  # the kept pages are enabled: writable
    check_pattern(view, blocks)
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


@pytest.mark.parametrize("fail", [{"unmap": 2}, {"release": 3}])
def test_a_failed_run_unmap_or_release_falls_back_per_handle(host, fail):
    faulty = FaultyDriver(host, fail_nth=fail)
    t, m, budget = _parts(faulty, layers=1, buffers=1)  # one handle per page
    assert m.map_runs([(p, 1) for p in range(4)]) == 4
    results = m.unmap_runs([(p, 1) for p in range(4)])
    if "unmap" in fail:  # the run's one call fails whole, then each page goes by itself
        assert results == [True] * 4 and faulty.calls["unmap"] == 4 + 4
    else:  # the 3rd release fails: that page is unmapped, retried once, then released
        assert results == [True] * 4 and faulty.calls["release"] == 5
    assert m.mapped_pages == 0 and budget.used == 0 == host.own_bytes()
    t.close()


def test_a_release_that_keeps_failing_quarantines_its_page_only(host):
    faulty = FaultyDriver(host, fail_nth={"release": {2, 5}})
    t, m, budget = _parts(faulty, layers=1, buffers=1)
    assert m.map_runs([(p, 1) for p in range(4)]) == 4
    assert m.unmap_runs([(p, 1) for p in range(4)]) == [True, False, True, True]
    assert m.quarantined_extents() == [(1, 1)]
    assert budget.used == m.page_bytes == m.held_bytes() == host.own_bytes()
    assert m.retry_quarantined() == [(1, 1)]
    assert budget.used == 0 == host.own_bytes()
    t.close()


def test_a_failed_undo_in_a_batch_is_quarantined(host):
    faulty = FaultyDriver(host, fail_nth={"map": 6, "release": 1})
    t, m, budget = _parts(faulty)
    assert m.map_runs([(0, 1), (2, 1), (4, 1)]) == 1
    assert m.quarantined_extents() == [(2, 1)]
    assert budget.used == m.held_bytes() == host.own_bytes() > m.page_bytes
    assert m.retry_quarantined() == [(2, 1)]
    assert m.unmap_all() and budget.used == 0 == host.own_bytes()
    t.close()


class Interrupt(BaseException):
    pass


class InterruptingDriver(FaultyDriver):
    """Raises a BaseException (as a KeyboardInterrupt would) at the nth create."""

    def __init__(self, inner, at: int) -> None:
        super().__init__(inner)
        self.at = at

    def create(self, size):
        if self.calls["create"] + 1 == self.at:
            self.calls["create"] += 1
            raise Interrupt
        return super().create(size)


def test_an_interrupt_in_a_pool_refill_settles_every_page(host):
    # 4 handles per page: a refill grows 4 pages per step (REFILL_STEP_HANDLES),
    # so a refill of 6 is a run of pages 0-3 (creates 1-16), then of 4-5; the
    # 19th create is in the second
    driver = InterruptingDriver(host, at=16 + 3)
    t, m, budget = _parts(driver, pages=8)
    pa = PageAllocator(m, min_reserved=0, max_reserved=8, background=False)
    pa.min_reserved = 6
    with pytest.raises(Interrupt):
        pa._refill()
    assert [pa.state_of(p) for p in range(6)] == [IDLE] * 4 + [UNMAPPED] * 2
    assert pa.counts() == pa.recount()
    assert budget.used == 4 * m.page_bytes == host.own_bytes() == m.held_bytes()
    assert pa.take(5) == [0, 1, 2, 3, 4]  # and the pool goes on
    assert pa.counts()["used"] == 5
    assert pa.close() and budget.used == 0 == host.own_bytes()
    t.close()


def test_an_interrupt_in_a_take_gives_back_its_idle_pages(host):
    driver = InterruptingDriver(host, at=4 * 2 + 1)  # the first new page of the 2nd take
    t, m, budget = _parts(driver, pages=8)
    pa = PageAllocator(m, min_reserved=0, max_reserved=8, background=False)
    got = pa.take(2)
    pa.give_back(got)  # two idle pages
    with pytest.raises(Interrupt):
        pa.take(3)  # 2 idle + 1 new: the new one is interrupted
    assert [pa.state_of(p) for p in range(3)] == [IDLE, IDLE, UNMAPPED]
    assert pa.counts() == pa.recount() and pa.counts()["idle"] == 2
    assert sorted(pa.take(3)) == [0, 1, 2]
    assert pa.close() and budget.used == 0 == host.own_bytes()
    t.close()


def test_a_take_denied_at_grant_time_misses_and_leaves_nothing(host):
    t, m, budget = _parts(host, pages=8)
    pa = PageAllocator(m, background=False)
    assert pa.take(2) == [0, 1]
    budget.capacity = 3 * m.page_bytes  # someone else took the rest meanwhile
    assert pa.take(2) is None
    assert [pa.state_of(p) for p in range(4)] == [USED, USED, UNMAPPED, UNMAPPED]
    assert pa.counts() == pa.recount() and budget.used == 2 * m.page_bytes
    assert pa.take(1) == [2]
    assert pa.close() and budget.used == 0
    t.close()


class PerSpanBackend:
    """A PageBackend with map_run only (e.g. a proxy for another process)."""

    def __init__(self, mapper: PageMapper) -> None:
        self._m = mapper
        self.budget = mapper.budget
        self.geometry = mapper.geometry
        self.page_bytes = mapper.page_bytes
        self.max_run_pages = mapper.max_run_pages
        self.calls = 0

    @property
    def mapped_pages(self) -> int:
        return self._m.mapped_pages

    def map_run(self, first, count):
        self.calls += 1
        return self._m.map_run(first, count)

    def unmap_runs(self, spans):
        return self._m.unmap_runs(spans)

    def retry_quarantined(self, spans=None):
        return self._m.retry_quarantined(spans)

    def extent_of(self, page):
        return self._m.extent_of(page)

    def unmap_all(self):
        return self._m.unmap_all()


def test_a_backend_without_map_runs_is_called_per_span(host):
    faulty = FaultyDriver(host, fail_nth={"create": 4 * 2 + 1})  # the 3rd page
    t, m, budget = _parts(faulty, pages=8)
    backend = PerSpanBackend(m)
    pa = PageAllocator(backend, max_reserved=8, background=False)
    assert pa.take(4) is None
    assert backend.calls == 3
    assert [pa.state_of(p) for p in range(4)] == [IDLE, IDLE, UNMAPPED, UNMAPPED]
    assert pa.take(3) == [0, 1, 2]
    assert pa.counts() == pa.recount()
    assert pa.close() and budget.used == 0 == host.own_bytes()
    t.close()


def test_quarantine_state_survives_in_the_pool(host):
    faulty = FaultyDriver(host, fail_nth={"set_access": 2, "unmap": 1})
    t, m, budget = _parts(faulty, pages=8)
    pa = PageAllocator(m, max_reserved=8, background=False)
    # pages 0-1 are one run: its 2nd range fails, and page 1's undo cannot unmap
    assert pa.take(2) is None
    assert pa.state_of(1) == QUARANTINED and pa.state_of(0) == UNMAPPED
    assert pa.counts() == pa.recount()
    assert pa.retry_quarantined() == 1
    assert pa.close() and budget.used == 0 == host.own_bytes()
    t.close()


def test_a_take_prefers_a_hole_that_holds_all_its_pages(host):
    faulty = FaultyDriver(host)
    t, m, budget = _parts(faulty, pages=12, layers=1, buffers=1)
    pa = PageAllocator(m, background=False)  # no pool: given-back pages are unmapped
    got = pa.take(6)
    assert got == [0, 1, 2, 3, 4, 5]
    pa.give_back([1, 3])
    assert pa.state_of(1) == pa.state_of(3) == UNMAPPED
    access = faulty.calls["set_access"]
    assert pa.take(3) == [6, 7, 8]  # one run, not pages 1, 3 and 6
    assert faulty.calls["set_access"] == access + 1
    assert pa.take(1) == [1]  # the lowest page still goes first to a one-page take
    assert pa.take(2) == [9, 10]  # page 3 alone is no hole of two
    assert pa.take(1) == [3]
    pa.give_back([0, 2])
    assert pa.take(3) == [0, 2, 11]  # no hole of three left: the lowest pages
    assert pa.counts() == pa.recount()
    assert pa.close() and budget.used == 0 == host.own_bytes()
    t.close()
