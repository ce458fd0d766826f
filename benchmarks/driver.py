"""Per-call cost of a kvcached driver backend against a raw loop, in one run.

For each handle size (2 MiB and 64 MiB) the page life
``create -> map -> set_access -> unmap -> release`` is timed call by call,
through kvcached's backend and through a raw loop that makes the same driver
calls with nothing around them:

* ``--backend cuda``: the raw loop calls libcuda.so.1 through ``ctypes`` with
  argument structs built once (``cuMemCreate``, ``cuMemMap``,
  ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``), on the same primary
  context.
* ``--backend host``: the raw loop is ``os.memfd_create`` + ``posix_fallocate``
  (create), libc ``mmap(MAP_FIXED|MAP_SHARED)`` (map), nothing (set_access: the
  host backend maps read-write at map and only checks the range here), an
  anonymous read-only ``mmap`` over the range (unmap, as the backend does) and
  ``close`` (release).

The two loops alternate in rounds (kvcached first in even rounds, raw first in
odd ones) so that drift in clocks or load falls on both alike. Garbage
collection is off while timing. Output: JSON with ``kvcached_us`` and
``raw_us`` (p50 and mean per call, per size, plus the per-page total),
``overhead_ratio`` (kvcached's per-page total over raw's, 2 MiB, p50 of
per-iteration totals) and the environment.

    python benchmarks/driver.py --backend host
    python benchmarks/driver.py --backend cuda --iters 2000
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import _provenance
from kvcached.driver import _libc, make_driver
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent

CALLS = ("create", "map", "set_access", "unmap", "release")
SIZES = {"2MiB": 2 * MIB, "64MiB": 64 * MIB}
DEFAULT_OUT = {
    "cuda": "benchmarks/results/driver-h200.json",
    "host": "benchmarks/results/driver-host.json",
}
now = time.perf_counter_ns


# -- the loops -------------------------------------------------------------------------------
class KvcachedLoop:
    """The page life through a kvcached driver object."""

    def __init__(self, driver, size: int) -> None:
        self.driver = driver
        self.size = size
        self.va = driver.reserve(size)

    def run(self, iters: int, samples: list[list[int]]) -> None:
        d, size, va = self.driver, self.size, self.va
        create, map_, access, unmap, release = d.create, d.map, d.set_access, d.unmap, d.release
        for _ in range(iters):
            t0 = now()
            h = create(size)
            t1 = now()
            map_(va, size, h)
            t2 = now()
            access(va, size)
            t3 = now()
            unmap(va, size)
            t4 = now()
            release(h)
            t5 = now()
            samples.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])

    def close(self) -> None:
        self.driver.free_reservation(self.va, self.size)


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Loc),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


class RawCudaLoop:
    """The same five calls straight into libcuda.so.1 through ctypes."""

    def __init__(self, index: int, size: int) -> None:
        u64, sz = ctypes.c_ulonglong, ctypes.c_size_t
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        self._check("cuInit", lib.cuInit(0))
        dev, ctx, cur = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), index))
        self._check(
            "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        )
        self._check("cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(cur)))
        if not cur.value:
            self._check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
        self.prop = _Prop(type=1, requestedHandleTypes=0, location=_Loc(1, index))  # PINNED, DEVICE
        self.access = _Access(location=_Loc(1, index), flags=3)  # READWRITE
        gran = sz()
        self._check(
            "cuMemGetAllocationGranularity",
            lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0),
        )
        self.size = size
        va = u64()
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), sz, sz, u64, u64]
        self._check(
            "cuMemAddressReserve", lib.cuMemAddressReserve(ctypes.byref(va), size, gran.value, 0, 0)
        )
        self.va = va.value
        self.create = lib.cuMemCreate
        self.create.argtypes = [ctypes.POINTER(u64), sz, ctypes.POINTER(_Prop), u64]
        self.map = lib.cuMemMap
        self.map.argtypes = [u64, sz, sz, u64, u64]
        self.set_access = lib.cuMemSetAccess
        self.set_access.argtypes = [u64, sz, ctypes.POINTER(_Access), sz]
        self.unmap = lib.cuMemUnmap
        self.unmap.argtypes = [u64, sz]
        self.release = lib.cuMemRelease
        self.release.argtypes = [u64]
        lib.cuMemAddressFree.argtypes = [u64, sz]

    @staticmethod
    def _check(call: str, rc: int) -> None:
        if rc:
            raise RuntimeError(f"{call} failed: CUresult {rc}")

    def run(self, iters: int, samples: list[list[int]]) -> None:
        size, va = self.size, self.va
        create, map_, access, unmap, release = (
            self.create,
            self.map,
            self.set_access,
            self.unmap,
            self.release,
        )
        handle = ctypes.c_ulonglong()
        p_handle, p_prop, p_access = (
            ctypes.byref(handle),
            ctypes.byref(self.prop),
            ctypes.byref(self.access),
        )
        check = self._check
        for _ in range(iters):
            t0 = now()
            rc = create(p_handle, size, p_prop, 0)
            if rc:
                check("cuMemCreate", rc)
            h = handle.value
            t1 = now()
            rc = map_(va, size, 0, h, 0)
            if rc:
                check("cuMemMap", rc)
            t2 = now()
            rc = access(va, size, p_access, 1)
            if rc:
                check("cuMemSetAccess", rc)
            t3 = now()
            rc = unmap(va, size)
            if rc:
                check("cuMemUnmap", rc)
            t4 = now()
            rc = release(h)
            if rc:
                check("cuMemRelease", rc)
            t5 = now()
            samples.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])

    def close(self) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(self.va, self.size))


class RawHostLoop:
    """The host backend's system calls with nothing around them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.va = _libc.mmap(
            None,
            size,
            _libc.PROT_NONE,
            _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_NORESERVE,
        )

    def run(self, iters: int, samples: list[list[int]]) -> None:
        size, va = self.size, self.va
        mmap = _libc._mmap  # the raw libc symbol, as a C caller would use it
        rw, shared_fixed = _libc.PROT_READ | _libc.PROT_WRITE, _libc.MAP_SHARED | _libc.MAP_FIXED
        zero_flags = _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED | _libc.MAP_NORESERVE
        memfd_create, fallocate, close = os.memfd_create, os.posix_fallocate, os.close
        for _ in range(iters):
            t0 = now()
            fd = memfd_create("kvcached-bench-raw", os.MFD_CLOEXEC)
            fallocate(fd, 0, size)
            t1 = now()
            if mmap(va, size, rw, shared_fixed, fd, 0) != va:
                raise OSError(ctypes.get_errno(), "mmap failed")
            t2 = now()
            t3 = now()  # set_access: nothing to do on the host
            if mmap(va, size, _libc.PROT_READ, zero_flags, -1, 0) != va:
                raise OSError(ctypes.get_errno(), "mmap failed")
            t4 = now()
            close(fd)
            t5 = now()
            samples.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])

    def close(self) -> None:
        _libc.munmap(self.va, self.size)


