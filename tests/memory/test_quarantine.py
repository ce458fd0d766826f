"""Charges across threads, driven step by step by events.

These tests hold a thread at a chosen point (an event it waits on) and let
the other act, so each interleaving runs the same way every time.

The random thread test's failure, as it happened: a reading of
``budget.used``, ``held_bytes()`` and ``own_bytes()`` taken while the pool
thread grows sees the grant before the handles exist. That is a reading in
flight, not a leak; :meth:`PageAllocator.paused` makes the reading quiet.
"""

from __future__ import annotations

import threading

from kvmem_helpers import make_cache, small_spec

from kvcached.driver.faulty import FaultyDriver
from kvcached.units import MIB

WAIT_S = 30.0  # only a broken run waits this long


class HoldingDriver(FaultyDriver):
    """A :class:`FaultyDriver` that holds the thread named ``hold_thread`` in
    its next ``create`` (before the handle exists) until ``go`` is set."""

    def __init__(self, inner, **kw) -> None:
        super().__init__(inner, **kw)
        self.hold_thread: str | None = None
        self.held = threading.Event()
        self.go = threading.Event()

    def create(self, size):
        if threading.current_thread().name == self.hold_thread:
            self.hold_thread = None
            self.held.set()
            assert self.go.wait(WAIT_S), "the test never let the create go on"
        return super().create(size)


def _adds_up(cache, budget, host) -> None:
    pa = cache.pages
    assert pa.counts() == pa.recount()
    assert pa.n_quarantined == cache.mapper.quarantined_pages
    assert budget.used == cache.mapper.held_bytes() == host.own_bytes()


def test_the_random_thread_tests_failure_is_a_reading_taken_mid_growth(host):
    """``test_pool_thread_engine_threads_and_control_under_contention`` saw
    ``budget.used`` 16 MiB above ``held_bytes()`` (125,829,120 != 109,051,904)
    once in 20 runs: two pages of 8 MiB. Its quiesce waited for no busy page
    and then read, but the pool thread may start a refill after that wait: a
    refill picks its pages, is granted for all of them, and only then creates
    the handles that ``held_bytes()`` counts. Here the pool thread is held in
    the first create of its refill of two pages (one extent of four handles):
    the same 16 MiB show, and nothing is lost. ``paused()`` waits for the
    round in flight and starts none, so a reading inside it adds up."""
    faulty = HoldingDriver(host)
    faulty.hold_thread = "kvcached-pages"
    cache, budget = make_cache(
        faulty,
        small_spec(2, 2),
        pages=8,
        background=True,
        min_reserved=2,
        max_reserved=4,
        max_handle_bytes=64 * MIB,
    )
    page = cache.geometry.page_bytes
    assert page == 8 * MIB
    # The null block's page 0 left the pool short: its thread refills pages 1-2.
    try:
        assert faulty.held.wait(WAIT_S), "the pool thread never started its refill"
        held, used, own = cache.mapper.held_bytes(), budget.used, host.own_bytes()
        assert used - held == 2 * page == 16 * MIB
        assert held == own == page
    finally:
        faulty.go.set()  # paused() below waits for this round, then holds off the next
    with cache.pages.paused():
        assert cache.pages.n_idle == 2 and cache.pages.n_busy == 0
        _adds_up(cache, budget, host)
        assert budget.used == 3 * page
    cache.close()
    assert budget.used == 0 == host.own_bytes()
