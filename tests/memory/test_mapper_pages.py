"""The page mapper (extents, undo, quarantine) and the page pool (runs,
reserve, cap, trim) on the host and faulty backends."""

from __future__ import annotations

import pytest

from kvcached.driver.faulty import FaultyDriver
from kvcached.errors import MappingError
from kvcached.memory import KVLayout, PageMapper, VirtualKVTensors, plan_pages
from kvcached.memory.mapper import runs
from kvcached.memory.pages import IDLE, QUARANTINED, UNMAPPED, USED
from kvcached.units import MIB
from tests.memory.kvmem_helpers import ExactBudget, make_cache, small_spec

G = 2 * MIB


def _mapper(
    driver,
    *,
    layers=2,
    buffers=2,
    pages=8,
    layout=KVLayout.PER_LAYER,
    max_handle=64 * MIB,
    budget_pages=None,
    hook=None,
):
    spec = small_spec(layers, buffers)
    g = plan_pages(spec, layout=layout, granularity=G, page_size=G, num_blocks=pages * 4)
    budget = ExactBudget((budget_pages or pages) * g.page_bytes)
    t = VirtualKVTensors(driver, spec, g)
    return PageMapper(t, budget, max_handle_bytes=max_handle, before_unmap=hook), budget


def test_runs_split_adjacent_ids():
    assert runs([0, 1, 2, 5, 6, 9], 10) == [(0, 3), (5, 2), (9, 1)]
    assert runs([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 2), (4, 1)]
    assert runs([], 4) == []
    with pytest.raises(MappingError):
        runs([1, 1], 4)


@pytest.mark.parametrize("layout, handles", [(KVLayout.PER_LAYER, 4), (KVLayout.CONTIGUOUS, 1)])
def test_coalesced_growth_costs_one_handle_set_per_extent(host, layout, handles):
    faulty = FaultyDriver(host)
    m, budget = _mapper(faulty, layout=layout)
    assert m.map_pages(range(8))
    assert faulty.calls["create"] == handles  # 8 pages, one extent
    assert m.extent_of(5) == (0, 8)
    assert budget.used == 8 * m.page_bytes == host.own_bytes()
    with pytest.raises(MappingError, match="unmapped whole"):
        m.unmap_pages([0, 1])
    assert m.unmap_pages(range(8))
    assert budget.used == 0 and host.own_bytes() == 0


def test_coalescing_off_maps_page_by_page(host):
    faulty = FaultyDriver(host)
    m, _ = _mapper(faulty, max_handle=0)
    assert m.max_run_pages == 1
    assert m.map_pages([3, 4, 5])
    assert faulty.calls["create"] == 3 * 4
    assert m.unmap_pages([4])  # one page is one extent
    assert not m.is_mapped(4) and m.is_mapped(3)
    assert m.unmap_all()


def test_overlap_and_range_are_misuse(host):
    m, _ = _mapper(host)
    assert m.map_run(2, 2)
    with pytest.raises(MappingError, match="already"):
        m.map_run(3, 2)
    with pytest.raises(MappingError):
        m.map_run(7, 2)
    with pytest.raises(MappingError):
        m.unmap_run(0, 1)
    assert m.unmap_all()


@pytest.mark.parametrize(
    "call, nth",
    [("create", 1), ("create", 3), ("map", 2), ("map", 4), ("set_access", 1), ("set_access", 4)],
)
def test_failed_growth_is_undone_in_reverse(host, call, nth):
    faulty = FaultyDriver(host, fail_nth={call: nth})
    m, budget = _mapper(faulty)
    assert not m.map_run(0, 3)
    assert host.own_bytes() == 0, "a handle leaked"
    assert budget.used == 0, "the grant was not refunded"
    assert m.extent_of(0) is None and m.mapped_pages == 0
    assert faulty.calls["release"] == faulty.calls["create"] - (call == "create")
    assert m.map_run(0, 3)  # and the pages are usable again
    assert m.unmap_all()


def test_budget_denial_touches_nothing(host):
    faulty = FaultyDriver(host)
    m, budget = _mapper(faulty, budget_pages=2)
    assert not m.map_run(0, 3)
    assert faulty.calls["create"] == 0 and budget.used == 0 and m.mapped_pages == 0


@pytest.mark.parametrize("call", ["unmap", "release"])
def test_failed_release_is_quarantined_keeps_charge_and_retries(host, call):
    faulty = FaultyDriver(host)
    m, budget = _mapper(faulty)
    assert m.map_run(0, 2)
    charged = budget.used
    faulty.fail_next(call)
    assert not m.unmap_run(0, 2)
    assert m.quarantined_pages == 2 and not m.is_mapped(0)
    left = m.held_bytes()
    assert 0 < left < charged and budget.used == left == host.own_bytes()
    with pytest.raises(MappingError):
        m.map_run(0, 1)  # a quarantined page cannot be reused
    assert m.retry_quarantined() == [(0, 2)]
    assert budget.used == 0 == host.own_bytes() and m.mapped_pages == 0


