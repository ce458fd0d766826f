"""Where the time of physical growth goes: the allocator's own Python work per
page against the driver's, so a GPU ``grow_ratio`` can be explained.

Two instruments, both benchmark-only (never used by kvcached itself):

* :class:`NullDriver`: a backend whose calls do nothing. Growing through the
  page allocator on it, minus a raw loop of the same calls on it, is the
  allocator's Python cost per page on this host's CPU, free of any device.
* :class:`TimedDriver`: wraps a real backend and sums the time spent inside
  each call. One extra round of the raw loop and of the allocator through it
  splits a page's time into ``create`` / ``map`` / ``set_access`` / the rest
  (the caller's Python, plus the timer's own cost, reported as ``timer_ns``).

Growth is the same as ``benchmarks/memory.py``'s ``grow_ratio``: 2 MiB pages,
one handle per page (coalescing off), one ``take`` per page by default
(``--pages-per-take`` batches them), with the real driver-free-memory budget.

Run from the repository root::

    python benchmarks/grow_overhead.py                   # null driver: Python cost only
    python benchmarks/grow_overhead.py --backend cuda    # + the split on a GPU

``benchmarks/memory.py`` calls :func:`grow_report` and stores its figures
beside ``grow_ratio``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import _provenance
from kvcached.driver.base import DeviceInfo, Driver
from kvcached.memory import (
    DriverFreeBudget,
    KVCacheSpec,
    KVLayout,
    PageAllocator,
    PageMapper,
    VirtualKVTensors,
    plan_pages,
)
from kvcached.units import MIB

GROW_CALLS = ("create", "map", "set_access")


class NullDriver(Driver):
    """A device whose every call does nothing (2 MiB granularity, 1 TiB free).
    Addresses are handed out by a bump counter; handles are ints. Only for
    timing the layers above a driver."""

    backend = "null"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._next_va = 1 << 40
        self._next_handle = 0

    @property
    def granularity(self) -> int:
        return 2 * MIB

    def info(self) -> DeviceInfo:
        return DeviceInfo(
            backend="null",
            index=self.index,
            name="null driver",
            pci_bus_id="null",
            total_bytes=1 << 40,
            granularity=2 * MIB,
        )

    def mem_info(self) -> tuple[int, int]:
        return 1 << 40, 1 << 40

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def reserve(self, size: int) -> int:
        va = self._next_va
        self._next_va += size + 2 * MIB
        return va

    def free_reservation(self, va: int, size: int) -> None:
        pass

    def create(self, size: int) -> int:
        self._next_handle += 1
        return self._next_handle

    def release(self, handle: Any) -> None:
        pass

    def map(self, va: int, size: int, handle: Any) -> None:
        pass

    def set_access(self, va: int, size: int) -> None:
        pass

    def unmap(self, va: int, size: int) -> None:
        pass

    def unmap_range(self, va: int, size: int, count: int) -> None:
        pass

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError("the null driver has no memory to view")


class TimedDriver(Driver):
    """Wraps ``inner`` and sums the nanoseconds spent inside each call, read
    from ``clock_ns`` (the clock that times the whole round)."""

    def __init__(self, inner: Driver, clock_ns=time.perf_counter_ns) -> None:
        super().__init__(inner.index)
        self.inner = inner
        self._clock = clock_ns
        self.backend = inner.backend  # type: ignore[misc]
        self.ns: dict[str, int] = dict.fromkeys(GROW_CALLS, 0)
        self.calls: dict[str, int] = dict.fromkeys(GROW_CALLS, 0)

    def reset(self) -> None:
        for k in GROW_CALLS:
            self.ns[k] = self.calls[k] = 0

    @property
    def granularity(self) -> int:
        return self.inner.granularity

    def info(self) -> DeviceInfo:
        return self.inner.info()

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()

    @property
    def torch_device(self) -> torch.device:
        return self.inner.torch_device

    def reserve(self, size: int) -> int:
        return self.inner.reserve(size)

    def free_reservation(self, va: int, size: int) -> None:
        self.inner.free_reservation(va, size)

    def create(self, size: int) -> Any:
        t0 = self._clock()
        h = self.inner.create(size)
        self.ns["create"] += self._clock() - t0
        self.calls["create"] += 1
        return h

    def map(self, va: int, size: int, handle: Any) -> None:
        t0 = self._clock()
        self.inner.map(va, size, handle)
        self.ns["map"] += self._clock() - t0
        self.calls["map"] += 1

    def set_access(self, va: int, size: int) -> None:
        t0 = self._clock()
        self.inner.set_access(va, size)
        self.ns["set_access"] += self._clock() - t0
        self.calls["set_access"] += 1

    def release(self, handle: Any) -> None:
        self.inner.release(handle)

    def unmap(self, va: int, size: int) -> None:
        self.inner.unmap(va, size)

    def unmap_range(self, va: int, size: int, count: int) -> None:
        self.inner.unmap_range(va, size, count)

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return self.inner.tensor(va, nbytes)

    def synchronize(self) -> None:
        self.inner.synchronize()


# -- the two growth loops (memory.py times the same ones) -----------------------------------


def raw_growth(driver: Driver, total: int, clock=time.perf_counter) -> float:
    """Seconds for a raw loop of 2 MiB create + map + set_access over ``total``
    bytes (teardown not timed)."""
    g = driver.granularity
    va = driver.reserve(total)
    # Untimed, as the allocator's budget does at its setup: a fresh sample of
    # the device (the host backend otherwise rescans /proc inside a create,
    # a few ms, at most every 50 ms: it would land in this loop only).
    driver.mem_info()
    handles = []
    t0 = clock()
    for off in range(0, total, g):
        h = driver.create(g)
        driver.map(va + off, g, h)
        driver.set_access(va + off, g)
        handles.append(h)
    dt = clock() - t0
    for off, h in zip(range(0, total, g), handles, strict=True):
        driver.unmap(va + off, g)
        driver.release(h)
    driver.free_reservation(va, total)
    return dt


def raw_shrink(driver: Driver, total: int, clock=time.perf_counter) -> float:
    """Seconds for a raw loop of 2 MiB unmap + release over ``total`` bytes
    grown (untimed) by the raw growth loop: the baseline of shrinking."""
    g = driver.granularity
    va = driver.reserve(total)
    driver.mem_info()
    handles = []
    for off in range(0, total, g):
        h = driver.create(g)
        driver.map(va + off, g, h)
        driver.set_access(va + off, g)
        handles.append(h)
    unmap, release = driver.unmap, driver.release
    t0 = clock()
    for off, h in zip(range(0, total, g), handles, strict=True):
        unmap(va + off, g)
        release(h)
    dt = clock() - t0
    driver.free_reservation(va, total)
    return dt


def allocator_shrink(
    driver: Driver, total: int, per_give_back: int, clock=time.perf_counter
) -> float:
    """Seconds to release ``total`` bytes of 2 MiB one-handle pages through
    :class:`PageAllocator` (no pool, coalescing off), ``per_give_back`` pages
    given back at a time, each released at once (unmap, release, refund, and
    the one device synchronize before a batch of unmaps). Growth is untimed."""
    spec = KVCacheSpec.of_bytes(num_layers=1, block_bytes=64 * 1024)
    geometry = plan_pages(
        spec,
        layout=KVLayout.PER_LAYER,
        granularity=driver.granularity,
        page_size=driver.granularity,
        capacity_bytes=total,
    )
    tensors = VirtualKVTensors(driver, spec, geometry)
    budget = DriverFreeBudget(driver, sample_interval_s=60)
    mapper = PageMapper(tensors, budget, max_handle_bytes=0)
    pages = PageAllocator(mapper, background=False)
    taken: list[int] = []
    while len(taken) < geometry.num_pages:
        got = pages.take(min(32, geometry.num_pages - len(taken)))
        assert got is not None, "growth was refused: not enough free device memory"
        taken.extend(got)
    chunks = [taken[i : i + per_give_back] for i in range(0, len(taken), per_give_back)]
    give_back = pages.give_back
    t0 = clock()
    for chunk in chunks:
        give_back(chunk)
    dt = clock() - t0
    assert mapper.mapped_pages == 0, "a give-back left pages mapped"
    pages.close()
    tensors.close()
    budget.close()
    return dt


class _NoLock:
    """Stands in for the allocator's grow lock to measure what the lock
    buys (benchmark only: the allocator always has its lock)."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


