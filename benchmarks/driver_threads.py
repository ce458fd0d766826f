"""Does the driver grow memory faster from more than one thread?

Physical growth (``create -> map -> set_access`` of 2 MiB handles) timed as
bytes per second over ``--mib`` MiB, through kvcached's driver object, in
four shapes that all make the same calls:

* ``serial``: one thread, one page after another (the baseline);
* ``threads_2`` / ``threads_4``: the pages split between 2 or 4 threads, each
  growing its own slice of one reservation;
* ``pipeline``: one thread creates handles, a second maps and enables them;
* ``lanes_64``: one thread, the pages spread page-major over 64 reservations
  (a per-layer cache of 32 layers' K and V growing a page at a time);
* ``runs_32``: one thread, 32 handles created and mapped, then one
  ``set_access`` over the 32 (what kvcached does for a take of 32 pages).

The grow lock (``kvcached/memory/pages.py``, one thread grows at a time per
device) is kept only while ``ratio_over_serial_median["threads_2"]`` stays
below 1 (two threads at once slower than one) and ``benchmarks/memory.py``'s
``grow_lock`` says the same of the allocator.

A ratio above 1 means the driver (and the binding's release of the GIL
during a call) lets calls overlap, so a page pool refilled on a thread of
its own can add growth beside the engine's thread instead of only moving it.
Shapes run in rounds, in a rotated order each round; teardown is untimed.

    python benchmarks/driver_threads.py --backend cuda --out benchmarks/results/driver-threads-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import _provenance
from grow_overhead import raw_growth, raw_growth_threads
from kvcached.driver import make_driver
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent


def _grow(driver, vas: list[int], g: int, out: list) -> None:
    create, map_, set_access = driver.create, driver.map, driver.set_access
    for va in vas:
        h = create(g)
        map_(va, g, h)
        set_access(va, g)
        out.append((va, h))


def _teardown(driver, done: list, g: int) -> None:
    for va, h in done:
        driver.unmap(va, g)
        driver.release(h)


def serial(driver, total: int) -> float:
    return raw_growth(driver, total, time.perf_counter)


def threaded(n: int):
    return lambda driver, total: raw_growth_threads(driver, total, n)


def pipeline(driver, total: int) -> float:
    g = driver.granularity
    pages = total // g
    va = driver.reserve(total)
    handles: queue.SimpleQueue = queue.SimpleQueue()
    done: list = []
    start = threading.Barrier(2)

    def creator() -> None:
        driver.mem_info()  # binds a context to this thread, untimed
        start.wait()
        create = driver.create
        for _ in range(pages):
            handles.put(create(g))

    t = threading.Thread(target=creator)
    t.start()
    start.wait()
    t0 = time.perf_counter()
    map_, set_access, get = driver.map, driver.set_access, handles.get
    for i in range(pages):
        h = get()
        v = va + i * g
        map_(v, g, h)
        set_access(v, g)
        done.append((v, h))
    dt = time.perf_counter() - t0
    t.join()
    _teardown(driver, done, g)
    driver.free_reservation(va, total)
    return dt


def lanes(n: int):
    """One thread, the pages spread over ``n`` separate reservations, page-major
    (page k of every lane, then page k+1): the address pattern of a per-layer
    cache of ``n`` buffers growing one page at a time."""

    def run(driver, total: int) -> float:
        g = driver.granularity
        pages = total // g
        per_lane = -(-pages // n)
        bases = [driver.reserve(per_lane * g) for _ in range(n)]
        vas = [bases[i % n] + (i // n) * g for i in range(pages)]
        done: list = []
        t0 = time.perf_counter()
        _grow(driver, vas, g, done)
        dt = time.perf_counter() - t0
        _teardown(driver, done, g)
        for b in bases:
            driver.free_reservation(b, per_lane * g)
        return dt

    return run


def runs(k: int):
    """One thread, one ``set_access`` per run of ``k`` adjacent handles,
    each created and mapped first: the calls kvcached makes for a take or
    a refill of ``k`` one-handle pages."""

    def run(driver, total: int) -> float:
        g = driver.granularity
        pages = total // g
        va = driver.reserve(total)
        driver.mem_info()
        create, map_, set_access = driver.create, driver.map, driver.set_access
        done: list = []
        t0 = time.perf_counter()
        for start in range(0, pages, k):
            n = min(k, pages - start)
            for i in range(start, start + n):
                h = create(g)
                map_(va + i * g, g, h)
                done.append((va + i * g, h))
            set_access(va + start * g, n * g)
        dt = time.perf_counter() - t0
        _teardown(driver, done, g)
        driver.free_reservation(va, total)
        return dt

    return run


SHAPES = {
    "serial": serial,
    "threads_2": threaded(2),
    "threads_4": threaded(4),
    "pipeline": pipeline,
    "lanes_64": lanes(64),
    "runs_32": runs(32),
}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "hip", "host"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mib", type=int, default=1024, help="bytes grown per shape and round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prov = _provenance.start()
    from kvcached.config import get_config

    driver = make_driver(args.backend, args.device, config=get_config())
    g = driver.granularity
    pages = args.mib * MIB // g
    driver.mem_info()
    names = list(SHAPES)
    secs: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dt = SHAPES[name](driver, pages * g)
            if r:
                secs[name].append(dt)
    gib = pages * g / (1 << 30)
    best = {k: gib / min(v) for k, v in secs.items()}
    med = {k: gib / statistics.median(v) for k, v in secs.items()}
    result = {
        "benchmark": "driver_threads",
        "command": " ".join(["python3", *sys.argv]),
        "commit": _provenance.commit()[0],
        "machine": platform.node(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "device": driver.info().as_dict(),
        "pages_per_round": pages,
        "rounds": args.rounds,
        "gib_s_best": {k: round(v, 3) for k, v in best.items()},
        "us_per_page_best": {k: round(min(v) / pages * 1e6, 2) for k, v in secs.items()},
        "ratio_over_serial_best": {k: round(best[k] / best["serial"], 3) for k in names},
        "ratio_over_serial_median": {k: round(med[k] / med["serial"], 3) for k in names},
        "two_threads_slower_in_the_median": med["threads_2"] < med["serial"],
    }
    driver.close()
    if args.out:
        _provenance.write_result(args.out, result, prov)
    else:
        result["provenance"] = _provenance.finish(prov)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