def test_before_unmap_runs_once_per_batch(host):
    calls = []
    m, _ = _mapper(host, hook=lambda: calls.append(1), max_handle=0)
    assert m.map_pages(range(4))
    m.unmap_runs([(0, 1), (1, 1), (2, 1)])
    assert calls == [1]
    assert m.unmap_all()


# -- the page pool ------------------------------------------------------------------------


def test_growth_is_lowest_ids_first_and_one_run(host):
    kv, _ = make_cache(host, small_spec(), pages=8)
    pa = kv.pages
    got = kv.alloc(4 * 4)  # page 0 has 3 free (null block) -> 4 more pages
    assert got is not None
    assert sorted({kv.page_of(b) for b in got}) == [0, 1, 2, 3, 4]
    assert pa.run_of(1) == (1, 4)  # grown together: one extent
    kv.close()


def test_partly_used_run_stays_whole_idle_run_goes(host):
    kv, budget = make_cache(host, small_spec(), pages=8, max_reserved=8)
    a = kv.alloc(3 + 4 * 4)  # fills page 0 and run [1, 5)
    ids_p4 = [b for b in a if kv.page_of(b) == 4]
    rest = [b for b in a if kv.page_of(b) in (1, 2, 3)]
    kv.free(rest)
    assert kv.usage().pages_reserved == 3
    assert kv.trim() == 0, "a run with a used page was released"
    kv.free(ids_p4)
    assert kv.trim() == 4
    u = kv.usage()
    assert u.pages_mapped == 1 and u.pages_reserved == 0
    assert budget.used == kv.geometry.page_bytes
    kv.close()


def test_reserve_pool_refills_to_min_and_trims_to_max(host):
    kv, _ = make_cache(host, small_spec(), pages=12, min_reserved=2, max_reserved=3)
    assert kv.usage().pages_reserved == 2  # the null block's page was a take
    kv.alloc(3)  # the rest of page 0
    x = kv.alloc(4)  # takes an idle page -> the pool refills to 2
    assert kv.usage().pages_reserved == 2 and kv.usage().pages_mapped == 4
    y = kv.alloc(8 * 4)
    assert y is not None
    kv.free(y)
    u = kv.usage()
    assert u.pages_reserved <= 3 or not kv.pages._idle_runs
    kv.free(x)
    assert kv.available_size() == kv.usage().blocks_available
    kv.close()


def test_a_held_reserve_is_not_refilled_until_the_hold_ends(host, monkeypatch):
    """hold_reserve: while a neighbour is short (kvcached.control.yielding), takes
    map what they need and the pool maps no reserve beside them."""
    import kvcached.memory.pages as pages_mod

    now = [1000.0]
    monkeypatch.setattr(pages_mod.time, "monotonic", lambda: now[0])
    kv, _ = make_cache(host, small_spec(), pages=12, min_reserved=2, max_reserved=3)
    kv.alloc(3)  # the rest of page 0
    kv.trim()
    assert kv.usage().pages_reserved == 0
    kv.pages.hold_reserve(2.0)
    kv.alloc(4)  # one page, mapped for the take: no refill beside it
    assert kv.usage().pages_reserved == 0 and kv.usage().pages_mapped == 2
    kv.pages.hold_reserve(0.5)  # a shorter hold never cuts a longer one short
    now[0] += 1.0
    kv.alloc(4)
    assert kv.usage().pages_reserved == 0
    now[0] += 1.5  # the hold is over
    kv.alloc(4)
    assert kv.usage().pages_reserved == 2  # the pool refills to its minimum again
    kv.close()


def test_cap_shrinks_lazily_and_grows_back_to_startup(host):
    kv, budget = make_cache(host, small_spec(), pages=8, max_reserved=8, max_handle_bytes=0)
    pb = kv.geometry.page_bytes
    ids = kv.alloc(3 + 5 * 4)  # pages 0-5 in use
    assert kv.usage().pages_mapped == 6
    kv.set_limit(3 * pb)
    assert kv.usage().pages_mapped == 6, "used pages must not be taken"
    assert kv.available_size() == 0 and kv.alloc(1) is None
    page5 = [b for b in ids if kv.page_of(b) == 5]
    kv.free(page5)
    assert kv.usage().pages_mapped == 5, "an idle page over the cap must go"
    kv.free([b for b in ids if kv.page_of(b) != 5])
    u = kv.usage()
    assert u.pages_mapped <= 3 and u.limit_bytes == 3 * pb
    assert kv.available_size() == 3 * 4 - 1
    kv.set_limit(None)
    assert kv.usage().limit_bytes == 8 * pb
    assert kv.available_size() == 8 * 4 - 1
    assert kv.alloc(8 * 4 - 1) is not None  # the whole startup size again
    assert budget.used == 8 * pb
    kv.close()


