"""Memory-core benchmark: every figure is a ratio against a baseline measured
in the same run (except ``available_size_us``, an absolute cost).

* ``alloc_free_ratio``: cost per block of ``alloc`` + ``free`` through
  kvcached (pages already mapped) over vLLM's own ``BlockPool.get_new_blocks``
  + ``free_blocks`` (prefix caching off, like for like; ``..._vs_caching_pool``
  is against vLLM's default pool with caching on), for the same seeded trace of
  requests of 1, 4, 16 and 64 blocks. ``pair_ratio_by_size``: one alloc + free
  of each size in a loop. Needs vLLM (``/work/venv-full``); omitted, with a
  note, without it. Target <= 1.0.
* ``grow_ratio``: bytes/s of physical growth through the page allocator
  (create + map + set_access, 2 MiB pages, one handle per page, one ``take``
  per page) over a raw driver loop of 2 MiB handles. Target >= 0.95. Its gap
  is the allocator's Python per page (about 2 us on a 2-core VM; the H200
  host runs the same Python about 2x slower) against ~50 us of driver calls.
* ``grow_ratio_coalesced_64mib``: the same for grows of 64 MiB at a time with
  coalescing on (one 64 MiB handle), over the same raw 2 MiB loop. Target >= 5
  on a GPU (the driver charges per handle); the host backend charges per byte
  (memfd zeroing), so there it stays near 1.
* ``grow_ratio_batched_32``: 2 MiB handles again (coalescing off), 32 pages
  per ``take`` (one ``PageMapper.map_runs`` call: the 32 adjacent pages are a
  run, enabled by one ``set_access``), as a prefill burst or a pool refill
  grows. Target >= 1.15.
* ``shrink_ratio_batched_32``: the way back: 32 one-handle pages given back
  at a time and released at once (one ``unmap_range`` over the run, a
  release per page, one device sync per batch) over a raw loop of 2 MiB
  unmap + release. Target >= 1.05.
* ``grow_lock``: one-page takes with the pool refilling beside them, with
  the allocator's grow lock over the same with a no-op in its place;
  ``keep`` says whether the median rounds (paired and of medians) show the
  lock pays.
* ``grow_ratio_pooled``: one-page takes again, with the reserved pool on as
  configured by default (5/10 pages) and refilled by its own thread, over the
  raw loop, both on the wall clock; beside it two raw loops at once
  (``pooled.raw_threads_2_gib_s``): on CUDA two threads growing at once are
  slower than one (``benchmarks/driver_threads.py``), so the allocator lets
  one thread grow at a time.
* ``grow_ratio_llama3_8b``: a model's cache (Llama-3-8B KV: 32 layers, K and
  V) on the default per-layer layout, where one 2 MiB page is 64 handles of
  2 MiB, one page per take, page 0 (the null block's) mapped first; ``_cold``
  without that; ``_contiguous`` on the contiguous layout (one 128 MiB handle
  per page). Over a raw loop of 2 MiB handles of the same bytes;
  ``_same_addresses`` over a raw loop at the very addresses the per-layer
  cache maps (64 ranges, page by page): what kvcached adds, without the
  driver's cost of the address pattern.
* ``available_size_us``: median cost of one ``available_size()`` call. Target <= 1.

Growth rounds vary a lot on a shared host (the same raw loop took 17-29 ms
per round on the H200 machine), so beside the best round of each loop
(``grow_ratio*``, "other tenants only ever add time") and the ratio of
medians (``median_round``) the file has ``paired_round_median``: each round's
ratio against its baseline from the same round, median over rounds; and the
round times themselves (``round_ms``).

Where growth time goes (``benchmarks/grow_overhead.py``, same run):
``grow_python_overhead`` is the allocator's Python cost per page on this
host's CPU (growth through the allocator on a driver whose calls do nothing,
minus the raw loop on it); ``grow_split_us_per_page`` splits a page of the raw
loop and of the allocator into time inside ``create`` / ``map`` /
``set_access`` and outside them; ``grow_explained`` puts the two beside the
measured gap (``allocator_us_per_2mib - raw_us_per_2mib``) and gives the ratio
the Python cost alone would allow. Rounds run the growth loops in the
orders of a balanced Latin square, so each runs right after each other one
equally often (a teardown can slow the loop after it).

Run from the repository root::

    python benchmarks/memory.py --backend host    # writes benchmarks/results/memory-host.json
    python benchmarks/memory.py --backend cuda    # writes benchmarks/results/memory-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch

import _provenance
from free_budget import FreeBudget
from grow_overhead import (
    LLAMA3_8B,
    allocator_growth,
    allocator_shrink,
    grow_report,
    page_bytes_of,
    raw_growth,
    raw_growth_like_cache,
    raw_growth_threads,
    raw_shrink,
)
from kvcached.driver import make_driver
from kvcached.memory import KVCache, KVCacheSpec, KVLayout
from kvcached.units import MIB

REQUEST_SIZES = (1, 4, 16, 64)


# -- alloc + free ---------------------------------------------------------------------------


def request_trace(num_blocks: int, steps: int, seed: int) -> list[tuple[str, int]]:
    """A seeded trace of ('alloc', size) / ('free', victim index) over a pool
    of ``num_blocks``, keeping at most 60% of it live; both allocators replay it."""
    rng = random.Random(seed)
    live_sizes: list[int] = []
    used = 0
    trace = []
    for _ in range(steps):
        size = rng.choice(REQUEST_SIZES)
        if live_sizes and (used + size > 0.6 * num_blocks or rng.random() < 0.45):
            i = rng.randrange(len(live_sizes))
            used -= live_sizes.pop(i)
            trace.append(("free", i))
        else:
            live_sizes.append(size)
            used += size
            trace.append(("alloc", size))
    return trace


# CPU-bound figures use this thread's CPU time: the machines these run on are
# shared, and time spent descheduled is not the allocator's. Growth on a GPU
# waits on the driver, so it uses wall time there (see bench_growth).
cpu_clock = time.thread_time


def replay(alloc, free, trace) -> tuple[float, int]:
    """Seconds and blocks allocated replaying ``trace`` (frees everything at the end)."""
    live: list = []
    blocks = 0
    t0 = cpu_clock()
    for op, arg in trace:
        if op == "alloc":
            got = alloc(arg)
            assert got is not None, "the pool ran dry during the trace"
            live.append(got)
            blocks += arg
        else:
            free(live.pop(arg))
    for got in live:
        free(got)
    return cpu_clock() - t0, blocks


def premapped_cache(driver, num_blocks: int, thread_safe: bool) -> KVCache:
    spec = KVCacheSpec(
        num_layers=1, block_size=16, num_heads=1, head_dim=128, dtype=torch.float16
    )  # 4 KiB blocks: 512 per 2 MiB page
    kv = KVCache(
        spec,
        driver=driver,
        budget=FreeBudget(),
        num_blocks=num_blocks,
        background=False,
        min_reserved=0,
        max_reserved=1 << 20,
        thread_safe=thread_safe,
    )
    everything = kv.alloc(kv.available_size())  # map every page once, keep them mapped
    kv.free(everything)
    return kv


def bench_alloc_free(driver, repeats: int) -> dict:
    num_blocks = 16 * 1024
    # As an engine with one scheduler thread runs it (vLLM, SGLang) ...
    kv = premapped_cache(driver, num_blocks, thread_safe=False)
    # ... and with the lock, for engines that allocate from several threads.
    locked = premapped_cache(driver, num_blocks, thread_safe=True)
    out: dict = {
        "num_blocks": kv.num_blocks,
        "blocks_per_page": kv.blocks_per_page,
        "request_sizes": list(REQUEST_SIZES),
        "clock": "thread CPU time",
    }
    trace = request_trace(num_blocks, 20000, seed=1)
    try:
        from vllm.v1.core.block_pool import BlockPool  # the engine's own pool
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        BlockPool = None
        out["vllm"] = f"not importable ({type(exc).__name__}); the ratio needs vLLM's CPU build"

    def kv_pair(cache, n):
        alloc, free = cache.alloc, cache.free
        return lambda: free(alloc(n))

    pools = {}
    if BlockPool is not None:
        import vllm

        out["vllm"] = vllm.__version__
        for caching in (True, False):
            pools[caching] = BlockPool(kv.num_blocks, enable_caching=caching, hash_block_size=16)

    best: dict[str, float] = {}

    def record(key, seconds, blocks):
        per = seconds / blocks * 1e6
        best[key] = min(best.get(key, float("inf")), per)

    def timed(fn, number):
        return timeit.Timer(fn, timer=cpu_clock).timeit(number=number)

    for _ in range(repeats):  # interleaved, best of each: the machine is shared
        record("kvcached_trace", *replay(kv.alloc, kv.free, trace))
        record("kvcached_locked_trace", *replay(locked.alloc, locked.free, trace))
        for caching, pool in pools.items():
            record(
                f"vllm_trace_caching_{caching}",
                *replay(pool.get_new_blocks, pool.free_blocks, trace),
            )
        for n in REQUEST_SIZES:
            reps = max(200, 8000 // n)
            record(f"kvcached_pair_{n}", timed(kv_pair(kv, n), reps), reps * n)
            record(f"kvcached_locked_pair_{n}", timed(kv_pair(locked, n), reps), reps * n)
            for caching, pool in pools.items():

                def pair(pool=pool, n=n):
                    pool.free_blocks(pool.get_new_blocks(n))

                record(f"vllm_pair_{n}_caching_{caching}", timed(pair, reps), reps * n)
    out["us_per_block"] = {k: round(v, 4) for k, v in sorted(best.items())}
    if pools:
        # Like for like: kvcached keeps no prefix-cache hashes, so the headline
        # is against vLLM's pool with caching off (its cheaper mode); the
        # default-config pool (caching on) is reported beside it.
        out["alloc_free_ratio"] = round(
            best["kvcached_trace"] / best["vllm_trace_caching_False"], 3
        )
        out["alloc_free_ratio_vs_caching_pool"] = round(
            best["kvcached_trace"] / best["vllm_trace_caching_True"], 3
        )
        out["alloc_free_ratio_thread_safe"] = round(
            best["kvcached_locked_trace"] / best["vllm_trace_caching_False"], 3
        )
        out["pair_ratio_by_size"] = {
            n: round(best[f"kvcached_pair_{n}"] / best[f"vllm_pair_{n}_caching_False"], 3)
            for n in REQUEST_SIZES
        }
    n_calls = 20000
    times = timeit.Timer(kv.available_size, timer=cpu_clock).repeat(
        number=n_calls, repeat=max(15, 3 * repeats)
    )
    out["available_size_us"] = round(statistics.median(times) / n_calls * 1e6, 4)
    out["available_size_us_min"] = round(min(times) / n_calls * 1e6, 4)
    kv.close()
    locked.close()
    return out


# -- growth ----------------------------------------------------------------------------------


# The reserved pool as KVCACHED_MIN/MAX_RESERVED_PAGES default it.
POOL_RESERVED = (5, 10)


def grow_clock(driver):
    return time.perf_counter if driver.backend in ("cuda", "hip") else cpu_clock


def balanced_orders(n: int) -> list[list[int]]:
    """A balanced Latin square (Williams) of ``n`` items (for an odd ``n``,
    the square and its mirror): across its rows every item runs right after
    every other item equally often. A loop's teardown
    can slow the next loop's first calls (the host frees memfd pages late; a
    GPU driver may defer work), so no loop may always follow the same one."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    # An odd n needs the mirrored rows too for every pair to meet both ways.
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def bench_growth(driver, total: int, repeats: int) -> dict:
    clock = grow_clock(driver)
    g = driver.granularity
    model_page = page_bytes_of(LLAMA3_8B, driver)
    model_total = max(1, 2 * total // model_page) * model_page  # longer rounds: 16 takes on a GPU
    loops = {
        "raw": lambda: raw_growth(driver, total, clock),
        "paged": lambda: allocator_growth(driver, total, g, coalesce=False, clock=clock),
        "batched": lambda: allocator_growth(driver, total, 32 * g, coalesce=False, clock=clock),
        "coalesced": lambda: allocator_growth(driver, total, 64 * MIB, coalesce=True, clock=clock),
        # The engine's view: one-page takes with the reserved pool on (as
        # configured by default), refilled on its own thread; wall clock, since
        # two threads work. Beside it the baselines on the same clock: one raw
        # loop, and two raw loops at once (what two threads of calls can get).
        "pooled": lambda: allocator_growth(
            driver, total, g, coalesce=False, reserved=POOL_RESERVED
        ),
        # The same without the grow lock (a no-op in its place): the take and
        # the refill call the driver at once. The lock stays only if "pooled"
        # beats this in the median round.
        "pooled_unlocked": lambda: allocator_growth(
            driver, total, g, coalesce=False, reserved=POOL_RESERVED, grow_lock=False
        ),
        "raw_wall": lambda: raw_growth(driver, total),
        "raw_threads_2": lambda: raw_growth_threads(driver, total, 2),
        # A model's cache on the default layout: one page per take is 64 handles
        # of 2 MiB (Llama-3-8B), over a raw loop of the same bytes. "model" has
        # its null block's page mapped first, as every KVCache has; "model_cold"
        # starts from nothing mapped, so each of its 64 ranges gets its first
        # mapping inside the clock.
        "model": lambda: allocator_growth(
            driver,
            model_total,
            model_page,
            coalesce=False,
            clock=clock,
            spec=LLAMA3_8B,
            null_page=True,
        ),
        "model_cold": lambda: allocator_growth(
            driver, model_total, model_page, coalesce=False, clock=clock, spec=LLAMA3_8B
        ),
        "raw_model": lambda: raw_growth(driver, model_total, clock),
        "raw_model_addresses": lambda: raw_growth_like_cache(driver, LLAMA3_8B, model_total, clock),
        "model_contiguous": lambda: allocator_growth(
            driver,
            model_total,
            model_page,
            coalesce=False,
            clock=clock,
            spec=LLAMA3_8B,
            null_page=True,
            layout=KVLayout.CONTIGUOUS,
        ),
        # Shrinking: 32 one-handle pages given back at a time (one unmap per
        # run, a release per page, one device sync per batch) over the raw
        # per-page unmap + release loop; growth untimed in both.
        "shrink_raw": lambda: raw_shrink(driver, total, clock),
        "shrink_batched": lambda: allocator_shrink(driver, total, 32, clock),
    }
    names = list(loops)
    for name in names:  # warm-up: first-touch costs (driver, allocator) are not timed
        loops[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    orders = balanced_orders(len(names))
    repeats = -(-repeats // len(orders)) * len(orders)  # whole squares
    for r in range(repeats):  # interleaved rounds; each loop follows each other equally
        for i in orders[r % len(orders)]:
            times[names[i]].append(loops[names[i]]())
    raw, paged = times["raw"], times["paged"]

    def rate(xs):  # best interleaved round: other tenants only ever add time
        return total / min(xs)

    def median_rate(xs):
        return total / statistics.median(xs)

    pages = total // g
    pooled_over = {
        "raw": round(rate(times["pooled"]) / rate(times["raw_wall"]), 3),
        "raw_threads_2": round(rate(times["pooled"]) / rate(times["raw_threads_2"]), 3),
    }
    # Each round's ratio against its baseline from the same round (the loops of
    # one round run within a second, so slow drift of the host cancels), median.
    baseline = {
        "paged": "raw",
        "batched": "raw",
        "coalesced": "raw",
        "pooled": "raw_wall",
        "model": "raw_model",
        "model_cold": "raw_model",
        "model_contiguous": "raw_model",
        "shrink_batched": "shrink_raw",
        "pooled_unlocked": "raw_wall",
    }
    # What the grow lock buys: each round's locked pool over the unlocked one.
    lock_paired = round(
        statistics.median(
            b / a for a, b in zip(times["pooled"], times["pooled_unlocked"], strict=True)
        ),
        3,
    )
    lock_median = round(
        statistics.median(times["pooled_unlocked"]) / statistics.median(times["pooled"]), 3
    )
    paired_addresses = round(
        statistics.median(
            b / a for a, b in zip(times["model"], times["raw_model_addresses"], strict=True)
        ),
        3,
    )
    paired = {
        name: round(
            statistics.median(b / a for a, b in zip(times[name], times[ref], strict=True)), 3
        )
        for name, ref in baseline.items()
    }
    return {
        "paired_round_median": {
            "grow_ratio": paired["paged"],
            "grow_ratio_batched_32": paired["batched"],
            "grow_ratio_coalesced_64mib": paired["coalesced"],
            "grow_ratio_pooled": paired["pooled"],
            "grow_ratio_llama3_8b": paired["model"],
            "grow_ratio_llama3_8b_cold": paired["model_cold"],
            "grow_ratio_llama3_8b_contiguous": paired["model_contiguous"],
            "grow_ratio_llama3_8b_same_addresses": paired_addresses,
            "shrink_ratio_batched_32": paired["shrink_batched"],
        },
        "shrink_ratio_batched_32": round(
            min(times["shrink_raw"]) / min(times["shrink_batched"]), 3
        ),
        "grow_lock": {
            "locked_over_unlocked_paired_median": lock_paired,
            "locked_over_unlocked_median_round": lock_median,
            "locked_over_unlocked_best": round(
                min(times["pooled_unlocked"]) / min(times["pooled"]), 3
            ),
            "keep": lock_paired >= 1.0 and lock_median >= 1.0,
            "rule": "keep the grow lock only if one-page takes with the pool refilling beside "
            "them are at least as fast with it as without, in the median round (paired "
            "and ratio of medians)",
        },
        "round_ms": {name: [round(t * 1e3, 3) for t in ts] for name, ts in times.items()},
        "grow_bytes_per_round": total,
        "rounds": repeats,
        "grow_clock": "wall" if clock is time.perf_counter else "thread CPU time",
        "raw_2mib_gib_s": round(rate(raw) / 2**30, 3),
        "allocator_2mib_gib_s": round(rate(paged) / 2**30, 3),
        "allocator_batched_32_gib_s": round(rate(times["batched"]) / 2**30, 3),
        "allocator_coalesced_64mib_gib_s": round(rate(times["coalesced"]) / 2**30, 3),
        "grow_ratio": round(rate(paged) / rate(raw), 3),
        "grow_ratio_batched_32": round(rate(times["batched"]) / rate(raw), 3),
        "grow_ratio_coalesced_64mib": round(rate(times["coalesced"]) / rate(raw), 3),
        "grow_ratio_pooled": pooled_over["raw"],
        "grow_ratio_llama3_8b": round(
            (model_total / min(times["model"])) / (model_total / min(times["raw_model"])), 3
        ),
        "grow_ratio_llama3_8b_cold": round(min(times["raw_model"]) / min(times["model_cold"]), 3),
        "grow_ratio_llama3_8b_contiguous": round(
            min(times["raw_model"]) / min(times["model_contiguous"]), 3
        ),
        "grow_ratio_llama3_8b_same_addresses": round(
            min(times["raw_model_addresses"]) / min(times["model"]), 3
        ),
        "llama3_8b": {
            "page_bytes": model_page,
            "handles_per_page": model_page // g,
            "pages_per_round": model_total // model_page,
            "allocator_gib_s": round(model_total / min(times["model"]) / 2**30, 3),
            "raw_gib_s": round(model_total / min(times["raw_model"]) / 2**30, 3),
        },
        "pooled": {
            "reserved_pages": list(POOL_RESERVED),
            "clock": "wall",
            "allocator_gib_s": round(rate(times["pooled"]) / 2**30, 3),
            "raw_gib_s": round(rate(times["raw_wall"]) / 2**30, 3),
            "raw_threads_2_gib_s": round(rate(times["raw_threads_2"]) / 2**30, 3),
            "ratio_over": pooled_over,
        },
        "raw_us_per_2mib": round(min(raw) / pages * 1e6, 2),
        "allocator_us_per_2mib": round(min(paged) / pages * 1e6, 2),
        "median_round": {
            "grow_ratio": round(median_rate(paged) / median_rate(raw), 3),
            "grow_ratio_batched_32": round(median_rate(times["batched"]) / median_rate(raw), 3),
            "grow_ratio_coalesced_64mib": round(
                median_rate(times["coalesced"]) / median_rate(raw), 3
            ),
            "grow_ratio_pooled": round(
                median_rate(times["pooled"]) / median_rate(times["raw_wall"]), 3
            ),
            "grow_ratio_llama3_8b": round(
                statistics.median(times["raw_model"]) / statistics.median(times["model"]), 3
            ),
            "grow_ratio_llama3_8b_same_addresses": round(
                statistics.median(times["raw_model_addresses"]) / statistics.median(times["model"]),
                3,
            ),
            "shrink_ratio_batched_32": round(
                statistics.median(times["shrink_raw"]) / statistics.median(times["shrink_batched"]),
                3,
            ),
        },
    }


def explain_growth(result: dict) -> dict:
    """The measured gap per page beside the allocator's Python cost on this
    CPU and the driver-call split."""
    raw, alloc = result["raw_us_per_2mib"], result["allocator_us_per_2mib"]
    python = result["grow_python_overhead"]["allocator_python_us_per_page"]
    split = result["grow_split_us_per_page"]
    inside = {
        k: round(split["allocator"][k] - split["raw"][k], 3)
        for k in ("create", "map", "set_access")
    }
    return {
        "gap_us_per_page": round(alloc - raw, 2),
        "python_us_per_page_null_driver": python,
        "driver_calls_slower_in_allocator_us": inside,
        "ratio_python_alone_allows": round(raw / (raw + python), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("host", "cuda", "hip"), default="host")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--grow-mib",
        type=int,
        default=None,
        help="bytes grown per round (default: 64 on host, 1024 on a GPU)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/"
        "memory-host.json, or memory-h200.json on a GPU)",
    )
    args = ap.parse_args()
    if args.backend == "host" and "KVCACHED_HOST_CAPACITY" not in os.environ:
        os.environ["KVCACHED_HOST_CAPACITY"] = "4G"
    prov = _provenance.start()
    from kvcached.config import get_config

    driver = make_driver(args.backend, args.device, config=get_config())
    info = driver.info()
    grow_mib = args.grow_mib or (64 if args.backend == "host" else 1024)
    result = {
        "benchmark": "memory",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": prov["commit"],
        "machine": platform.node(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "device": info.as_dict(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "notes": [],
    }
    result.update(bench_alloc_free(driver, args.repeats))
    if "alloc_free_ratio" not in result:
        result["notes"].append(
            "alloc_free_ratio omitted: vLLM is not importable here (the host run in "
            "memory-host.json carries it); never a copy of vLLM's code"
        )
    result.update(bench_growth(driver, grow_mib * MIB, args.repeats))
    result.update(grow_report(driver, grow_mib * MIB, args.repeats, grow_clock(driver)))
    result["grow_explained"] = explain_growth(result)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.backend == "host":
        result["notes"].append(
            "host growth costs per byte (memfd + fallocate zeroes every page), so "
            "coalescing cannot win there; the per-handle cost it removes is a GPU driver's"
        )
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).parent
        / "results"
        / ("memory-host.json" if args.backend == "host" else "memory-h200.json")
    )
    _provenance.write_result(out, result, prov)
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if "ratio" in k or k.endswith("_us") or k.startswith("grow_")
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    driver.close()


if __name__ == "__main__":
    main()
