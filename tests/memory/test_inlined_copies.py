"""Each hot path kept written out is pinned to the function it copies.

A copy kept for speed is a second implementation; these tests run it and its
reference on the same inputs (two objects with the same history, the same
driver faults) and compare what they return and every side effect: the
blocks handed out and the manager's whole filing, or the extents, the driver
calls, the charge and what the device holds. The copies that measured no
faster than the call they replace were folded back instead (commit "memory:
fold back five hand-written copies", with the measurements).

Where a copy sits inside a larger call, its reference is reached on a twin
object with the same history (the page pool's pick and publish) or through
the switch the copy is written behind: with ``PageMapper._one_handle`` off,
the mapper takes the general path (``_build``, ``_build_run``, the
per-handle release loop).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.driver.faulty import FaultyDriver
from kvcached.errors import MappingError
from kvcached.memory import KVLayout, PageAllocator, PageMapper, VirtualKVTensors, plan_pages
from kvcached.memory.pages import USED
from kvcached.units import MIB
from tests.memory.kvmem_helpers import ExactBudget, make_cache, small_spec

PAGES = 8
G = 2 * MIB
_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CALLS = ("create", "map", "set_access", "unmap", "release")


# -- the mapper: map_run (map_runs of one span, written out) ------------------------------


def _mapper(
    host, *, handles: int, max_handle: int, budget_pages: int = 3
) -> tuple[PageMapper, FaultyDriver]:
    layers, buffers = (1, 1) if handles == 1 else (2, 2)
    spec = small_spec(layers, buffers)
    g = plan_pages(
        spec, layout=KVLayout.PER_LAYER, granularity=G, page_size=G, num_blocks=PAGES * 4
    )
    faulty = FaultyDriver(host)
    tensors = VirtualKVTensors(faulty, spec, g)
    budget = ExactBudget(budget_pages * g.page_bytes)  # 3 of 8 pages: some grants are denied
    return PageMapper(tensors, budget, max_handle_bytes=max_handle), faulty


def _mapper_state(m: PageMapper, faulty: FaultyDriver) -> tuple:
    """Everything a map or unmap leaves behind that a caller or the device sees."""
    return (
        [m.extent_of(p) for p in range(PAGES)],
        [m.is_mapped(p) for p in range(PAGES)],
        m.mapped_pages,
        m.quarantined_extents(),
        m.held_bytes(),
        m.budget.used,
        m.budget.grants,
        m.budget.denials,
        dict(faulty.calls),
        dict(faulty.injected),
    )


def _outcome(call, *args):
    try:
        return ("ok", call(*args))
    except MappingError as exc:
        return ("MappingError", str(exc))


_op = st.tuples(
    st.sampled_from(["map", "map", "unmap", "retry"]),
    st.integers(-1, PAGES),  # first: one out of range each side
    st.integers(0, 4),  # count: 0 is misuse
    st.sampled_from((None,) + CALLS),  # a fault on this op's next call of that name
)


@pytest.mark.parametrize("reference", ["map_runs", "_build"])
@_settings
@given(
    handles=st.sampled_from([1, 4]),
    max_handle=st.sampled_from([0, 64 * MIB]),
    ops=st.lists(_op, max_size=25),
)
def test_map_run_is_map_runs_of_one_span(host, reference, handles, max_handle, ops):
    """``PageMapper.map_run(f, c)`` is ``map_runs([(f, c)]) == 1`` written
    out (with its span check and one-page claim), and builds a one-handle page
    with ``_build`` written out. Against either reference (``map_runs``, or
    ``map_run`` on a mapper with ``_one_handle`` off, which calls ``_build``):
    same result or error, same extents, driver calls, faults hit, charge and
    handles, after every step of a random history."""
    copy, fc = _mapper(host, handles=handles, max_handle=max_handle)
    ref, fr = _mapper(host, handles=handles, max_handle=max_handle)
    if reference == "_build":
        ref._one_handle = False

    def ref_map(first, count):
        if reference == "_build":
            return ref.map_run(first, count)
        return ref.map_runs([(first, count)]) == 1

    try:
        for kind, first, count, fault in ops:
            if fault is not None:
                fc.fail_next(fault)
                fr.fail_next(fault)
            if kind == "map":
                got = _outcome(copy.map_run, first, count)
                want = _outcome(ref_map, first, count)
            elif kind == "unmap":
                got = _outcome(copy.unmap_run, first, count)
                want = _outcome(ref.unmap_run, first, count)
            else:
                got, want = copy.retry_quarantined(), ref.retry_quarantined()
            assert got == want, (kind, first, count, fault)
            assert _mapper_state(copy, fc) == _mapper_state(ref, fr)
    finally:
        fc.heal()
        fr.heal()
        for m in (copy, ref):
            assert m.unmap_all()
            assert m.budget.used == 0
            m.tensors.close()


@_settings
@given(
    pages=st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=PAGES, unique=True),
    fault=st.sampled_from((None,) + CALLS[:3]),
    nth=st.integers(1, 6),
)
def test_map_runs_one_handle_build_is_build_run(host, pages, fault, nth):
    """``map_runs`` over one-page, one-handle extents builds each run of
    adjacent pages written out (``_build_run`` without its per-range loop);
    the reference is the same mapper with ``_one_handle`` off, which takes
    ``_build_run``. Without a fault they agree on everything. With one, the
    copy differs as its docstring says, and only so: the pages of the failed
    run before the failed one stay mapped (they are enabled), where
    ``_build_run`` undoes its whole run. Both keep their charges exact."""
    spans = [(p, 1) for p in sorted(pages)]
    copy, fc = _mapper(host, handles=1, max_handle=0, budget_pages=PAGES)
    ref, fr = _mapper(host, handles=1, max_handle=0, budget_pages=PAGES)
    ref._one_handle = False  # the general path: _build_run per run
    if fault is not None:
        fc._fail_at[fault] = {nth}
        fr._fail_at[fault] = {nth}
    try:
        done_copy, done_ref = copy.map_runs(spans), ref.map_runs(spans)
        if fault is None or not fc.injected:
            assert done_copy == done_ref == len(spans)
            assert _mapper_state(copy, fc) == _mapper_state(ref, fr)
        else:
            assert done_ref <= done_copy < len(spans)
            # the reference stops at the start of the failed run; the copy
            # keeps the pages of that run that were mapped before the failure
            failed_run_start = spans[done_ref][0]
            kept = spans[done_ref:done_copy]
            assert [p for p, _ in kept] == list(
                range(failed_run_start, failed_run_start + len(kept))
            )
            for m in (copy, ref):
                assert m.budget.used == m.held_bytes() == m.mapped_pages * m.page_bytes
            mapped_copy = {p for p in range(PAGES) if copy.is_mapped(p)}
            mapped_ref = {p for p in range(PAGES) if ref.is_mapped(p)}
            assert mapped_copy == mapped_ref | {p for p, _ in kept}
    finally:
        fc.heal()
        fr.heal()
        for m in (copy, ref):
            assert m.unmap_all()
            m.tensors.close()


@_settings
@given(
    pages=st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=PAGES, unique=True),
    order=st.randoms(),
    fault=st.sampled_from((None, "unmap", "release")),
    nth=st.integers(1, 6),
)
def test_release_of_one_handle_runs_is_the_per_handle_loop(host, pages, order, fault, nth):
    """``_release_runs`` releases the handles of a run of one-handle extents
    written out; the reference is its per-handle loop, which the same mapper
    takes with ``_one_handle`` off. Same spans mapped, then released in a
    random order with a fault on the nth unmap or release: same results,
    extents, quarantine, driver calls, faults hit and charges."""
    spans = [(p, 1) for p in pages]
    copy, fc = _mapper(host, handles=1, max_handle=0, budget_pages=PAGES)
    ref, fr = _mapper(host, handles=1, max_handle=0, budget_pages=PAGES)
    try:
        assert copy.map_runs(sorted(spans)) == ref.map_runs(sorted(spans)) == len(spans)
        ref._one_handle = False  # release by the per-handle loop
        order.shuffle(spans)
        if fault is not None:
            fc._fail_at[fault] = {fc.calls[fault] + nth}
            fr._fail_at[fault] = {fr.calls[fault] + nth}
        assert copy.unmap_runs(spans) == ref.unmap_runs(spans)
        assert _mapper_state(copy, fc) == _mapper_state(ref, fr)
        assert copy.retry_quarantined() == ref.retry_quarantined()
        assert _mapper_state(copy, fc) == _mapper_state(ref, fr)
    finally:
        fc.heal()
        fr.heal()
        for m in (copy, ref):
            assert m.unmap_all()
            m.tensors.close()


# -- the page pool: a take's pick of one new page (_pick_unmapped(1), written out) ------------


class _PickWatch(PageMapper):
    """Records the pool's state when a take asks to map one page: the pick
    is done then, and nothing else has changed yet."""

    pool: PageAllocator | None = None
    seen: list[tuple] = []

    def map_run(self, first: int, count: int) -> bool:
        self.seen.append(((first, count), _pool_state(self.pool)))
        return super().map_run(first, count)


def _pool_state(pa: PageAllocator) -> tuple:
    runs = [None if r is None else (r.first, r.count, r.used) for r in pa._run]
    counters = (pa.n_idle, pa.n_used, pa.n_busy, pa.n_unmapped, pa.n_quarantined)
    return bytes(pa._state), pa._unmapped_lo, counters, runs, sorted(pa._idle_runs)


@_settings
@given(
    history=st.lists(st.tuples(st.sampled_from(["take", "give", "trim"]), st.integers(1, 3))),
)
def test_a_take_of_one_new_page_picks_as_pick_unmapped(host, history):
    """Two pools with the same history (takes, give-backs, trims: holes in
    the mapped pages), then a take that grows exactly one page, whose pick
    and publish are written out. The copy's pick, seen when it asks the
    mapper for the page, against the reference on the twin (the idle pages
    popped as the take pops them, then ``_pick_unmapped(1)``): the same
    page, page states, lowest-unmapped mark and counters. Then the twin
    maps the page and publishes it with ``_publish``: the same pages
    handed out, the same states, runs and counters."""
    pools = []
    for cls in (_PickWatch, PageMapper):
        m, _ = _mapper(host, handles=1, max_handle=0, budget_pages=PAGES)
        m.__class__ = cls
        pools.append(PageAllocator(m, max_reserved=1, background=False))
    copy, ref = pools
    copy.mapper.pool, copy.mapper.seen = copy, []
    held: list[list[int]] = [[], []]
    try:
        for kind, n in history:
            for pa, mine in zip(pools, held, strict=True):
                if kind == "take":
                    got = pa.take(n)
                    mine.extend(got or [])
                elif kind == "give" and mine:
                    pa.give_back(mine[:n])
                    del mine[:n]
                elif kind == "trim":
                    pa.trim()
            assert _pool_state(copy) == _pool_state(ref)
        if not copy.n_unmapped:
            return
        n = copy.n_idle + 1  # grows one page
        copy.mapper.seen.clear()
        got = copy.take(n)
        with ref._lock:
            want = ref._pop_idle(ref.n_idle) if ref.n_idle else []
            spans = ref._pick_unmapped(1)
        assert copy.mapper.seen == [(spans[0], _pool_state(ref))]
        assert ref.mapper.map_run(*spans[0])
        with ref._lock:
            ref._publish(spans, USED, want)
        assert got == want
        assert _pool_state(copy) == _pool_state(ref)
    finally:
        for pa in pools:
            pa.close()
            pa.mapper.tensors.close()


# -- the block manager: alloc's fast path (_take) and free's refile (_refile) --------------


def _filing(bm) -> tuple:
    """The block manager's whole placement state, dict order included (a
    bucket's ``popitem`` takes its newest page, so order decides the next pick)."""
    return (
        bytes(bm._state),
        [None if lst is None else list(lst) for lst in bm._free],
        [list(bucket) for bucket in bm._buckets],
        list(bm._class_of),
        bm._lo,
        bm._free_in_held,
    )