def test_resize_caps_by_blocks(host):
    kv, _ = make_cache(host, small_spec(), pages=8)
    kv.resize(10)  # 3 pages
    assert kv.available_size() == 3 * 4 - 1
    kv.resize(None)
    assert kv.available_size() == 8 * 4 - 1
    kv.close()


def test_quarantined_pages_count_as_mapped_until_trim(host):
    faulty = FaultyDriver(host)
    kv, budget = make_cache(faulty, small_spec(), pages=8, max_handle_bytes=0)
    ids = kv.alloc(3 + 4)
    faulty.fail_next("unmap")
    kv.free([b for b in ids if kv.page_of(b) == 1])
    pa = kv.pages
    assert pa.state_of(1) == QUARANTINED
    u = kv.usage()
    assert u.pages_quarantined == 1 and u.pages_mapped == 2
    assert budget.used == 2 * kv.geometry.page_bytes
    assert kv.alloc(4) is not None  # growth skips the quarantined page
    assert pa.state_of(2) == USED
    assert kv.trim() >= 1
    assert pa.state_of(1) == UNMAPPED and budget.used == 2 * kv.geometry.page_bytes
    kv.close()
    assert host.own_bytes() == 0 and budget.used == 0


def test_failed_growth_leaves_mapped_pages_idle_and_misses(host):
    faulty = FaultyDriver(host, fail_nth={"create": 1 + 3})  # null page, then the 3rd new one
    kv, budget = make_cache(faulty, small_spec(), pages=8, max_handle_bytes=0, max_reserved=8)
    before = kv.usage()
    assert kv.alloc(3 + 4 * 4) is None
    after = kv.usage()
    assert after.blocks_used == before.blocks_used == 0
    assert after.pages_reserved == 2, "the two pages that did map are kept idle"
    assert budget.used == 3 * kv.geometry.page_bytes == host.own_bytes()
    assert kv.pages.state_of(3) == UNMAPPED and kv.pages.state_of(1) == IDLE
    kv.blocks.check()
    kv.close()


def test_idle_pages_of_a_partly_used_run_are_reused_first(host):
    kv, _ = make_cache(host, small_spec(), pages=12, max_reserved=12)
    kv.alloc(3)  # the rest of page 0
    low = kv.alloc(4 * 4)  # run [1, 5)
    high = kv.alloc(4 * 4)  # run [5, 9)
    assert kv.pages.run_of(1) == (1, 4) and kv.pages.run_of(5) == (5, 4)
    kv.free(low)  # run [1, 5) wholly idle
    kv.free([b for b in high if kv.page_of(b) != 5])  # run [5, 9) pinned by page 5
    got = kv.alloc(4)
    assert {kv.page_of(b) for b in got} == {6}, "a wholly idle run was broken into"
    assert kv.trim() == 4, "the wholly idle run should still be releasable"
    kv.blocks.check()
    kv.close()


def test_bad_arguments_name_themselves(host):
    from kvcached.errors import BlockError, ConfigError

    kv, _ = make_cache(host, small_spec(), pages=4)
    for bad, name in ((-1, "n"), (1.5, "n"), (True, "n")):
        with pytest.raises(ConfigError) as err:
            kv.alloc(bad)
        assert err.value.variable == name
    with pytest.raises(ConfigError) as err:
        kv.set_limit(-5)
    assert err.value.variable == "nbytes"
    with pytest.raises(ConfigError) as err:
        kv.resize("10")
    assert err.value.variable == "num_blocks"
    with pytest.raises(BlockError, match="null block"):
        kv.free([0])
    with pytest.raises(BlockError, match="out of range"):
        kv.free([kv.num_blocks])
    with pytest.raises(BlockError, match="not an int"):
        kv.free([1.0])
    ids = kv.alloc(2)
    with pytest.raises(BlockError, match="twice"):
        kv.free([ids[0], ids[1], ids[0]])
    assert all(kv.blocks.is_live(b) for b in ids), "a failed free changed something"
    import numpy as np  # numpy / torch integer scalars are counts too

    assert len(kv.alloc(np.int64(1))) == 1
    kv.close()
