"""available_size() is O(1): it reads counters and the budget's cached
headroom, never walks pages or blocks, so its cost does not grow with the
cache (the scheduler calls it every step)."""

from __future__ import annotations

import timeit

from kvcached.driver.faulty import FaultyDriver
from tests.memory.kvmem_helpers import make_cache, small_spec


def _cost(kv) -> float:
    return min(timeit.repeat(kv.available_size, number=2000, repeat=15)) / 2000


def test_available_size_does_not_grow_with_the_cache(host):
    small, _ = make_cache(host, small_spec(), pages=4)
    big, _ = make_cache(host, small_spec(), pages=16384, budget_pages=16)
    assert big.alloc(3 + 4 * 8) is not None  # 9 pages held, the budget allows 7 more
    assert big.available_size() == 7 * 4 == big.usage().blocks_available
    assert small.available_size() == 3 + 3 * 4
    ratio = _cost(big) / _cost(small)
    assert ratio < 3, f"available_size costs {ratio:.1f}x more on a 4096x larger cache"
    small.close()
    big.close()


def test_available_size_calls_no_driver(host):
    faulty = FaultyDriver(host)
    kv, _ = make_cache(faulty, small_spec(), pages=8)
    kv.alloc(5)
    before = sum(faulty.calls.values())
    for _ in range(100):
        kv.available_size()
    assert sum(faulty.calls.values()) == before
    kv.close()
