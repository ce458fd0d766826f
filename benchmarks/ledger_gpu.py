"""Several processes fill one GPU through one ledger: no CUDA OOM, and the ledger
agrees with the driver.

    python benchmarks/ledger_gpu.py [--procs 2 4] [--seconds 60] [--out $OUT/ledger-gpu.json]
    python benchmarks/ledger_gpu.py --backend host --host-capacity 2G --seconds 10   # CPU dry run

For each process count, N worker processes (spawned, each with its own CUDA
context) register a pool on the device's ledger and run its calibrator against
``cuMemGetInfo``. Each worker grows through the driver (``grant`` -> create ->
map -> set_access, handles of 2, 32 and 64 MiB) until the ledger denies a
grant, then releases a random 30-70% of what it holds (unmap -> release ->
refund) and grows again, for ``--seconds``. The GPU is thus driven to "nearly
full" (total minus the safety margin) over and over, by every process at once.

Counted and checked:

* CUDA out-of-memory errors from create/map/set_access (must be 0): a grant the
  ledger gave that the device could not back;
* the supervisor samples ``cuMemGetInfo`` and the ledger every 20 ms;
  ``used - used_at_start - (charged - released)`` must stay within the safety
  margin (``used_at_start`` is taken after every worker's CUDA context exists,
  before any KV memory; ``released`` is memory released whose refund is still
  batched). What remains is grants between the ledger and the driver call, and
  the time between the two reads;
* at the end every pool is closed and the ledger charges 0.

Writes a JSON report (and a log of every sample) under ``--out``'s directory.
Uses only the standard library, torch, cuda-python and kvcached (no posix-ipc).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import threading
import time

import _provenance

MIB = 1 << 20
SLOT = 64 * MIB
SIZES = (2 * MIB, 2 * MIB, 2 * MIB, 32 * MIB, 64 * MIB)


def make_driver(args):
    if args.backend == "host":
        from kvcached.driver.host import HostDriver
        from kvcached.units import parse_size

        return HostDriver(args.device, capacity=parse_size(args.host_capacity))
    from kvcached.driver import make_driver as make

    return make(args.backend, args.device)


def worker(rank: int, args, directory: str, ready, go, queue) -> None:
    from kvcached.errors import DriverError, OutOfPhysicalMemoryError
    from kvcached.ledger import Calibrator, Ledger

    stats = {
        "rank": rank,
        "pid": os.getpid(),
        "grants": 0,
        "denials": 0,
        "creates": 0,
        "releases": 0,
        "oom": 0,
        "oom_calls": [],
        "driver_errors": [],
        "phases": 0,
        "peak_held": 0,
    }
    driver = make_driver(args)
    info = driver.info()
    ledger = Ledger.open(
        info.pci_bus_id, driver, directory=directory, gpu_utilization=args.gpu_utilization
    )
    pool = ledger.register_pool(f"gpu-bench-{rank % 2}")
    calibrator = Calibrator(ledger, driver, interval_s=args.calibration_interval)
    # Every handle takes a whole 64 MiB slot, so a worker of small handles needs far
    # more slots than total // SLOT to fill the device; address space is cheap.
    nslots = 32 * (info.total_bytes // SLOT)
    va = driver.reserve(nslots * SLOT)
    free_slots = list(range(nslots))
    held: dict[int, tuple[object, int]] = {}
    rng = random.Random(rank)
    held_bytes = 0

    def release(slot: int) -> None:
        nonlocal held_bytes
        handle, size = held.pop(slot)
        addr = va + slot * SLOT
        driver.synchronize()
        driver.unmap(addr, size)
        driver.release(handle)
        pool.refund(size)  # only after the release is confirmed
        held_bytes -= size
        free_slots.append(slot)
        stats["releases"] += 1

    ready.wait()
    go.wait()
    calibrator.start()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        size = rng.choice(SIZES)
        if not free_slots:
            raise RuntimeError(f"worker {rank} ran out of address-space slots ({nslots})")
        if not pool.grant(size):
            stats["denials"] += 1
            stats["phases"] += 1
            if held:
                for slot in rng.sample(list(held), max(1, int(len(held) * rng.uniform(0.3, 0.7)))):
                    release(slot)
            else:
                time.sleep(0.01)  # others hold the device; wait for a calibration
            continue
        stats["grants"] += 1
        slot = free_slots.pop()
        addr = va + slot * SLOT
        handle = mapped = None
        try:
            handle = driver.create(size)
            driver.map(addr, size, handle)
            mapped = True
            driver.set_access(addr, size)
        except OutOfPhysicalMemoryError as exc:
            stats["oom"] += 1
            stats["oom_calls"].append(f"{exc.call} size={size} held={held_bytes}")
            if mapped:
                driver.unmap(addr, size)
            if handle is not None:
                driver.release(handle)
            pool.refund(size)  # nothing stays allocated: give the grant back
            free_slots.append(slot)
            continue
        except DriverError as exc:
            stats["driver_errors"].append(str(exc))
            raise
        stats["creates"] += 1
        held[slot] = (handle, size)
        held_bytes += size
        stats["peak_held"] = max(stats["peak_held"], held_bytes)
    calibrator.stop()
    for slot in list(held):
        release(slot)
    stats["calibrations_published"] = calibrator.published
    pool.close()
    ledger.close()
    driver.free_reservation(va, nslots * SLOT)
    queue.put(stats)


def run(args, procs: int, log) -> dict:
    from kvcached.ledger import Ledger

    directory = tempfile.mkdtemp(prefix="kvcached-ledger-gpu-", dir="/dev/shm")
    driver = make_driver(args)
    info = driver.info()
    ctx = mp.get_context("spawn")  # a CUDA context does not survive fork
    ready, go, queue = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1), ctx.Queue()
    ps = [
        ctx.Process(target=worker, args=(r, args, directory, ready, go, queue))
        for r in range(procs)
    ]
    for p in ps:
        p.start()
    ready.wait(timeout=300)
    ledger = Ledger.open(
        info.pci_bus_id, driver, directory=directory, gpu_utilization=args.gpu_utilization
    )
    free0, total = driver.mem_info()
    used0 = total - free0  # every context exists, no KV memory yet
    ledger.calibrate(driver)
    margin = ledger.safety_margin
    samples = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            free, _ = driver.mem_info()
            snap = ledger.snapshot()
            used = total - free - used0
            # charged - released: what the ledger says is allocated now (released
            # memory whose refund is still batched is free on the device already)
            samples.append(
                (
                    time.monotonic(),
                    used,
                    snap.header.charged - snap.header.released,
                    snap.header.budget,
                )
            )

    sampler = threading.Thread(target=sample, daemon=True)
    go.wait(timeout=300)
    t0 = time.monotonic()
    sampler.start()
    results = [queue.get(timeout=args.seconds + 600) for _ in ps]
    stop.set()
    sampler.join()
    for p in ps:
        p.join(60)
    final = ledger.snapshot()
    ledger.close()
    shutil.rmtree(directory, ignore_errors=True)
    diffs = [used - charged for _, used, charged, _ in samples]
    for t, used, charged, budget in samples:
        log.write(
            f"{procs} {t - t0:.3f} used={used} charged-released={charged} "
            f"budget={budget} diff={used - charged}\n"
        )
    report = {
        "procs": procs,
        "device": info.as_dict(),
        "seconds": args.seconds,
        "safety_margin": margin,
        "used_at_start": used0,
        "oom_errors": sum(r["oom"] for r in results),
        "oom_calls": [c for r in results for c in r["oom_calls"]][:20],
        "grants": sum(r["grants"] for r in results),
        "denials": sum(r["denials"] for r in results),
        "creates": sum(r["creates"] for r in results),
        "releases": sum(r["releases"] for r in results),
        "fill_phases": sum(r["phases"] for r in results),
        "calibrations_published": sum(r["calibrations_published"] for r in results),
        "samples": len(samples),
        "peak_used": max((s[1] for s in samples), default=0),
        "peak_charged_minus_released": max((s[2] for s in samples), default=0),
        "peak_fill_of_total": round(max((s[1] + used0 for s in samples), default=0) / total, 4),
        "max_used_minus_ledger": max(diffs, default=0),
        "min_used_minus_ledger": min(diffs, default=0),
        "agree_within_margin": all(abs(d) <= margin for d in diffs),
        "final_charged": final.header.charged,
        "final_pools": len(final.pools),
        "exit_codes": [p.exitcode for p in ps],
        "workers": results,
    }
    report["ok"] = (
        report["oom_errors"] == 0
        and report["agree_within_margin"]
        and report["final_charged"] == 0
        and report["final_pools"] == 0
        and all(c == 0 for c in report["exit_codes"])
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--backend", default="cuda", choices=["cuda", "hip", "host"])
    parser.add_argument("--host-capacity", default="2G", help="host backend only")
    parser.add_argument("--gpu-utilization", type=float, default=0.95)
    parser.add_argument("--calibration-interval", type=float, default=0.1)
    out_dir = os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"
    )
    parser.add_argument("--out", default=os.path.join(out_dir, "ledger-gpu.json"))
    args = parser.parse_args()
    prov = _provenance.start()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    log_path = os.path.splitext(args.out)[0] + ".log"
    reports = []
    with open(log_path, "w") as log:
        for procs in args.procs:
            report = run(args, procs, log)
            reports.append(report)
            print(
                json.dumps({k: v for k, v in report.items() if k not in ("workers", "device")}),
                flush=True,
            )
    result = {
        "command": "python benchmarks/ledger_gpu.py " + " ".join(sys.argv[1:]),
        "ok": all(r["ok"] for r in reports),
        "runs": reports,
    }
    _provenance.write_result(args.out, result, prov)
    print(("PASS" if result["ok"] else "FAIL") + f": {args.out}, samples in {log_path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
