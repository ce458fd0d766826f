"""Ledger throughput and latency: grant+refund pairs against one ledger file.

    python benchmarks/ledger.py [--seconds 0.5] [--rounds 9] [--out benchmarks/results/ledger-host.json]

A *pair* is ``grant(2 MiB)`` then ``refund(2 MiB)`` on one pool, what the
memory layer does for a page that comes and goes. Each of 1, 2 and 4
processes registers its own pool on one ledger (in a fresh directory under
/dev/shm) and runs pairs for ``--seconds``; pairs/s is the sum over the
processes. The budget is large, so no grant is denied: this measures the
accounting, not admission.

Variants, all on the same accounting code, run in the same rounds, in an
order that alternates from round to round:

* ``ledger`` — as shipped: the data lock is a whole-file ``flock`` taken
  without blocking (a bounded poll when busy) through the pool's own
  descriptor (so no thread lock beside the pool's), inline in the grant (no
  call frame around the system call), refunds batched below 64 MiB,
  and a grant no larger than the pool's batch re-uses it without any lock (in
  the ``pair`` pattern every grant after the first does);
* ``ledger-no-recycle`` — as shipped, but every grant goes to the ledger: the
  baseline's work;
* ``flock`` — the baseline, the seed PR's design: the data lock is a blocking
  whole-file ``flock(LOCK_EX)`` behind the lock object the ledger used before
  (its ledger class replaces the lock, so its pools call it, never inline)
  (no bound on the wait, no holder pid), every grant to the ledger, refunds
  batched below 64 MiB as the seed does;
* ``ofd-no-recycle`` — the lock the ledger used before: an OFD byte-range lock
  on byte 0 (blocking), every grant to the ledger. It shows where the time
  went: the kernel's POSIX-lock path costs more than flock's per call.

Patterns: ``pair`` and ``growshrink`` (32 grants of 2 MiB, then 32 refunds:
every grant must go to the ledger, in every variant).

Speed is a ratio against ``flock`` measured in the same round; the figures
are the medians of those per-round ratios (and of pairs/s), with every round
kept in the file and the load average before and after. The top-level targets:
``no_recycle_vs_flock`` (``ledger-no-recycle`` on the ``pair`` pattern, the
worst of 1, 2 and 4 processes) and ``growshrink_vs_flock`` (``ledger`` on the
``growshrink`` pattern, the worst of 1, 2 and 4 processes). The latency of one
pair (p50/p99) is timed pair by pair in the one-process runs.
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
import threading
import time

import _provenance
from kvcached.ledger import Ledger, PoolBudget, _hooks
from kvcached.ledger.layout import H_JOURNAL
from kvcached.ledger.locks import ByteLock
from kvcached.units import MIB

PAGE = 2 * MIB
VARIANTS = ("ledger", "ledger-no-recycle", "flock", "ofd-no-recycle")
PATTERNS = ("pair", "growshrink")
COUNTS = (1, 2, 4)


class Device:
    def mem_info(self) -> tuple[int, int]:
        return 1 << 50, 1 << 50


class WholeFileFlock:
    """The seed's data lock: a blocking ``flock(LOCK_EX)`` on the whole file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def acquire(self, wait: bool = True) -> bool:
        fcntl.flock(self.fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class LockObjectLedger(Ledger):
    """The ledger with the data-lock wrapper it had before (a lock object in
    ``_data``, waited for without a bound), over the lock :meth:`make_lock` gives."""

    def __init__(self, lfile, sampler=None) -> None:
        super().__init__(lfile, sampler)
        self._data = self.make_lock()
        self._tlock = threading.Lock()

    def make_lock(self):
        raise NotImplementedError

    def _lock_data(self, timeout: float | None = None) -> None:
        self._tlock.acquire()
        try:
            self._data.acquire()
        except BaseException:
            self._tlock.release()
            raise
        if self.u64[H_JOURNAL]:
            self.journal.replay()
        if _hooks.point is not None:
            _hooks.point("data-locked")

    def _unlock_data(self) -> None:
        if _hooks.point is not None:
            _hooks.point("data-unlocking")
        try:
            self._data.release()
        finally:
            self._tlock.release()

    # A pool's grants take the one shared lock too (the shipped ledger takes it
    # through the pool's own descriptor, without the thread lock): the same
    # body as above, so the baseline's grant path has the frames it had before.
    def lock_fd(self, fd: int, timeout: float | None = None) -> None:
        self._tlock.acquire()
        try:
            self._data.acquire()
        except BaseException:
            self._tlock.release()
            raise
        if self.u64[H_JOURNAL]:
            self.journal.replay()
        if _hooks.point is not None:
            _hooks.point("data-locked")

    def unlock_fd(self, fd: int) -> None:
        if _hooks.point is not None:
            _hooks.point("data-unlocking")
        try:
            self._data.release()
        finally:
            self._tlock.release()


class NoRecyclePool(PoolBudget):
    """Every grant to the ledger: the shipped pool without its batch re-use."""

    def grant(self, nbytes: int) -> bool:
        with self._lock:
            return self._grant_locked(nbytes)


class NoRecycleLedger(Ledger):
    pool_class = NoRecyclePool


class SeedFlockLedger(LockObjectLedger):
    pool_class = NoRecyclePool

    def make_lock(self):
        return WholeFileFlock(self.file.fd)


class OfdLedger(LockObjectLedger):
    pool_class = NoRecyclePool

    def make_lock(self):
        return ByteLock(self.file.fd, 0, "the former OFD data lock")


# Each variant's pools are made as their own class by register_pool (assigning
# __class__ afterwards would de-optimise attribute access by ~25% in CPython 3.11).
LEDGERS = {
    "ledger": Ledger,
    "ledger-no-recycle": NoRecycleLedger,
    "flock": SeedFlockLedger,
    "ofd-no-recycle": OfdLedger,
}


def worker(
    directory: str, variant: str, pattern: str, seconds: float, timed: bool, barrier, queue
) -> None:
    ledger = LEDGERS[variant].open("bench-0", Device(), directory=directory, gpu_utilization=0.9)
    pool = ledger.register_pool(f"bench-{os.getpid()}")
    grant, refund = pool.grant, pool.refund
    for _ in range(2000):  # warm up
        if grant(PAGE):
            refund(PAGE)
    lat: list[int] = []
    barrier.wait()
    clock = time.perf_counter_ns
    cpu0 = time.process_time()
    end = clock() + int(seconds * 1e9)
    pairs = 0
    misses = 0
    if pattern == "growshrink":  # 32 pages up, 32 down: every grant goes to the ledger
        while clock() < end:
            up = 0
            for _ in range(32):
                if grant(PAGE):
                    up += 1
                else:  # the data lock stayed held past the bound: a miss (see misses)
                    misses += 1
            for _ in range(up):
                refund(PAGE)
            pairs += up
    elif timed:
        append = lat.append
        while True:
            t0 = clock()
            if grant(PAGE):
                refund(PAGE)
                pairs += 1
            else:
                misses += 1
            t1 = clock()
            append(t1 - t0)
            if t1 >= end:
                break
    else:
        while clock() < end:
            for _ in range(64):
                if grant(PAGE):
                    refund(PAGE)
                    pairs += 1
                else:
                    misses += 1
    cpu = time.process_time() - cpu0
    pool.close()
    ledger.close()
    queue.put((pairs, lat, cpu, misses))


def run(variant: str, pattern: str, procs: int, seconds: float) -> dict:
    directory = tempfile.mkdtemp(prefix="kvcached-bench-", dir="/dev/shm")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    queue = ctx.Queue()
    timed = procs == 1
    ps = [
        ctx.Process(
            target=worker, args=(directory, variant, pattern, seconds, timed, barrier, queue)
        )
        for _ in range(procs)
    ]
    for p in ps:
        p.start()
    results = [queue.get(timeout=seconds * 10 + 60) for _ in ps]
    for p in ps:
        p.join()
        assert p.exitcode == 0, f"{variant} worker exited with {p.exitcode}"
    shutil.rmtree(directory)
    # pairs_per_cpu_s: pairs per second of CPU the processes used (what a pair costs,
    # less sensitive than wall time to the other load of a shared machine)
    out = {
        "pairs_per_s": sum(r[0] for r in results) / seconds,
        "pairs_per_cpu_s": sum(r[0] for r in results) / max(1e-9, sum(r[2] for r in results)),
        "misses": sum(r[3] for r in results),
    }
    lat = sorted(x for r in results for x in r[1])
    if lat:
        out["p50_us"] = lat[len(lat) // 2] / 1e3
        out["p99_us"] = lat[int(len(lat) * 0.99)] / 1e3
    return out


def profile(repeats: int = 9, n: int = 20000) -> dict:
    """Where one grant+refund pair's time goes, in one process: the CPU time
    (``thread_time``, ns per operation, median of ``repeats`` interleaved
    repeats) of each part, the lock primitives alone and the whole pair."""
    import struct
    import threading

    directory = tempfile.mkdtemp(prefix="kvcached-bench-", dir="/dev/shm")
    ledgers = {}
    for name, cls in (("ledger", NoRecycleLedger), ("flock", SeedFlockLedger), ("ofd", OfdLedger)):
        os.makedirs(os.path.join(directory, name))
        ledgers[name] = cls.open(
            "bench-0", Device(), directory=os.path.join(directory, name), gpu_utilization=0.9
        )
    pools = {name: led.register_pool("profile") for name, led in ledgers.items()}
    led = ledgers["ledger"]
    fd = led.file.fd
    flock, ex, un = fcntl.flock, fcntl.LOCK_EX | fcntl.LOCK_NB, fcntl.LOCK_UN
    ofd_struct = struct.Struct("hhqqi4x")
    lk, ul = ofd_struct.pack(fcntl.F_WRLCK, 0, 0, 1, 0), ofd_struct.pack(fcntl.F_UNLCK, 0, 0, 1, 0)
    fcntl_ = fcntl.fcntl
    tlock = threading.Lock()
    charges, u32 = led.charges, led.u32
    from kvcached.ledger.layout import H_HIGH_WATER

    def loop(body):
        def run_it():
            t0 = time.thread_time_ns()
            for _ in range(n):
                body()
            return (time.thread_time_ns() - t0) / n

        return run_it

    def pair(p):
        g, r = p.grant, p.refund
        return lambda: (g(PAGE), r(PAGE))

    def wrapper(x, p):
        lock, unlock, pfd = x.lock_fd, x.unlock_fd, p._fd  # what a grant takes
        return lambda: (lock(pfd, 0.5), unlock(pfd))

    parts = {
        "python_call_of_nothing": loop(lambda: None),
        "flock_lock_unlock": loop(lambda: (flock(fd, ex), flock(fd, un))),
        "ofd_lock_unlock": loop(lambda: (fcntl_(fd, 38, lk), fcntl_(fd, 38, ul))),
        "threading_lock_pair": loop(lambda: (tlock.acquire(False), tlock.release())),
        "sum_of_charges": loop(lambda: sum(charges[: u32[H_HIGH_WATER]])),
        "ledger_data_lock_pair": loop(wrapper(ledgers["ledger"], pools["ledger"])),
        "flock_baseline_data_lock_pair": loop(wrapper(ledgers["flock"], pools["flock"])),
        "ofd_former_data_lock_pair": loop(wrapper(ledgers["ofd"], pools["ofd"])),
        "ledger_no_recycle_grant_refund": loop(pair(pools["ledger"])),
        "flock_baseline_grant_refund": loop(pair(pools["flock"])),
        "ofd_former_grant_refund": loop(pair(pools["ofd"])),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    names = list(parts)
    for rep in range(repeats):
        for k in names if rep % 2 == 0 else reversed(names):
            times[k].append(parts[k]())
    for p in pools.values():
        p.close()
    for x in ledgers.values():
        x.close()
    shutil.rmtree(directory)
    out = {k: round(statistics.median(v)) for k, v in times.items()}
    out["note"] = (
        "CPU ns per operation (thread_time), one process; a *_pair is one lock "
        "and one unlock; the grant_refund figures include the refund batching"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "ledger-host.json"
        ),
    )
    args = parser.parse_args()

    prov = _provenance.start()
    load_before = os.getloadavg()
    where = profile()
    print("profile (CPU ns):", json.dumps(where), flush=True)
    samples = {(v, p, n): [] for v in VARIANTS for p in PATTERNS for n in COUNTS}
    loads = []
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        for pattern in PATTERNS:
            for n in COUNTS:
                for variant in order:
                    r = run(variant, pattern, n, args.seconds)
                    samples[variant, pattern, n].append(r)
                    extra = (
                        f"  p50 {r['p50_us']:.2f} us  p99 {r['p99_us']:.2f} us"
                        if "p50_us" in r
                        else ""
                    )
                    print(
                        f"round {rnd} {pattern:10s} {variant:18s} procs={n}: "
                        f"{r['pairs_per_s']:>11,.0f} pairs/s{extra}",
                        flush=True,
                    )
        loads.append(os.getloadavg()[0])

    def med(variant: str, pattern: str, n: int, key: str) -> float:
        return statistics.median(s[key] for s in samples[variant, pattern, n])

    def ratios(variant: str, pattern: str, n: int, key: str = "pairs_per_s") -> list[float]:
        """Per-round ratio against flock in the same round."""
        return [
            a[key] / b[key]
            for a, b in zip(samples[variant, pattern, n], samples["flock", pattern, n], strict=True)
        ]

    def summary(pattern: str) -> dict:
        per = {}
        for v in VARIANTS:
            per[v] = {
                "pairs_per_s": {str(n): round(med(v, pattern, n, "pairs_per_s")) for n in COUNTS},
                "vs_flock": {
                    str(n): round(statistics.median(ratios(v, pattern, n)), 3) for n in COUNTS
                },
                "rounds_vs_flock": {
                    str(n): [round(x, 3) for x in ratios(v, pattern, n)] for n in COUNTS
                },
                "cpu_vs_flock": {
                    str(n): round(statistics.median(ratios(v, pattern, n, "pairs_per_cpu_s")), 3)
                    for n in COUNTS
                },
                "pairs_per_cpu_s": {
                    str(n): round(med(v, pattern, n, "pairs_per_cpu_s")) for n in COUNTS
                },
                "misses": {
                    str(n): sum(s["misses"] for s in samples[v, pattern, n]) for n in COUNTS
                },
                "rounds_pairs_per_s": {
                    str(n): [round(s["pairs_per_s"]) for s in samples[v, pattern, n]]
                    for n in COUNTS
                },
            }
            if pattern == "pair":
                per[v]["pair_p50_us"] = round(med(v, pattern, 1, "p50_us"), 2)
                per[v]["pair_p99_us"] = round(med(v, pattern, 1, "p99_us"), 2)
        return {"variants": per}

    pair, grow = summary("pair"), summary("growshrink")
    no_recycle = pair["variants"]["ledger-no-recycle"]["vs_flock"]
    growshrink = grow["variants"]["ledger"]["vs_flock"]
    ofd = pair["variants"]["ofd-no-recycle"]["vs_flock"]
    no_recycle_cpu = pair["variants"]["ledger-no-recycle"]["cpu_vs_flock"]
    growshrink_cpu = grow["variants"]["ledger"]["cpu_vs_flock"]
    result = {
        "benchmark": "ledger grant+refund pairs (2 MiB pages), one pool per process, one "
        "ledger file in /dev/shm; pairs/s summed over the processes",
        "command": "python benchmarks/ledger.py " + " ".join(sys.argv[1:]),
        "commit": _provenance.commit_label(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "node": platform.node(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "load_average_1min_per_round": [round(x, 2) for x in loads],
        },
        "seconds_per_run": args.seconds,
        "rounds": args.rounds,
        "no_recycle_vs_flock": min(no_recycle.values()),
        "no_recycle_vs_flock_by_procs": no_recycle,
        "growshrink_vs_flock": min(growshrink.values()),
        "growshrink_vs_flock_by_procs": growshrink,
        "ofd_no_recycle_vs_flock_by_procs": ofd,
        "no_recycle_cpu_vs_flock_by_procs": no_recycle_cpu,
        "growshrink_cpu_vs_flock_by_procs": growshrink_cpu,
        "ofd_no_recycle_cpu_vs_flock_by_procs": pair["variants"]["ofd-no-recycle"]["cpu_vs_flock"],
        "pair_p50_us": pair["variants"]["ledger"]["pair_p50_us"],
        "pair_p99_us": pair["variants"]["ledger"]["pair_p99_us"],
        "pairs_per_s": pair["variants"]["ledger"]["pairs_per_s"],
        "speedup_vs_flock": pair["variants"]["ledger"]["vs_flock"],
        "baseline": "flock: the seed PR's design on the same accounting code: a blocking "
        "whole-file fcntl.flock(LOCK_EX) behind the former lock-object wrapper, "
        "every grant to the ledger, refunds batched below 64 MiB as the seed does",
        "variants": {
            "ledger": "as shipped: non-blocking whole-file flock data lock (bounded poll "
            "when busy, holder pid recorded), refunds batched below 64 MiB, grants "
            "within the batch re-use it without the lock",
            "ledger-no-recycle": "as shipped, every grant to the ledger: the baseline's work",
            "flock": "the baseline",
            "ofd-no-recycle": "the former data lock (OFD byte-range lock on byte 0, "
            "blocking), every grant to the ledger",
        },
        "patterns": {
            "pair": "grant(2 MiB) then refund(2 MiB), repeated",
            "growshrink": "32 grants of 2 MiB then 32 refunds: every grant needs the ledger",
        },
        "ratios": "median over rounds of (variant pairs/s) / (flock pairs/s) in the same "
        "round (wall clock: throughput); *_cpu_*: the same with pairs per CPU "
        "second of the processes (cost per pair); the targets take the worst of "
        "1, 2 and 4 processes",
        "profile_cpu_ns": where,
        "pair": pair,
        "growshrink": grow,
    }
    _provenance.write_result(args.out, result, prov)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "no_recycle_vs_flock",
                    "no_recycle_vs_flock_by_procs",
                    "growshrink_vs_flock",
                    "growshrink_vs_flock_by_procs",
                    "ofd_no_recycle_vs_flock_by_procs",
                    "no_recycle_cpu_vs_flock_by_procs",
                    "growshrink_cpu_vs_flock_by_procs",
                    "pair_p50_us",
                    "speedup_vs_flock",
                )
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