# -- statistics and environment -------------------------------------------------------------
def summarize(samples: list[list[int]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, call in enumerate((*CALLS, "total")):
        values = [sum(s) for s in samples] if call == "total" else [s[i] for s in samples]
        out[call] = {
            "p50": round(statistics.median(values) / 1000, 3),
            "mean": round(statistics.fmean(values) / 1000, 3),
        }
    return out


def environment(driver) -> dict:
    import torch

    import kvcached

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "kvcached": kvcached.__version__,
        "device": driver.info().as_dict(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        from importlib.metadata import version

        env["cuda_bindings"] = version("cuda-bindings")
    except Exception:  # not installed: only the host backend runs then
        env["cuda_bindings"] = None
    if driver.backend == "cuda":
        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            env["cuda_driver_version"] = v.value
    env["git_commit"] = _provenance.commit()[0]
    return env


# -- main ------------------------------------------------------------------------------------
def measure(backend: str, driver, size: int, iters: int, rounds: int, warmup: int):
    ours = KvcachedLoop(driver, size)
    raw = RawCudaLoop(driver.index, size) if backend == "cuda" else RawHostLoop(size)
    ours_samples: list[list[int]] = []
    raw_samples: list[list[int]] = []
    try:
        ours.run(warmup, [])
        raw.run(warmup, [])
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                order = ((ours, ours_samples), (raw, raw_samples))
                for loop, samples in order if r % 2 == 0 else order[::-1]:
                    loop.run(iters, samples)
        finally:
            gc.enable()
    finally:
        ours.close()
        raw.close()
    return summarize(ours_samples), summarize(raw_samples), len(ours_samples)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument(
        "--iters",
        type=int,
        default=500,
        help="page lives per round and loop for 2 MiB handles (64 MiB: a 1/8)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10)")
    parser.add_argument("--device", type=int, default=0, help="device index (default 0)")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: " + ", ".join(f"{b}: {p}" for b, p in DEFAULT_OUT.items()) + ")",
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.rounds < 1:
        parser.error("--iters and --rounds must be at least 1")
    prov = _provenance.start(argv)
    from kvcached.config import get_config

    driver = make_driver(args.backend, args.device, config=get_config())
    result: dict = {
        "benchmark": "driver",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "backend": args.backend,
        "raw_baseline": (
            "ctypes calls into libcuda.so.1 with prebuilt argument structs"
            if args.backend == "cuda"
            else "os.memfd_create+posix_fallocate / libc mmap / close, no bookkeeping"
        ),
        "environment": environment(driver),
        "rounds": args.rounds,
        "iterations": {},
        "kvcached_us": {},
        "raw_us": {},
    }
    for label, size in SIZES.items():
        iters = args.iters if size == 2 * MIB else max(1, args.iters // 8)
        ours, raw, n = measure(
            args.backend, driver, size, iters, args.rounds, warmup=min(iters, 20)
        )
        result["iterations"][label] = n
        result["kvcached_us"][label] = ours
        result["raw_us"][label] = raw
        print(
            f"{label}: kvcached total p50 {ours['total']['p50']:.2f} us, raw "
            f"{raw['total']['p50']:.2f} us ({n} page lives each)",
            flush=True,
        )
    for label in SIZES:
        ours, raw = result["kvcached_us"][label]["total"], result["raw_us"][label]["total"]
        suffix = "" if label == "2MiB" else f"_{label}"
        result["overhead_ratio" + suffix] = round(ours["p50"] / raw["p50"], 4)
        result["overhead_ratio_mean" + suffix] = round(ours["mean"] / raw["mean"], 4)
    out = _provenance.write_result(args.out or ROOT / DEFAULT_OUT[args.backend], result, prov)
    print(
        f"overhead_ratio (2 MiB, p50 of per-page totals): {result['overhead_ratio']:.4f}; "
        f"wrote {out}"
    )
    return result


if __name__ == "__main__":
    main()
