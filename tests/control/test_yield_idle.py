"""Idle memory handed to a neighbour that misses (``KVCACHED_YIELD_IDLE``).

Two instances on one host device share its real ledger; ``busy`` fills the
budget with blocks in use, ``idle`` holds a prefix cache no request references.
Each pass below is what an instance's control thread runs every tick
(:meth:`Instance.enforce`, then :meth:`Instance.yield_idle`).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from kvcached.control.instance import Instance, KVCachePool
from kvcached.control.snapshot import read_snapshots
from kvcached.control.view import instance_rows
from kvcached.driver.host import HostDriver
from kvcached.ledger import Ledger
from kvcached.ledger.layout import H_BUDGET
from kvcached.memory.cache import KVCache
from kvcached.units import MIB
from tests.control.host_pool import SPEC
from tests.control.kvctl_helpers import Child, unique_index, wait_until


@dataclass
class Side:
    cache: KVCache
    budget: object
    instance: Instance
    source: KVCachePool
    cached: list[int]  # blocks of a prefix cache nobody references
    held: list[int]
    ledger: Ledger

    def alloc(self, n: int) -> bool:
        ids = self.cache.alloc(n)
        if ids is None:
            self.source.misses += 1  # what an engine does with a refused allocation
            return False
        self.held.extend(ids)
        return True

    def pass_(self) -> int:
        self.instance.enforce()
        return self.instance.yield_idle()


def _side(
    stack: ExitStack, ledger: Ledger, driver, name: str, yield_idle: bool, capacity=96 * MIB
) -> Side:
    budget = ledger.register_pool(name)
    stack.callback(budget.close)
    cache = KVCache(
        SPEC,
        driver=driver,
        budget=budget,
        capacity_bytes=capacity,
        min_reserved=0,
        max_reserved=0,
        max_handle_bytes=0,
        background=False,
    )
    stack.callback(cache.close)
    cached: list[int] = []
    bpp, page = cache.blocks_per_page, cache.geometry.page_bytes

    def evict(nbytes: int) -> int:
        n = min(len(cached), -(-nbytes // page) * bpp)
        cache.free([cached.pop() for _ in range(n)])
        return n * page // bpp

    instance = Instance(name, engine="test", start=False, yield_idle=yield_idle)
    stack.callback(instance.close)
    source = KVCachePool(
        cache, evict_cached=evict, prefix_cache_bytes=lambda: len(cached) * page // bpp
    )
    instance.add_pool(source, budget)
    return Side(cache, budget, instance, source, cached, [], ledger)


@contextmanager
def two_sides(tmp_path, *, busy_yields=True, idle_yields=True, index=41):
    """``idle`` with four pages of prefix cache and one in use, ``busy`` with the
    rest of a budget of eight pages in use: the device has no room left."""
    with ExitStack() as stack:
        driver = HostDriver(index=index, capacity=512 * MIB)
        ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=str(tmp_path))
        stack.callback(ledger.close)
        idle = _side(stack, ledger, driver, "idle", idle_yields)
        busy = _side(stack, ledger, driver, "busy", busy_yields)
        page = idle.cache.geometry.page_bytes
        bpp = idle.cache.blocks_per_page
        with ledger.locked():  # a budget of eight pages (the host device has far more)
            ledger.i64[H_BUDGET] = 8 * page
        idle.cached.extend(idle.cache.alloc(4 * bpp - 1))  # with the null block: four pages
        idle.held.extend(idle.cache.alloc(bpp))  # and one page of blocks a request holds
        while (ids := busy.cache.alloc(1)) is not None:  # the rest of the budget, in use
            busy.held.extend(ids)
        yield idle, busy, page, bpp


def test_a_miss_calls_and_the_idle_neighbour_releases_its_prefix_cache(tmp_path):
    with two_sides(tmp_path) as (idle, busy, page, bpp):
        assert busy.budget.device_room() < page
        assert not busy.alloc(2 * bpp)  # the device's budget is spent: a miss
        assert busy.pass_() == 0  # busy posts its call (nothing of its own is idle)
        (want,) = idle.budget.neighbour_wants()
        assert want.nbytes >= page  # one growth unit at least: a page here
        assert not idle.cache.pages.reserve_held
        released = idle.pass_()
        assert released >= 2 * page - busy.budget.device_room()  # what the call lacked
        assert idle.cache.pages.reserve_held  # and it maps no reserve for a while
        assert not busy.cache.pages.reserve_held
        assert idle.instance.snapshot()["yielded_bytes"] == released
        idle.instance.publish()  # kvctl list and metrics show it per instance and GPU
        (row,) = [r for r in instance_rows(read_snapshots()) if r.name == "idle"]
        assert (row.gpu, row.yielded_bytes) == (idle.source.gpu, released)
        assert busy.alloc(2 * bpp)  # the next try finds the memory
        assert idle.pass_() == 0  # the same call is answered once


def test_blocks_in_use_never_move(tmp_path):
    with two_sides(tmp_path) as (idle, busy, page, bpp):
        for _ in range(10):  # busy keeps missing for more than idle holds idle
            busy.alloc(6 * bpp)
            busy.pass_()
            idle.pass_()
        assert idle.cached == []
        assert all(idle.cache.blocks.is_live(b) for b in idle.held)
        assert idle.cache.usage().blocks_used == bpp
        assert idle.instance.yielding.yielded_bytes == 3 * page  # page 0 keeps the null block


def test_an_instance_short_itself_keeps_its_idle_memory(tmp_path):
    with two_sides(tmp_path) as (idle, busy, page, bpp):
        assert not busy.alloc(2 * bpp)
        busy.pass_()
        assert not idle.alloc(64 * bpp)  # idle misses in the same pass
        assert idle.pass_() == 0
        assert len(idle.cached) == 4 * bpp - 1


def test_off_by_default_no_call_and_no_yield(tmp_path):
    with two_sides(tmp_path, busy_yields=False, idle_yields=False) as (idle, busy, page, bpp):
        assert not busy.alloc(2 * bpp)
        assert busy.pass_() == 0 and idle.pass_() == 0
        assert idle.budget.neighbour_wants() == []
        assert len(idle.cached) == 4 * bpp - 1


def test_a_call_the_device_room_covers_or_a_limit_stops_is_not_posted(tmp_path):
    with two_sides(tmp_path) as (idle, busy, page, bpp):
        ledger = busy.ledger
        with ledger.locked():
            ledger.i64[H_BUDGET] += page
        assert not busy.budget.post_want(page)  # the device's room covers it
        with ledger.locked():
            ledger.i64[H_BUDGET] -= page
        ledger.set_limit("busy", busy.budget.instance_charged(), 1)
        assert not busy.budget.post_want(page)  # its own limit binds: neighbours cannot help
        ledger.set_limit("busy", None, 2)
        assert busy.budget.post_want(page)
        assert [w.nbytes for w in idle.budget.neighbour_wants()] == [page]
        assert busy.budget.neighbour_wants() == []  # an instance never answers its own call
        with pytest.raises(ValueError, match="nbytes=0"):
            busy.budget.post_want(0)


def test_a_new_pool_in_a_slot_starts_with_no_call(tmp_path):
    driver = HostDriver(index=42, capacity=512 * MIB)
    ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=str(tmp_path))
    try:
        other = ledger.register_pool("other")
        first = ledger.register_pool("first")
        first.post_want(1 << 40)
        assert other.neighbour_wants()[0].seq == 1
        slot = first.slot
        first.close()
        again = ledger.register_pool("again")
        assert again.slot == slot
        assert other.neighbour_wants() == []
        again.close()
        other.close()
    finally:
        ledger.close()


def test_across_processes_the_neighbours_control_thread_answers_a_call(tmp_path, monkeypatch):
    """Real processes: a child instance (``KVCACHED_YIELD_IDLE=true``, its control
    thread running) holds idle reserved pages; this process fills the device,
    misses and calls; the child releases its idle pages and the next try here
    gets them."""
    monkeypatch.setenv("KVCACHED_YIELD_IDLE", "true")
    index = unique_index()
    capacity = 128 * MIB
    child = Child(str(tmp_path), index, name="neighbour", capacity=capacity)
    with ExitStack() as stack:
        stack.callback(child.close)
        bpp = child.blocks_per_page
        assert child.cmd(f"alloc {4 * bpp}")["ok"]
        assert child.cmd(f"free {4 * bpp}")["ok"]  # four pages now idle: its reserve
        idle_before = child.cmd("usage")["pages_reserved"]
        assert idle_before >= 2
        driver = HostDriver(index=index, capacity=capacity)
        ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=str(tmp_path))
        stack.callback(ledger.close)
        me = _side(stack, ledger, driver, "caller", True, capacity=capacity)
        while me.alloc(bpp):  # fill the device's budget
            pass
        assert me.pass_() == 0  # the miss is called
        assert wait_until(lambda: me.alloc(bpp), timeout=5)
        assert child.cmd("usage")["pages_reserved"] < idle_before
