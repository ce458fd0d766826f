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
  (create + map + set_access, 2 MiB pages, one handle per page) over a raw
  driver loop of 2 MiB handles. Target >= 0.95.
* ``grow_ratio_coalesced_64mib``: the same for grows of 64 MiB at a time with
  coalescing on (one 64 MiB handle), over the same raw 2 MiB loop. Target >= 5
  on a GPU (the driver charges per handle); the host backend charges per byte
  (memfd zeroing), so there it stays near 1.
* ``available_size_us``: median cost of one ``available_size()`` call. Target <= 1.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvcached.driver import make_driver  # noqa: E402
from kvcached.memory import (  # noqa: E402
    DriverFreeBudget,
    KVCache,
    KVCacheSpec,
    KVLayout,
    PageAllocator,
    PageMapper,
    VirtualKVTensors,
    plan_pages,
)
from kvcached.units import MIB  # noqa: E402

REQUEST_SIZES = (1, 4, 16, 64)


class NoBudget:
    """Grants everything: isolates allocator bookkeeping from budget policy
    where the benchmark needs it (never used for the headline grow figures)."""

    def grant(self, nbytes: int) -> bool:
        return True

    def refund(self, nbytes: int) -> None:
        pass

    def headroom(self) -> int:
        return 1 << 62

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


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
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=1, head_dim=128,
                       dtype=torch.float16)  # 4 KiB blocks: 512 per 2 MiB page
    kv = KVCache(spec, driver=driver, budget=NoBudget(), num_blocks=num_blocks,
                 background=False, min_reserved=0, max_reserved=1 << 20,
                 thread_safe=thread_safe)
    everything = kv.alloc(kv.available_size())  # map every page once, keep them mapped
    kv.free(everything)
    return kv


def bench_alloc_free(driver, repeats: int) -> dict:
    num_blocks = 16 * 1024
    # As an engine with one scheduler thread runs it (vLLM, SGLang) ...
    kv = premapped_cache(driver, num_blocks, thread_safe=False)
    # ... and with the lock, for engines that allocate from several threads.
    locked = premapped_cache(driver, num_blocks, thread_safe=True)
    out: dict = {"num_blocks": kv.num_blocks, "blocks_per_page": kv.blocks_per_page,
                 "request_sizes": list(REQUEST_SIZES), "clock": "thread CPU time"}
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
            record(f"vllm_trace_caching_{caching}",
                   *replay(pool.get_new_blocks, pool.free_blocks, trace))
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
            best["kvcached_trace"] / best["vllm_trace_caching_False"], 3)
        out["alloc_free_ratio_vs_caching_pool"] = round(
            best["kvcached_trace"] / best["vllm_trace_caching_True"], 3)
        out["alloc_free_ratio_thread_safe"] = round(
            best["kvcached_locked_trace"] / best["vllm_trace_caching_False"], 3)
        out["pair_ratio_by_size"] = {
            n: round(best[f"kvcached_pair_{n}"] / best[f"vllm_pair_{n}_caching_False"], 3)
            for n in REQUEST_SIZES}
    n_calls = 20000
    times = timeit.Timer(kv.available_size, timer=cpu_clock).repeat(
        number=n_calls, repeat=max(15, 3 * repeats))
    out["available_size_us"] = round(statistics.median(times) / n_calls * 1e6, 4)
    out["available_size_us_min"] = round(min(times) / n_calls * 1e6, 4)
    kv.close()
    locked.close()
    return out


# -- growth ----------------------------------------------------------------------------------


def grow_clock(driver):
    return time.perf_counter if driver.backend in ("cuda", "hip") else cpu_clock


def raw_growth(driver, total: int) -> float:
    """Seconds for a raw loop of 2 MiB create + map + set_access over ``total``
    bytes (teardown not timed)."""
    g = driver.granularity
    va = driver.reserve(total)
    handles = []
    clock = grow_clock(driver)
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


