"""Hypothesis stateful tests of the block manager against a simple model.

The model is the set of live block ids. After every step: no block is handed
out twice, every live block's page is mapped and holds its data, the usage
numbers equal a recount, the budget's charge equals the bytes of handles not
yet released (which equals what the host device holds), idle memory above the
pool maximum or the cap is released unless a used page pins it. ``alloc(n)``
succeeds exactly when ``n <= available_size()`` while the driver is healthy.

The faulty variant injects driver failures at random calls (create, map,
set_access, unmap, release): the manager must stay consistent and lose no
block; after healing, trim clears every quarantine.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcached.driver.faulty import FaultyDriver
from kvcached.driver.host import HostDriver
from kvcached.errors import BlockError
from kvcached.memory import KVLayout
from kvcached.memory.pages import IDLE, USED
from kvcached.units import MIB
from tests.memory.kvmem_helpers import (
    HOST_INDEX,
    check_pattern,
    make_cache,
    small_spec,
    write_pattern,
)

PAGES = 8


class BlockMachine(RuleBasedStateMachine):
    faulty = False

    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.live: set[int] = set()
        self.freed: set[int] = set()

    @initialize(
        layout=st.sampled_from([KVLayout.PER_LAYER, KVLayout.CONTIGUOUS]),
        layers=st.integers(1, 2),
        buffers=st.integers(1, 2),
        reserve=st.sampled_from([(0, 0), (1, 2), (2, 3)]),
        coalesce=st.booleans(),
        budget_pages=st.integers(2, PAGES + 1),
        fault_p=st.sampled_from([0.05, 0.15, 0.3]),
        thread_safe=st.booleans(),
    )
    def setup(self, layout, layers, buffers, reserve, coalesce, budget_pages, fault_p, thread_safe):
        self.host = HostDriver(HOST_INDEX, capacity=512 * MIB)
        self.driver = self.host
        if self.faulty:
            self.driver = FaultyDriver(self.host, seed=budget_pages * 31 + layers)
            self.fault_p = fault_p
        self.cache, self.budget = make_cache(
            self.driver,
            small_spec(layers, buffers),
            pages=PAGES,
            budget_pages=budget_pages,
            layout=layout,
            min_reserved=reserve[0],
            max_reserved=reserve[1],
            max_handle_bytes=64 * MIB if coalesce else 0,
            thread_safe=thread_safe,
        )
        self.bm = self.cache.blocks
        self.pa = self.cache.pages
        self.bpp = self.cache.blocks_per_page
        if self.faulty:  # on from the start, once the null block's page is mapped
            for call in ("create", "map", "set_access", "unmap", "release"):
                self.driver.set_probability(call, fault_p)

    # -- helpers ----------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return not self.faulty or not self.driver.enabled

    def _snapshot(self):
        return (
            self.cache.usage(),
            self.pa.counts(),
            self.budget.used,
            sorted(b for b in range(self.cache.num_blocks) if self.bm.is_live(b)),
        )

    # -- rules ----------------------------------------------------------------------------------
    @rule(n=st.integers(0, 10))
    def alloc(self, n):
        avail = self.cache.available_size()
        got = self.cache.alloc(n)
        if got is None:
            assert n > avail or not self.healthy, f"alloc({n}) missed with {avail} available"
            return
        assert n <= avail, f"alloc({n}) succeeded with only {avail} available"
        assert len(got) == n and len(set(got)) == n, got
        assert not set(got) & self.live, f"{set(got) & self.live} handed out twice"
        assert 0 not in got
        write_pattern(self.cache, got)
        self.live |= set(got)
        self.freed -= set(got)

    @rule()
    def fill(self):
        avail = self.cache.available_size()
        got = self.cache.alloc(avail)
        if not self.healthy:
            if got is not None:
                write_pattern(self.cache, got)
                self.live |= set(got)
                self.freed -= set(got)
            return
        assert got is not None and len(got) == avail
        write_pattern(self.cache, got)
        self.live |= set(got)
        self.freed -= set(got)
        assert self.cache.available_size() == 0
        before = self._snapshot()
        assert self.cache.alloc(1) is None
        assert self._snapshot() == before

    @rule()
    def over_ask(self):
        avail = self.cache.available_size()
        before = self._snapshot()
        assert self.cache.alloc(avail + 1) is None
        if self.healthy:  # a failed growth may leave pages mapped idle; healthy ones cannot
            assert self._snapshot() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        self.cache.free(ids)
        self.live -= set(ids)
        self.freed |= set(ids)

    @rule(data=st.data(), kind=st.sampled_from(["twice", "never", "range", "null", "dup"]))
    def free_bad(self, data, kind):
        good = sorted(self.live)[:2]
        if kind == "twice":
            if not self.freed:
                return
            bad = [data.draw(st.sampled_from(sorted(self.freed)))]
        elif kind == "never":
            never = [
                b
                for b in range(1, self.cache.num_blocks)
                if b not in self.live and b not in self.freed
            ]
            if not never:
                return
            bad = [data.draw(st.sampled_from(never))]
        elif kind == "range":
            bad = [data.draw(st.sampled_from([-1, self.cache.num_blocks, 10**9]))]
        elif kind == "null":
            bad = [0]
        else:
            if not self.live:
                return
            b = data.draw(st.sampled_from(sorted(self.live)))
            bad = [b, b]
        before = self._snapshot()
        with pytest.raises(BlockError):
            self.cache.free(good + bad)
        assert self._snapshot() == before, "a failed free changed something"

    @rule()
    def trim(self):
        self.cache.trim()
        if self.healthy:
            for p in range(PAGES):
                if self.pa.state_of(p) == IDLE:
                    first, count = self.pa.run_of(p)
                    assert any(self.pa.state_of(q) == USED for q in range(first, first + count)), (
                        f"idle page {p} survived trim in an idle run"
                    )
            assert self.pa.n_quarantined == 0

    @rule(pages=st.none() | st.integers(0, PAGES))
    def set_limit(self, pages):
        self.cache.set_limit(None if pages is None else pages * self.cache.geometry.page_bytes)

    @rule(blocks=st.none() | st.integers(0, PAGES * 4))
    def resize(self, blocks):
        self.cache.resize(blocks)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        self.bm.check()
        u = self.cache.usage()
        assert u.blocks_used == len(self.live)
        for b in self.live:
            assert self.bm.is_live(b)
            p = self.bm.page_of(b)
            assert self.cache.mapper.is_mapped(p), f"live block {b} on unmapped page {p}"
            assert self.pa.state_of(p) == USED
        held = self.cache.mapper.held_bytes()
        assert self.budget.used == held, f"charged {self.budget.used} != held {held}"
        assert self.host.own_bytes() == held, (
            f"device holds {self.host.own_bytes()} != {held} (a leaked handle)"
        )
        c = self.pa.counts()
        assert sum(v for k, v in c.items() if k != "cap") == PAGES
        mapped = PAGES - c["unmapped"]
        if self.healthy and self.pa._idle_runs:
            assert mapped <= c["cap"], f"{mapped} pages mapped over cap {c['cap']}"
            assert c["idle"] <= self.pa.max_reserved, "idle pool over its maximum"
        check_pattern(self.cache, sorted(self.live))

    def teardown(self):
        if self.cache is None:
            return
        if self.faulty:
            self.driver.enabled = False
        check_pattern(self.cache, sorted(self.live))
        self.cache.close()
        assert self.host.own_bytes() == 0, "close leaked a handle"
        assert self.budget.used == 0, "close left a charge"
        self.host.close()


class FaultyBlockMachine(BlockMachine):
    faulty = True

    @rule(on=st.booleans())
    def faults(self, on):
        d = self.driver
        if on:
            d.enabled = True
            for call in ("create", "map", "set_access", "unmap", "release"):
                d.set_probability(call, self.fault_p)
        else:
            d.enabled = False

    @rule()
    def heal_and_trim(self):
        self.driver.enabled = False
        self.cache.trim()
        assert self.pa.n_quarantined == 0
        assert self.cache.mapper.quarantined_pages == 0


_settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# 120 examples of 40 steps each: seconds apiece, so CI runs them, not the developer loop.
TestBlockManagerModel = pytest.mark.slow(BlockMachine.TestCase)
TestBlockManagerModel.settings = _settings
TestBlockManagerFaults = pytest.mark.slow(FaultyBlockMachine.TestCase)
TestBlockManagerFaults.settings = _settings
