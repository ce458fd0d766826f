"""Ledger throughput and latency: grant+refund pairs against one ledger file.

    python benchmarks/ledger.py [--seconds 2] [--rounds 3] [--out benchmarks/results/ledger-host.json]

A *pair* is ``grant(2 MiB)`` then ``refund(2 MiB)`` on one pool, what the
memory layer does for a page that comes and goes. Each of 1, 2 and 4
processes registers its own pool on one ledger (in a fresh directory under
/dev/shm) and runs pairs for ``--seconds``; pairs/s is the sum over the
processes. The budget is large, so no grant is denied: this measures the
accounting, not admission.

Variants, run in the same rounds, alternating their order:

* ``ledger`` — as shipped: OFD byte-range data lock, refunds batched below
  64 MiB, and a grant no larger than the pool's batch re-uses it without any
  lock (in this pattern every grant after the first does);
* ``flock`` — the baseline, the seed PR's design on the same code: the data
  lock replaced by a whole-file ``fcntl.flock(LOCK_EX)``, every grant written
  to the ledger under it (refunds batched below 64 MiB, as the seed does);
* ``ledger-no-recycle`` — the OFD lock doing the baseline's work (every grant
  to the ledger): the two lock primitives compared on equal work.

Patterns: ``pair`` (the top-level figures) and ``growshrink`` (32 grants of
2 MiB, then 32 refunds: every grant must go to the ledger, in every variant).

``pairs_per_s`` and ``speedup_vs_flock`` are medians over the rounds (``best_*``:
the best round of each, less disturbed by other load on a shared machine; the
load average is recorded). The latency of one pair (p50/p99) is timed pair by
pair in the one-process runs.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _provenance  # noqa: E402

from kvcached.ledger import Ledger  # noqa: E402
from kvcached.units import MIB  # noqa: E402

PAGE = 2 * MIB
VARIANTS = ("ledger", "flock", "ledger-no-recycle")
PATTERNS = ("pair", "growshrink")
COUNTS = (1, 2, 4)


class Device:
    def mem_info(self) -> tuple[int, int]:
        return 1 << 50, 1 << 50


class WholeFileFlock:
    """The baseline's data lock: ``flock(LOCK_EX)`` on the whole file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def acquire(self, wait: bool = True) -> bool:
        fcntl.flock(self.fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def worker(directory: str, variant: str, pattern: str, seconds: float, timed: bool,
           barrier, queue) -> None:
    ledger = Ledger.open("bench-0", Device(), directory=directory, gpu_utilization=0.9)
    if variant == "flock":
        ledger._data = WholeFileFlock(ledger.file.fd)
    pool = ledger.register_pool(f"bench-{os.getpid()}")
    if variant != "ledger":
        pool._recycle = False
    grant, refund = pool.grant, pool.refund
    for _ in range(2000):  # warm up
        grant(PAGE)
        refund(PAGE)
    lat: list[int] = []
    barrier.wait()
    clock = time.perf_counter_ns
    end = clock() + int(seconds * 1e9)
    pairs = 0
    if pattern == "growshrink":  # 32 pages up, 32 down: every grant goes to the ledger
        while clock() < end:
            for _ in range(32):
                assert grant(PAGE)
            for _ in range(32):
                refund(PAGE)
            pairs += 32
    elif timed:
        append = lat.append
        while True:
            t0 = clock()
            grant(PAGE)
            refund(PAGE)
            t1 = clock()
            append(t1 - t0)
            pairs += 1
            if t1 >= end:
                break
    else:
        while clock() < end:
            for _ in range(64):
                grant(PAGE)
                refund(PAGE)
            pairs += 64
    pool.close()
    ledger.close()
    queue.put((pairs, lat))


def run(variant: str, pattern: str, procs: int, seconds: float) -> dict:
    directory = tempfile.mkdtemp(prefix="kvcached-bench-", dir="/dev/shm")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    queue = ctx.Queue()
    timed = procs == 1
    ps = [ctx.Process(target=worker,
                      args=(directory, variant, pattern, seconds, timed, barrier, queue))
          for _ in range(procs)]
    for p in ps:
        p.start()
    results = [queue.get(timeout=seconds * 10 + 60) for _ in ps]
    for p in ps:
        p.join()
        assert p.exitcode == 0, f"{variant} worker exited with {p.exitcode}"
    shutil.rmtree(directory)
    out = {"pairs_per_s": sum(r[0] for r in results) / seconds}
    lat = sorted(x for r in results for x in r[1])
    if lat:
        out["p50_us"] = lat[len(lat) // 2] / 1e3
        out["p99_us"] = lat[int(len(lat) * 0.99)] / 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "ledger-host.json"))
    args = parser.parse_args()

    prov = _provenance.start()
    load_before = os.getloadavg()
    samples = {(v, p, n): [] for v in VARIANTS for p in PATTERNS for n in COUNTS}
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        for pattern in PATTERNS:
            for n in COUNTS:
                for variant in order:
                    r = run(variant, pattern, n, args.seconds)
                    samples[variant, pattern, n].append(r)
                    extra = (f"  p50 {r['p50_us']:.2f} us  p99 {r['p99_us']:.2f} us"
                             if "p50_us" in r else "")
                    print(f"round {rnd} {pattern:10s} {variant:18s} procs={n}: "
                          f"{r['pairs_per_s']:>11,.0f} pairs/s{extra}", flush=True)

    def med(variant: str, pattern: str, n: int, key: str) -> float:
        return statistics.median(s[key] for s in samples[variant, pattern, n])

    def summary(pattern: str) -> dict:
        per = {}
        for v in VARIANTS:
            per[v] = {
                "pairs_per_s": {str(n): round(med(v, pattern, n, "pairs_per_s")) for n in COUNTS},
                "best_pairs_per_s": {
                    str(n): round(max(s["pairs_per_s"] for s in samples[v, pattern, n]))
                    for n in COUNTS},
                "rounds_pairs_per_s": {
                    str(n): [round(s["pairs_per_s"]) for s in samples[v, pattern, n]]
                    for n in COUNTS},
            }
            if pattern == "pair":
                per[v]["pair_p50_us"] = round(med(v, pattern, 1, "p50_us"), 2)
                per[v]["pair_p99_us"] = round(med(v, pattern, 1, "p99_us"), 2)
        ours, base = per["ledger"]["pairs_per_s"], per["flock"]["pairs_per_s"]
        best_ours, best_base = per["ledger"]["best_pairs_per_s"], per["flock"]["best_pairs_per_s"]
        return {
            "pairs_per_s": ours,
            "speedup_vs_flock": {k: round(ours[k] / base[k], 3) for k in ours},
            "best_speedup_vs_flock": {k: round(best_ours[k] / best_base[k], 3) for k in ours},
            "variants": per,
        }

    pair, grow = summary("pair"), summary("growshrink")
    result = {
        "benchmark": "ledger grant+refund pairs (2 MiB pages), one pool per process, one "
                     "ledger file in /dev/shm; pairs/s summed over the processes",
        "command": "python benchmarks/ledger.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "seconds_per_run": args.seconds,
        "rounds": args.rounds,
        "pair_p50_us": pair["variants"]["ledger"]["pair_p50_us"],
        "pair_p99_us": pair["variants"]["ledger"]["pair_p99_us"],
        "pairs_per_s": pair["pairs_per_s"],
        "speedup_vs_flock": pair["speedup_vs_flock"],
        "baseline": "flock: the seed PR's design on the same code: whole-file "
                    "fcntl.flock(LOCK_EX) around every ledger update; every grant goes to "
                    "the ledger (refunds batched below 64 MiB, as the seed does)",
        "variants": {
            "ledger": "as shipped: OFD byte-range data lock, refunds batched below 64 MiB, "
                      "grants within the batch re-use it without the lock",
            "flock": "the baseline",
            "ledger-no-recycle": "OFD data lock, batched refunds, every grant to the ledger: "
                                 "the shipped lock against the baseline's on equal work",
        },
        "patterns": {
            "pair": "grant(2 MiB) then refund(2 MiB), repeated (the top-level figures)",
            "growshrink": "32 grants of 2 MiB then 32 refunds: every grant needs the ledger",
        },
        "pair": pair,
        "growshrink": grow,
    }
    _provenance.write_result(args.out, result, prov)
    print(json.dumps({k: result[k] for k in ("pair_p50_us", "pair_p99_us", "pairs_per_s",
                                              "speedup_vs_flock")}, indent=2))
    print("growshrink:", json.dumps({k: grow[k] for k in ("pairs_per_s", "speedup_vs_flock")}))


if __name__ == "__main__":
    main()