def allocator_growth(driver, total: int, grow: int, coalesce: bool) -> float:
    """Seconds to grow ``total`` bytes through :class:`PageAllocator`, ``grow``
    bytes per ``take`` (2 MiB pages), with the real driver-free-memory budget."""
    spec = KVCacheSpec.of_bytes(num_layers=1, block_bytes=64 * 1024)
    geometry = plan_pages(spec, layout=KVLayout.PER_LAYER, granularity=driver.granularity,
                          page_size=driver.granularity, capacity_bytes=total)
    assert geometry.page_bytes == driver.granularity
    tensors = VirtualKVTensors(driver, spec, geometry)
    budget = DriverFreeBudget(driver, sample_interval_s=60)
    mapper = PageMapper(tensors, budget, max_handle_bytes=64 * MIB if coalesce else 0)
    pages = PageAllocator(mapper, background=False)
    per_take = grow // geometry.page_bytes
    taken = []
    clock = grow_clock(driver)
    t0 = clock()
    for _ in range(total // grow):
        got = pages.take(per_take)
        assert got is not None, "growth was refused: not enough free device memory"
        taken.extend(got)
    dt = clock() - t0
    pages.give_back(taken)
    pages.close()
    tensors.close()
    budget.close()
    return dt


def bench_growth(driver, total: int, repeats: int) -> dict:
    raw, paged, coalesced = [], [], []
    for _ in range(repeats):  # interleaved rounds
        raw.append(raw_growth(driver, total))
        paged.append(allocator_growth(driver, total, driver.granularity, coalesce=False))
        coalesced.append(allocator_growth(driver, total, 64 * MIB, coalesce=True))

    def rate(xs):  # best interleaved round: other tenants only ever add time
        return total / min(xs)

    def median_rate(xs):
        return total / statistics.median(xs)

    return {
        "grow_bytes_per_round": total,
        "rounds": repeats,
        "grow_clock": "wall" if grow_clock(driver) is time.perf_counter else "thread CPU time",
        "raw_2mib_gib_s": round(rate(raw) / 2**30, 3),
        "allocator_2mib_gib_s": round(rate(paged) / 2**30, 3),
        "allocator_coalesced_64mib_gib_s": round(rate(coalesced) / 2**30, 3),
        "grow_ratio": round(rate(paged) / rate(raw), 3),
        "grow_ratio_coalesced_64mib": round(rate(coalesced) / rate(raw), 3),
        "raw_us_per_2mib": round(min(raw) / (total / driver.granularity) * 1e6, 2),
        "median_round": {
            "grow_ratio": round(median_rate(paged) / median_rate(raw), 3),
            "grow_ratio_coalesced_64mib": round(median_rate(coalesced) / median_rate(raw), 3),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("host", "cuda", "hip"), default="host")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--grow-mib", type=int, default=None,
                    help="bytes grown per round (default: 64 on host, 1024 on a GPU)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/"
                    "memory-host.json, or memory-h200.json on a GPU)")
    args = ap.parse_args()
    if args.backend == "host" and "KVCACHED_HOST_CAPACITY" not in os.environ:
        os.environ["KVCACHED_HOST_CAPACITY"] = "4G"
    driver = make_driver(args.backend, args.device)
    info = driver.info()
    grow_mib = args.grow_mib or (64 if args.backend == "host" else 1024)
    result = {
        "benchmark": "memory",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
            "memory-host.json carries it); never a copy of vLLM's code")
    result.update(bench_growth(driver, grow_mib * MIB, args.repeats))
    if args.backend == "host":
        result["notes"].append(
            "host growth costs per byte (memfd + fallocate zeroes every page), so "
            "coalescing cannot win there; the per-handle cost it removes is a GPU driver's")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        "memory-host.json" if args.backend == "host" else "memory-h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k or k.endswith("_us")},
                     indent=2))
    print(f"wrote {out}")
    driver.close()


if __name__ == "__main__":
    main()