def _reference_free(bm, ids: list[int]) -> None:
    """``free`` of blocks of one page the long way: clear, file, ``_refile``."""
    (page,) = {b // bm.blocks_per_page for b in ids}
    for b in ids:
        bm._state[b] = 0
    bm._free[page].extend(ids)
    bm._refile((page,), len(ids))


@_settings
@given(
    block_kib=st.sampled_from([512, 128, 32]),  # 4, 16 or 64 blocks a page
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 70), st.randoms()), max_size=40),
)
def test_alloc_fast_path_is_take_and_free_refile_is_refile(host, block_kib, steps):
    """Two caches with the same history. When an alloc needs no new page,
    the copy's written-out placement (``alloc``) and the reference
    (``_take``) must hand out the same ids in the same order and leave the
    same filing; a free of blocks of one page, refiled written out (``free``)
    and by ``_refile``, must leave the same filing too."""
    from kvcached.memory import KVCacheSpec

    spec = KVCacheSpec.of_bytes(1, block_kib * 1024, kv_buffers=1)
    caches = [make_cache(FaultyDriver(host), spec, pages=PAGES)[0] for _ in range(2)]
    copy, ref = (c.blocks for c in caches)
    live: list[int] = []
    try:
        for is_alloc, n, rnd in steps:
            if is_alloc:
                if n <= copy._free_in_held:  # the fast path, against _take
                    got, want = copy.alloc(n), ref._take(n)
                else:
                    got, want = copy.alloc(n), ref.alloc(n)
                assert got == want
                if got:
                    live.extend(got)
            elif live:
                rnd.shuffle(live)
                ids = live[: 1 + n % len(live)]
                bpp = copy.blocks_per_page
                page = ids[0] // bpp
                ids = [b for b in ids if b // bpp == page]  # one page: the written-out refile
                live = [b for b in live if b not in ids]
                copy.free(ids)
                _reference_free(ref, ids)
            assert _filing(copy) == _filing(ref)
            assert copy._pages.counts() == ref._pages.counts()
        copy.check()
        ref.check()
    finally:
        for c in caches:
            c.close()
