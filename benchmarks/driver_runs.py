"""Does one call over a run of K mappings make growth and shrink cheaper?

Raw driver loops over ``--mib`` MiB of 2 MiB handles, through kvcached's
driver object, in alternating rounds (a rotated order each round; setup and
teardown untimed), reported as per-page microseconds (best and median
round) and as each round's ratio over the per-page loop of the same round,
median over rounds (``paired_over_per_page``):

* growth ``grow_k1``: create, map, set_access per page (the raw loop of
  ``benchmarks/memory.py``); ``grow_kK``: create and map K pages one by
  one, then one ``set_access`` over the K (kvcached's run); ``grow_k32_split``:
  32 creates, then 32 maps, then one ``set_access``;
* shrink ``shrink_k1``: unmap and release per page; ``shrink_kK``: one
  ``unmap_range`` over K mappings, then K releases.

    python benchmarks/driver_runs.py --backend cuda --out benchmarks/results/driver-runs-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import _provenance
from kvcached.driver import make_driver
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent

KS = (4, 16, 32, 64)


def _grow(driver, va: int, pages: int, k: int, split: bool = False) -> list:
    g = driver.granularity
    create, map_, set_access = driver.create, driver.map, driver.set_access
    made = []
    for start in range(0, pages, k):
        n = min(k, pages - start)
        if k == 1:
            v = va + start * g
            h = create(g)
            map_(v, g, h)
            set_access(v, g)
            made.append(h)
            continue
        if split:
            hs = [create(g) for _ in range(n)]
            for i, h in enumerate(hs):
                map_(va + (start + i) * g, g, h)
            made.extend(hs)
        else:
            for i in range(start, start + n):
                h = create(g)
                map_(va + i * g, g, h)
                made.append(h)
        set_access(va + start * g, n * g)
    return made


def _shrink(driver, va: int, handles: list, k: int) -> None:
    g = driver.granularity
    unmap, unmap_range, release = driver.unmap, driver.unmap_range, driver.release
    for start in range(0, len(handles), k):
        n = min(k, len(handles) - start)
        if k == 1:
            unmap(va + start * g, g)
        else:
            unmap_range(va + start * g, g, n)
        for h in handles[start : start + n]:
            release(h)


def grow_shape(k: int, split: bool = False):
    def run(driver, total: int) -> float:
        va = driver.reserve(total)
        driver.mem_info()
        t0 = time.perf_counter()
        made = _grow(driver, va, total // driver.granularity, k, split)
        dt = time.perf_counter() - t0
        _shrink(driver, va, made, 1)
        driver.free_reservation(va, total)
        return dt

    return run


def shrink_shape(k: int):
    def run(driver, total: int) -> float:
        va = driver.reserve(total)
        driver.mem_info()
        made = _grow(driver, va, total // driver.granularity, 1)
        t0 = time.perf_counter()
        _shrink(driver, va, made, k)
        dt = time.perf_counter() - t0
        driver.free_reservation(va, total)
        return dt

    return run


SHAPES = {
    "grow_k1": grow_shape(1),
    **{f"grow_k{k}": grow_shape(k) for k in KS},
    "grow_k32_split": grow_shape(32, split=True),
    "shrink_k1": shrink_shape(1),
    **{f"shrink_k{k}": shrink_shape(k) for k in KS},
}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "hip", "host"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mib", type=int, default=1024, help="bytes per shape and round")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prov = _provenance.start()
    from kvcached.config import get_config

    driver = make_driver(args.backend, args.device, config=get_config())
    pages = args.mib * MIB // driver.granularity
    total = pages * driver.granularity
    load_before = os.getloadavg()
    names = list(SHAPES)
    secs: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dt = SHAPES[name](driver, total)
            if r:
                secs[name].append(dt)
    base = {"grow": secs["grow_k1"], "shrink": secs["shrink_k1"]}
    result = {
        "benchmark": "driver_runs",
        "command": " ".join(["python3", *sys.argv]),
        "commit": prov["commit"],
        "machine": platform.node(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "device": driver.info().as_dict(),
        "pages_per_round": pages,
        "rounds": args.rounds,
        "us_per_page_best": {k: round(min(v) / pages * 1e6, 2) for k, v in secs.items()},
        "us_per_page_median": {
            k: round(statistics.median(v) / pages * 1e6, 2) for k, v in secs.items()
        },
        "paired_over_per_page": {
            k: round(
                statistics.median(b / a for a, b in zip(v, base[k.split("_")[0]], strict=True)), 3
            )
            for k, v in secs.items()
        },
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