def raw_growth_threads(driver: Driver, total: int, threads: int = 2) -> float:
    """Wall seconds for ``threads`` raw loops growing ``total`` bytes together,
    each its own interleaved share of one reservation: the baseline for
    growth that a second thread (the page pool's) helps with."""
    g = driver.granularity
    va = driver.reserve(total)
    driver.mem_info()
    shares = [list(range(k * g, total, threads * g)) for k in range(threads)]
    made: list[list] = [[] for _ in range(threads)]
    ready = threading.Barrier(threads + 1)

    def grow(k: int) -> None:
        driver.mem_info()  # binds the driver's context to this thread, untimed
        create, map_, set_access, out = driver.create, driver.map, driver.set_access, made[k]
        ready.wait()
        for off in shares[k]:
            h = create(g)
            map_(va + off, g, h)
            set_access(va + off, g)
            out.append((off, h))

    workers = [threading.Thread(target=grow, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    ready.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    dt = time.perf_counter() - t0
    for out in made:
        for off, h in out:
            driver.unmap(va + off, g)
            driver.release(h)
    driver.free_reservation(va, total)
    return dt


# A model-shaped cache: Llama-3-8B's KV (32 layers, K and V, 8 KV heads of 128,
# bf16, 16-token blocks). On the default per-layer layout a 2 MiB page is 2 MiB
# in each of its 64 buffers: one page id, 64 handles.
LLAMA3_8B = KVCacheSpec(
    num_layers=32, block_size=16, num_heads=8, head_dim=128, dtype=torch.bfloat16
)


def raw_growth_like_cache(
    driver: Driver, spec: KVCacheSpec, total: int, clock=time.perf_counter
) -> float:
    """Seconds for a raw loop of 2 MiB create + map + set_access at the very
    addresses a per-layer cache of ``spec`` maps, page by page (every buffer
    of every layer, then the next page), page 0 first and untimed: the
    driver's cost of that address pattern with nothing around the calls."""
    g = driver.granularity
    page = page_bytes_of(spec, driver)
    geometry = plan_pages(
        spec, layout=KVLayout.PER_LAYER, granularity=g, page_size=g, capacity_bytes=total + page
    )
    tensors = VirtualKVTensors(driver, spec, geometry)
    strides = tensors.handle_strides()
    assert all(span == g for _, span in strides), "one 2 MiB handle per buffer per page"
    made = []
    create, map_, set_access = driver.create, driver.map, driver.set_access
    for base, _ in strides:  # page 0, as the cache's null block has it
        h = create(g)
        map_(base, g, h)
        set_access(base, g)
        made.append((base, h))
    t0 = clock()
    for k in range(1, geometry.num_pages):
        for base, _ in strides:
            va = base + k * g
            h = create(g)
            map_(va, g, h)
            set_access(va, g)
            made.append((va, h))
    dt = clock() - t0
    for va, h in made:
        driver.unmap(va, g)
        driver.release(h)
    tensors.close()
    return dt


def page_bytes_of(spec: KVCacheSpec, driver: Driver) -> int:
    """Physical bytes of one page of ``spec`` (per-layer, 2 MiB per buffer)."""
    return plan_pages(
        spec,
        layout=KVLayout.PER_LAYER,
        granularity=driver.granularity,
        page_size=driver.granularity,
        num_blocks=1,
    ).page_bytes


def allocator_growth(
    driver: Driver,
    total: int,
    grow: int,
    coalesce: bool,
    clock=time.perf_counter,
    reserved: tuple[int, int] | None = None,
    spec: KVCacheSpec | None = None,
    null_page: bool = False,
    layout: KVLayout = KVLayout.PER_LAYER,
    grow_lock: bool = True,
) -> float:
    """Seconds to grow ``total`` bytes through :class:`PageAllocator`, ``grow``
    bytes per ``take`` (2 MiB pages), with the real driver-free-memory budget.

    ``reserved=(min, max)`` turns the reserved pool on, refilled by its own
    thread as in an engine (``None``: no pool, every take maps its own pages).
    The pool starts empty and the cache holds exactly ``total`` bytes, so
    both ways map the same bytes; the clock stops when the last take returns.

    ``spec``: the cache's shape (default: one layer, one buffer, so a page is
    one 2 MiB handle); ``grow`` is then in pages of that shape's bytes.
    ``layout``: per-layer (one handle per buffer of each layer per page) or
    contiguous (one handle per page). ``null_page``: page 0 is mapped before the clock starts and ``total``
    bytes grow after it, as in a :class:`~kvcached.memory.KVCache`, whose page
    0 holds the null block for its whole life. ``grow_lock=False`` replaces
    the allocator's grow lock with a no-op, so a take and the pool's refill
    call the driver at once (what the lock is measured against)."""
    spec = spec or KVCacheSpec.of_bytes(num_layers=1, block_bytes=64 * 1024)
    extra = 0
    if null_page:
        extra = page_bytes_of(spec, driver)
    geometry = plan_pages(
        spec,
        layout=layout,
        granularity=driver.granularity,
        page_size=driver.granularity,
        capacity_bytes=total + extra,
    )
    assert geometry.page_bytes * geometry.num_pages == total + extra, "total must be whole pages"
    tensors = VirtualKVTensors(driver, spec, geometry)
    budget = DriverFreeBudget(driver, sample_interval_s=60)
    mapper = PageMapper(tensors, budget, max_handle_bytes=64 * MIB if coalesce else 0)
    if reserved is None:
        pages = PageAllocator(mapper, background=False)
    else:
        pages = PageAllocator(
            mapper, min_reserved=reserved[0], max_reserved=reserved[1], background=True
        )
    if not grow_lock:
        pages._grow_lock = _NoLock()  # type: ignore[assignment]
    per_take = grow // geometry.page_bytes
    taken: list[int] = pages.take(1) if null_page else []
    t0 = clock()
    for _ in range(total // grow):
        got = pages.take(per_take)
        while got is None and pages.n_busy:  # the last pages are in the pool's hands
            time.sleep(0)
            got = pages.take(per_take)
        assert got is not None, "growth was refused: not enough free device memory"
        taken.extend(got)
    dt = clock() - t0
    pages.give_back(taken)
    pages.close()
    tensors.close()
    budget.close()
    return dt


# -- reports ------------------------------------------------------------------------------------


def _timer_ns(clock_ns=time.perf_counter_ns) -> float:
    """What one pair of clock reads and a dict update cost (TimedDriver's own)."""
    acc = {"x": 0}
    n = 20000
    t0 = clock_ns()
    for _ in range(n):
        t = clock_ns()
        acc["x"] += clock_ns() - t
    return (clock_ns() - t0) / n


def python_overhead(pages: int = 512, rounds: int = 9, pages_per_take: int = 1) -> dict:
    """The allocator's Python cost per page on this CPU: growth through the
    allocator on :class:`NullDriver` minus the raw loop on it (best rounds)."""
    driver = NullDriver()
    g = driver.granularity
    total = pages * g
    raw, alloc = [], []
    clock = time.thread_time  # all CPU work: time descheduled is not the allocator's
    for _ in range(rounds):
        raw.append(raw_growth(driver, total, clock))
        alloc.append(
            allocator_growth(driver, total, pages_per_take * g, coalesce=False, clock=clock)
        )
    raw_us = min(raw) / pages * 1e6
    alloc_us = min(alloc) / pages * 1e6
    return {
        "pages": pages,
        "pages_per_take": pages_per_take,
        "clock": "thread CPU time",
        "raw_null_us_per_page": round(raw_us, 3),
        "allocator_null_us_per_page": round(alloc_us, 3),
        "allocator_python_us_per_page": round(alloc_us - raw_us, 3),
        "median_allocator_python_us_per_page": round(
            (statistics.median(alloc) - statistics.median(raw)) / pages * 1e6, 3
        ),
    }


def split(driver: Driver, total: int, rounds: int = 3, clock=time.perf_counter) -> dict:
    """Per-page microseconds inside each driver call and outside them, for the
    raw loop and the allocator (one take per page), through :class:`TimedDriver`
    (best round of each by total; ``clock``, wall or thread CPU time, times
    the rounds and the calls alike)."""
    clock_ns = time.thread_time_ns if clock is time.thread_time else time.perf_counter_ns
    timed = TimedDriver(driver, clock_ns)
    pages = total // driver.granularity
    out: dict[str, Any] = {}
    for name, grow in (
        ("raw", lambda: raw_growth(timed, total, clock)),
        (
            "allocator",
            lambda: allocator_growth(timed, total, driver.granularity, coalesce=False, clock=clock),
        ),
    ):
        best = None
        for _ in range(rounds):
            timed.reset()
            seconds = grow()
            calls = {k: timed.ns[k] / 1e3 / pages for k in GROW_CALLS}
            row = {
                **{k: round(v, 3) for k, v in calls.items()},
                "outside_calls": round(seconds * 1e6 / pages - sum(calls.values()), 3),
                "total": round(seconds * 1e6 / pages, 3),
                "calls_per_page": {k: timed.calls[k] / pages for k in GROW_CALLS},
            }
            if best is None or row["total"] < best["total"]:
                best = row
        out[name] = best
    out["timer_ns"] = round(_timer_ns(clock_ns), 1)
    out["clock"] = "thread CPU time" if clock_ns is time.thread_time_ns else "wall"
    return out


def grow_report(driver: Driver, total: int, rounds: int, clock=time.perf_counter) -> dict:
    """What memory.py stores beside ``grow_ratio``."""
    return {
        "grow_python_overhead": python_overhead(rounds=rounds),
        "grow_split_us_per_page": split(driver, total, rounds=min(rounds, 3), clock=clock),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("null", "host", "cuda", "hip"), default="null")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--pages-per-take", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    prov = _provenance.start()
    result: dict[str, Any] = {
        "benchmark": "grow_overhead",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": sys.version.split()[0],
        "null": python_overhead(args.pages, args.rounds, args.pages_per_take),
    }
    if args.backend != "null":
        from kvcached.config import get_config
        from kvcached.driver import make_driver

        driver = make_driver(args.backend, args.device, config=get_config())
        result["device"] = driver.info().as_dict()
        result["split_us_per_page"] = split(
            driver, args.pages * driver.granularity, rounds=min(args.rounds, 3)
        )
        driver.close()
    if args.out:
        _provenance.write_result(args.out, result, prov)
    else:
        result["provenance"] = _provenance.finish(prov)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
