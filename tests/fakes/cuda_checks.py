"""Checks of kvcached's cuda backend against tests/fakes/fake_libcuda.c.

Run by tests/test_driver_cuda.py in a subprocess whose LD_LIBRARY_PATH puts
the fake libcuda.so.1 first (a process that has loaded a libcuda keeps it, so
the pytest process itself must not). Each check prints ``ok <name>``; any
failure raises, prints a traceback and exits non-zero.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from cuda.bindings import driver as cu

from kvcached.driver.cuda import CudaDriver
from kvcached.driver.faulty import FaultyDriver
from kvcached.errors import (
    ConfigError,
    DriverError,
    DriverUnavailableError,
    MappingError,
    OutOfPhysicalMemoryError,
)

MIB = 1 << 20
G = 2 * MIB
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_counter.restype = ctypes.c_long
fake.fake_cuda_counter.argtypes = [ctypes.c_char_p]


def counter(name: str) -> int:
    return fake.fake_cuda_counter(name.encode())


def raises(kind, fn, *args, match: str = ""):
    try:
        fn(*args)
    except kind as exc:
        assert match in str(exc), f"{match!r} not in {exc}"
        return exc
    raise AssertionError(f"{fn.__name__}{args} did not raise {kind.__name__}")


def check_identity(d: CudaDriver) -> None:
    info = d.info()
    assert info.backend == "cuda" and info.index == 1, info
    assert info.name == "Fake CUDA Device 1", info
    assert info.pci_bus_id == "00000000:1A:00.0", info
    assert info.total_bytes == 1 << 30 and info.granularity == G == d.granularity, info
    assert str(d.torch_device) == "cuda:1"
    assert d.mem_info() == (1 << 30, 1 << 30)


def check_pages_keep_their_data(d: CudaDriver) -> None:
    va = d.reserve(8 * G)
    handles = [d.create(G) for _ in range(3)]
    for i, h in enumerate(handles):
        d.map(va + i * G, G, h)
    d.set_access(va, 3 * G)  # one call over three adjacent mappings
    for i in range(3):
        ctypes.memset(va + i * G, 0x10 + i, G)
    d.unmap(va + G, G)
    d.release(handles[1])
    h = d.create(2 * G)  # a bigger handle where the middle page was, plus one free page
    raises(DriverError, d.map, va + G, 2 * G, h, match="cuMemMap")  # overlaps page 2
    d.map(va + 3 * G, 2 * G, h)
    d.set_access(va + 3 * G, 2 * G)
    ctypes.memset(va + 3 * G, 0x33, 2 * G)
    assert ctypes.string_at(va, 4) == b"\x10" * 4
    assert ctypes.string_at(va + 2 * G + G - 4, 4) == b"\x12" * 4
    assert ctypes.string_at(va + 5 * G - 4, 4) == b"\x33" * 4
    for start, size, handle in (
        (va, G, handles[0]),
        (va + 2 * G, G, handles[2]),
        (va + 3 * G, 2 * G, h),
    ):
        d.unmap(start, size)
        d.release(handle)
    d.free_reservation(va, 8 * G)


def check_runs_of_mappings(d: CudaDriver) -> None:
    """One set_access and one cuMemUnmap cover a run of adjacent mappings
    made one by one; data outside the run is untouched; a run with a gap or
    a wrong size is refused and changes nothing."""
    va = d.reserve(8 * G)
    handles = [d.create(G) for _ in range(5)]
    for i, h in enumerate(handles):
        d.map(va + i * G, G, h)
    access, unmap = counter("cuMemSetAccess"), counter("cuMemUnmap")
    d.set_access(va, 5 * G)
    for i in range(5):
        ctypes.memset(va + i * G, 0x40 + i, G)
    raises(MappingError, d.unmap_range, va + G, G, 5, match="no mapping of 2097152 bytes")
    raises(MappingError, d.unmap_range, va, 2 * G, 2, match="no mapping of 4194304 bytes")
    raises(MappingError, d.unmap_range, va, G, 0, match="count=0")
    d.unmap_range(va + G, G, 3)  # pages 1-3 in one call
    assert counter("cuMemSetAccess") - access == 1 and counter("cuMemUnmap") - unmap == 1
    assert ctypes.string_at(va, 4) == b"\x40" * 4
    assert ctypes.string_at(va + 4 * G, 4) == b"\x44" * 4
    raises(MappingError, d.unmap, va + G, G, match="no mapping of that size")
    for h in handles[1:4]:
        d.release(h)
    fresh = d.create(G)  # the hole is mappable again
    d.map(va + 2 * G, G, fresh)
    raises(MappingError, d.unmap_range, va, G, 3, match="starts at")  # page 1 is a gap
    d.unmap_range(va + 2 * G, G, 1)
    d.unmap(va, G)
    d.unmap(va + 4 * G, G)
    for h in (handles[0], handles[4], fresh):
        d.release(h)
    d.free_reservation(va, 8 * G)


def check_mem_info_follows_handles(d: CudaDriver) -> None:
    free0, total = d.mem_info()
    h = d.create(64 * MIB)
    assert d.mem_info() == (free0 - 64 * MIB, total)
    d.release(h)
    assert d.mem_info() == (free0, total)


def check_misuse_is_refused(d: CudaDriver) -> None:
    va = d.reserve(4 * G)
    h = d.create(G)
    d.map(va, G, h)
    raises(MappingError, d.map, va, G, h, match="already mapped")
    raises(MappingError, d.unmap, va + G, G, match="no mapping of that size")
    raises(MappingError, d.unmap, va, 2 * G, match="has 2097152 bytes")
    raises(MappingError, d.free_reservation, va, 4 * G, match="still inside")
    raises(MappingError, d.free_reservation, va, 2 * G, match="no reservation")
    raises(MappingError, d.create, G + 4096, match="granularity")
    raises(MappingError, d.reserve, 0, match="granularity")
    raises(DriverError, d.set_access, va, 2 * G, match="cuMemSetAccess")  # half unmapped
    d.unmap(va, G)
    d.release(h)
    err = raises(DriverError, d.release, h, match="cuMemRelease")
    assert (err.code, err.name) == (1, "CUDA_ERROR_INVALID_VALUE"), err
    err = raises(OutOfPhysicalMemoryError, d.create, 2 << 30, match="cuMemCreate")
    assert (err.code, err.name) == (2, "CUDA_ERROR_OUT_OF_MEMORY"), err
    d.free_reservation(va, 4 * G)
    raises(MappingError, d.free_reservation, va, 4 * G, match="no reservation")


def check_threads_get_a_context_once(d: CudaDriver) -> None:
    va = d.reserve(8 * G)
    before = counter("cuCtxSetCurrent"), counter("cuCtxGetCurrent")
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            for _ in range(50):
                h = d.create(G)
                d.map(va + slot * G, G, h)
                d.set_access(va + slot * G, G)
                d.unmap(va + slot * G, G)
                d.release(h)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = counter("cuCtxSetCurrent"), counter("cuCtxGetCurrent")
    # one look and one bind per new thread, none per call
    assert (after[0] - before[0], after[1] - before[1]) == (4, 4), (before, after)
    d.free_reservation(va, 8 * G)


def check_current_context_is_left_as_found(d0: CudaDriver, d1: CudaDriver) -> None:
    _, ctx0 = cu.cuCtxGetCurrent()
    assert int(ctx0) != 0  # d0 bound this thread (or found it bound)
    (err,) = cu.cuCtxSetCurrent(d0._ctx)
    assert not err
    d1.mem_info()
    d1.synchronize()
    _, now = cu.cuCtxGetCurrent()
    assert int(now) == int(d0._ctx), "mem_info/synchronize must pop the context they push"


def check_faulty_wrapper_speaks_cuda(d: CudaDriver) -> None:
    f = FaultyDriver(d, fail_nth={"create": 1})
    err = raises(OutOfPhysicalMemoryError, f.create, G)
    assert err.call == "cuMemCreate", err
    f.release(f.create(G))


def check_close() -> None:
    d = CudaDriver(0)
    d.close()
    d.close()  # idempotent
    out: list[BaseException] = []
    t = threading.Thread(
        target=lambda: out.append(raises(DriverUnavailableError, d.create, G, match="closed"))
    )
    t.start()
    t.join()
    assert out, "a closed driver must refuse a new thread"
    raises(ConfigError, CudaDriver, 5, match="index=5 is not valid: this process sees 2 CUDA")


def main() -> int:
    d1 = CudaDriver(1)
    d0 = CudaDriver(0)
    checks = [
        ("identity", lambda: check_identity(d1)),
        ("pages_keep_their_data", lambda: check_pages_keep_their_data(d1)),
        ("runs_of_mappings", lambda: check_runs_of_mappings(d1)),
        ("mem_info_follows_handles", lambda: check_mem_info_follows_handles(d1)),
        ("misuse_is_refused", lambda: check_misuse_is_refused(d1)),
        ("threads_get_a_context_once", lambda: check_threads_get_a_context_once(d1)),
        (
            "current_context_is_left_as_found",
            lambda: check_current_context_is_left_as_found(d0, d1),
        ),
        ("faulty_wrapper_speaks_cuda", lambda: check_faulty_wrapper_speaks_cuda(d1)),
        ("close", check_close),
    ]
    for name, check in checks:
        check()
        print(f"ok {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
