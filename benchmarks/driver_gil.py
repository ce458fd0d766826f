"""Does the page thread hold the step's thread through the GIL, and the other way round?

kvcached's vLLM worker maps and unmaps pages in a thread beside the step
(always, since #34). Whether that helps depends on the binding:
``cuda-python`` must release the GIL inside ``cuMemCreate``/``cuMemMap``/
``cuMemSetAccess``/``cuMemUnmap``/``cuMemRelease``, and the page thread must
get the GIL back quickly after each call while the step's thread runs Python.

Two threads, timed alone and together, in rounds (rotated order):

* ``busy``: a pure-Python loop (the worst case for the step's thread: eager
  vLLM launching kernels); its iterations per second;
* ``pages``: kvcached's driver growing and releasing pages of ``--handles``
  handles of the granularity each (create, map, set_access per handle; then
  one unmap and a release per handle), as the worker's mapper does for a
  per-layer page; pages per second, and the share of its time spent inside
  driver calls when alone.

Read-outs: ``busy_kept`` (the busy loop's rate together / alone) and
``pages_kept`` (the pages' rate together / alone). If the binding kept the
GIL inside a call, ``busy_kept`` could not exceed ``1 - driver_share``; a
binding that releases it leaves the busy loop most of its rate, and then
``pages_kept`` says how long the page thread waits for the GIL after each
call (Python's switch interval, 5 ms by default, bounds that wait; each
``--switch-intervals`` value is measured).

    python benchmarks/driver_gil.py --backend cuda --out $OUT/driver-gil.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _provenance
from kvcached.driver import make_driver


def _busy(stop: threading.Event, out: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


class _PageLoop:
    """Grows and releases pages until stopped; counts pages and time in calls."""

    def __init__(self, driver: Any, handles: int) -> None:
        self.driver = driver
        self.handles = handles
        self.g = driver.granularity
        self.va = driver.reserve(self.g * handles)
        self.pages = 0
        self.in_calls = 0.0

    def run(self, stop: threading.Event) -> None:
        d, g, va = self.driver, self.g, self.va
        clock = time.perf_counter
        while not stop.is_set():
            t0 = clock()
            hs = []
            for i in range(self.handles):
                h = d.create(g)
                d.map(va + i * g, g, h)
                d.set_access(va + i * g, g)
                hs.append(h)
            d.unmap_range(va, g, self.handles)
            for h in hs:
                d.release(h)
            self.in_calls += clock() - t0
            self.pages += 1

    def close(self) -> None:
        self.driver.free_reservation(self.va, self.g * self.handles)


def _phase(driver: Any, handles: int, seconds: float, busy: bool, pages: bool) -> dict:
    stop = threading.Event()
    counts: list[int] = []
    loop = _PageLoop(driver, handles) if pages else None
    threads = []
    if busy:
        threads.append(threading.Thread(target=_busy, args=(stop, counts)))
    if loop is not None:
        threads.append(threading.Thread(target=loop.run, args=(stop,)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out: dict[str, float] = {}
    if busy:
        out["busy_per_s"] = counts[0] / wall
    if loop is not None:
        out["pages_per_s"] = loop.pages / wall
        out["ms_per_page"] = 1e3 * loop.in_calls / max(1, loop.pages)
        loop.close()
    return out


def measure(driver: Any, handles: int, seconds: float, rounds: int, interval: float) -> dict:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        kinds = [("busy", True, False), ("pages", False, True), ("together", True, True)]
        per: dict[str, list[dict]] = {k: [] for k, _, _ in kinds}
        for r in range(rounds):
            order = kinds[r % 3 :] + kinds[: r % 3]
            for name, busy, pages in order:
                per[name].append(_phase(driver, handles, seconds, busy, pages))
    finally:
        sys.setswitchinterval(previous)
    med = statistics.median
    pairs = list(zip(per["together"], per["busy"], per["pages"], strict=True))
    busy_kept = [t["busy_per_s"] / b["busy_per_s"] for t, b, _ in pairs]
    pages_kept = [t["pages_per_s"] / p["pages_per_s"] for t, _, p in pairs]
    alone_ms = med(p["ms_per_page"] for p in per["pages"])
    return {
        "switch_interval_s": interval,
        "busy_kept": med(busy_kept),
        "busy_kept_range": [min(busy_kept), max(busy_kept)],
        "pages_kept": med(pages_kept),
        "pages_kept_range": [min(pages_kept), max(pages_kept)],
        "ms_per_page_alone": alone_ms,
        "ms_per_page_together": med(p["ms_per_page"] for p in per["together"]),
        "rounds": per,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "hip", "host"))
    ap.add_argument("--handles", type=int, default=32, help="handles per page (8B: 32 layers)")
    ap.add_argument("--seconds", type=float, default=1.0, help="per phase")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--switch-intervals", type=float, nargs="+", default=[0.005, 0.0005])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prov = _provenance.start()
    driver = make_driver(args.backend)
    # The in-driver share of the page loop alone, with nothing else wanting the GIL,
    # bounds what a GIL-holding binding would leave the busy loop.
    results = [
        measure(driver, args.handles, args.seconds, args.rounds, s) for s in args.switch_intervals
    ]
    info = driver.info()
    result = {
        "device": info.name,
        "backend": args.backend,
        "handles_per_page": args.handles,
        "handle_bytes": driver.granularity,
        "by_switch_interval": results,
    }
    _provenance.write_result(args.out, result, prov)
    for r in results:
        print(
            f"switch {r['switch_interval_s'] * 1e3:.1f} ms: busy kept {r['busy_kept']:.3f} "
            f"({r['busy_kept_range'][0]:.3f}-{r['busy_kept_range'][1]:.3f}), pages kept "
            f"{r['pages_kept']:.3f}, ms/page alone {r['ms_per_page_alone']:.2f}, together "
            f"{r['ms_per_page_together']:.2f}"
        )
    driver.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
