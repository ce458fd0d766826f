"""The memory layer's hot path in Python alone: CPU nanoseconds per cycle on a
driver whose calls do nothing (``grow_overhead.NullDriver``), so the page pool's,
the mapper's and the block manager's own work is the whole cost.

Cycles (thread CPU time per cycle; per case the minimum and the median of
``--rounds`` rounds):

* ``grow1_1h``: ``take(1)`` that maps a new page, then ``give_back`` that
  releases it (one handle a page, no reserved pool);
* ``grow1_4h``: the same with four handles a page (two layers, K and V);
* ``batch8_1h``: ``take(8)`` of eight one-handle pages and their release;
* ``batch8_ext``: the same with coalescing on (one eight-page extent);
* ``allocN_free``: ``alloc(N)`` + ``free`` of N blocks (1, 4, 64) on a cache
  whose pages are mapped (one thread, no lock), as a decode step or a short
  prefill does.

It is how the hand-written hot-path copies were judged when they were folded
back (``benchmarks/results/hot-path-fold-host/``): run this file from two trees,
interleaved, on one machine::

    python benchmarks/hot_path.py --out benchmarks/results/hot-path.json

Real drivers cost far more per page (40-50 us of calls per 2 MiB page on an
H200, about 430 us on the host backend's memfd), so these figures bound what
Python adds; ``benchmarks/memory.py`` measures growth against the driver.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import _provenance
from free_budget import FreeBudget
from grow_overhead import NullDriver
from kvcached.memory import (
    KVCache,
    KVCacheSpec,
    KVLayout,
    PageAllocator,
    PageMapper,
    VirtualKVTensors,
    plan_pages,
)
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent


def page_pool(layers: int, coalesce: bool, pages: int = 64) -> PageAllocator:
    """A page pool on the null driver: 2 MiB per handle, one handle a page for
    one layer, four for two (K and V), no reserved pool, no thread."""
    driver = NullDriver()
    spec = KVCacheSpec.of_bytes(
        num_layers=layers, block_bytes=64 * 1024, kv_buffers=1 if layers == 1 else 2
    )
    g = plan_pages(
        spec,
        layout=KVLayout.PER_LAYER,
        granularity=driver.granularity,
        page_size=driver.granularity,
        num_blocks=pages * 32,
    )
    mapper = PageMapper(
        VirtualKVTensors(driver, spec, g),
        FreeBudget(),
        max_handle_bytes=64 * MIB if coalesce else 0,
    )
    return PageAllocator(mapper, min_reserved=0, max_reserved=0, background=False)


def grow_cycle(pool: PageAllocator, n: int, reps: int) -> float:
    """CPU ns per take of ``n`` new pages and their release."""
    take, give_back = pool.take, pool.give_back
    t0 = time.thread_time_ns()
    for _ in range(reps):
        give_back(take(n))
    return (time.thread_time_ns() - t0) / reps


def alloc_free_cycle(n: int, reps: int) -> float:
    """CPU ns per ``alloc(n)`` + ``free`` on mapped pages (4 KiB blocks, 512
    a page; 700 blocks held, so allocations come from a partly used page)."""
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=1, head_dim=128, dtype=torch.float16)
    kv = KVCache(
        spec,
        driver=NullDriver(),
        budget=FreeBudget(),
        num_blocks=16384,
        background=False,
        min_reserved=0,
        max_reserved=1 << 20,
        thread_safe=False,
    )
    held = kv.alloc(700)
    alloc, free = kv.alloc, kv.free
    t0 = time.thread_time_ns()
    for _ in range(reps):
        free(alloc(n))
    spent = (time.thread_time_ns() - t0) / reps
    kv.free(held)
    kv.close()
    return spent


CASES = {
    "grow1_1h": lambda: grow_cycle(page_pool(1, False), 1, 2000),
    "grow1_4h": lambda: grow_cycle(page_pool(2, False), 1, 1000),
    "batch8_1h": lambda: grow_cycle(page_pool(1, False), 8, 500),
    "batch8_ext": lambda: grow_cycle(page_pool(1, True), 8, 1000),
    "alloc1_free": lambda: alloc_free_cycle(1, 20000),
    "alloc4_free": lambda: alloc_free_cycle(4, 20000),
    "alloc64_free": lambda: alloc_free_cycle(64, 5000),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    prov = _provenance.start(argv)
    logging.getLogger("kvcached").setLevel(logging.ERROR)
    result: dict = {"benchmark": "hot_path", "clock": "thread CPU time", "rounds": args.rounds}
    for name, case in CASES.items():
        ns = [case() for _ in range(args.rounds)]
        result[name] = {"min_ns": round(min(ns), 1), "median_ns": round(statistics.median(ns), 1)}
    if args.out is not None:
        _provenance.write_result(args.out, result, prov)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
