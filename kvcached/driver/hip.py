"""The ``hip`` backend: ROCm's virtual memory management through ``ctypes``.

The same page life as the ``cuda`` backend (``hipMemCreate -> hipMemMap ->
hipMemSetAccess``, ``hipMemUnmap -> hipMemRelease``, one set-access and one
unmap over a run of adjacent mappings; should ROCm refuse a run, the driver
logs it once and goes on with one call per mapping), called on
``libamdhip64.so`` with argument types declared once and the allocation
properties and access descriptor built once, in the layouts of ROCm's
``hip_runtime_api.h``::

    typedef struct hipMemLocation { hipMemLocationType type; int id; } hipMemLocation;
    typedef struct hipMemAllocationProp {
        hipMemAllocationType type;
        hipMemAllocationHandleType requestedHandleType;
        hipMemLocation location;
        void* win32HandleMetaData;
        struct { unsigned char compressionType; unsigned char gpuDirectRDMACapable;
                 unsigned short usage; } allocFlags;
    } hipMemAllocationProp;
    typedef struct hipMemAccessDesc { hipMemLocation location; hipMemAccessFlags flags; }
        hipMemAccessDesc;

The library loads on first use (:func:`load_library`); a ``lib`` argument
replaces it, which is how the tests check the marshalling without ROCm.
Handles are ``hipMemGenericAllocationHandle_t`` pointers as ``int``.

HIP keeps a current *device* per thread rather than a context: the VMM calls
name the device in their arguments, and the two calls that act on the current
device (``hipMemGetInfo``, ``hipDeviceSynchronize``) switch to this device and
back around themselves. ROCm builds of torch call their devices ``cuda``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NoReturn

import torch

from kvcached.driver.base import DeviceInfo, Driver, check_free_reservation
from kvcached.driver.tensor import device_tensor
from kvcached.errors import (
    ConfigError,
    DriverError,
    DriverUnavailableError,
    MappingError,
    OutOfPhysicalMemoryError,
)
from kvcached.log import get_logger

log = get_logger("kvcached.driver")

LIBRARY_NAMES = (
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "/opt/rocm/lib/libamdhip64.so",
)

HIP_SUCCESS = 0
HIP_ERROR_OUT_OF_MEMORY = 2  # hipErrorOutOfMemory (== hipErrorMemoryAllocation)
HIP_ERROR_NO_DEVICE = 100
HIP_ERROR_INVALID_DEVICE = 101
HIP_MEM_ALLOCATION_TYPE_PINNED = 1
HIP_MEM_LOCATION_TYPE_DEVICE = 1
HIP_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM = 0


class HipMemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class HipMemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
    ]


class HipMemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleType", ctypes.c_int),
        ("location", HipMemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", HipMemAllocFlags),
    ]


class HipMemAccessDesc(ctypes.Structure):
    _fields_ = [("location", HipMemLocation), ("flags", ctypes.c_int)]


_c_int, _c_uint, _size_t, _u64, _vp = (
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_size_t,
    ctypes.c_ulonglong,
    ctypes.c_void_p,
)
_p_size_t, _p_vp = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_void_p)

# name -> (restype, argtypes), as declared in hip_runtime_api.h
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "hipInit": (_c_int, [_c_uint]),
    "hipDeviceGet": (_c_int, [ctypes.POINTER(ctypes.c_int), _c_int]),
    "hipGetDevice": (_c_int, [ctypes.POINTER(ctypes.c_int)]),
    "hipSetDevice": (_c_int, [_c_int]),
    "hipGetDeviceCount": (_c_int, [ctypes.POINTER(ctypes.c_int)]),
    "hipDeviceGetName": (_c_int, [ctypes.c_char_p, _c_int, _c_int]),
    "hipDeviceGetPCIBusId": (_c_int, [ctypes.c_char_p, _c_int, _c_int]),
    "hipDeviceTotalMem": (_c_int, [_p_size_t, _c_int]),
    "hipDeviceSynchronize": (_c_int, []),
    "hipGetErrorName": (ctypes.c_char_p, [_c_int]),
    "hipMemGetInfo": (_c_int, [_p_size_t, _p_size_t]),
    "hipMemGetAllocationGranularity": (
        _c_int,
        [_p_size_t, ctypes.POINTER(HipMemAllocationProp), _c_int],
    ),
    "hipMemAddressReserve": (_c_int, [_p_vp, _size_t, _size_t, _vp, _u64]),
    "hipMemAddressFree": (_c_int, [_vp, _size_t]),
    "hipMemCreate": (_c_int, [_p_vp, _size_t, ctypes.POINTER(HipMemAllocationProp), _u64]),
    "hipMemRelease": (_c_int, [_vp]),
    "hipMemMap": (_c_int, [_vp, _size_t, _size_t, _vp, _u64]),
    "hipMemSetAccess": (_c_int, [_vp, _size_t, ctypes.POINTER(HipMemAccessDesc), _size_t]),
    "hipMemUnmap": (_c_int, [_vp, _size_t]),
}

_library: Any = None
_library_lock = threading.Lock()


def load_library() -> Any:
    """``libamdhip64`` as a ``ctypes.CDLL``, loaded once per process."""
    global _library
    with _library_lock:
        if _library is None:
            errors = []
            for name in LIBRARY_NAMES:
                try:
                    _library = ctypes.CDLL(name)
                    break
                except OSError as exc:
                    errors.append(str(exc))
            else:
                raise DriverUnavailableError(
                    "no ROCm HIP runtime found (libamdhip64.so); install ROCm, or set "
                    "KVCACHED_DRIVER=host (or cuda on an NVIDIA machine). Tried: "
                    + "; ".join(errors)
                )
        return _library


def _declare(lib: Any) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


class HipDriver(Driver):
    """One HIP device. Thread-safe like the CUDA backend.

    Invariants: ``_mapped`` holds exactly the ``va -> size`` of the mappings made
    by :meth:`map` and not yet removed by :meth:`unmap`; ``_reservations`` the
    live reservations.
    """

    backend = "hip"

    def __init__(self, index: int = 0, lib: Any = None) -> None:
        super().__init__(index)
        lib = load_library() if lib is None else lib
        try:
            _declare(lib)
        except AttributeError as exc:
            raise DriverUnavailableError(
                f"the HIP runtime lacks a call kvcached needs ({exc}); ROCm 6.0 or newer has "
                "them all. Or set KVCACHED_DRIVER=host"
            ) from None
        self._lib = lib
        rc = lib.hipInit(0)
        if rc == HIP_ERROR_NO_DEVICE:
            raise DriverUnavailableError(
                "the HIP runtime reports no GPU (check HIP_VISIBLE_DEVICES and rocm-smi), or "
                "set KVCACHED_DRIVER=host"
            )
        if rc:
            self._fail("hipInit", rc)
        device = ctypes.c_int()
        rc = lib.hipDeviceGet(ctypes.byref(device), index)
        if rc == HIP_ERROR_INVALID_DEVICE:
            count = ctypes.c_int()
            lib.hipGetDeviceCount(ctypes.byref(count))
            raise ConfigError(
                "index",
                index,
                f"this process sees {count.value} HIP device(s), numbered from 0 after "
                "HIP_VISIBLE_DEVICES",
            )
        if rc:
            self._fail("hipDeviceGet", rc, f"device {index}")
        self._device = device.value
        self._prop = HipMemAllocationProp(
            type=HIP_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleType=0,
            location=HipMemLocation(HIP_MEM_LOCATION_TYPE_DEVICE, self._device),
        )
        self._access = HipMemAccessDesc(
            location=HipMemLocation(HIP_MEM_LOCATION_TYPE_DEVICE, self._device),
            flags=HIP_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )
        self._p_prop = ctypes.byref(self._prop)
        self._p_access = ctypes.byref(self._access)
        granularity = ctypes.c_size_t()
        rc = lib.hipMemGetAllocationGranularity(
            ctypes.byref(granularity), self._p_prop, HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM
        )
        if rc:
            self._fail("hipMemGetAllocationGranularity", rc, f"device {index}")
        self._granularity = granularity.value
        self._torch_device = torch.device("cuda", index)
        self._info: DeviceInfo | None = None
        self._mapped: dict[int, int] = {}
        self._reservations: dict[int, int] = {}
        self._lock = threading.Lock()  # cold paths only
        self._hipMemCreate = lib.hipMemCreate
        self._hipMemRelease = lib.hipMemRelease
        self._hipMemMap = lib.hipMemMap
        self._hipMemSetAccess = lib.hipMemSetAccess
        self._hipMemUnmap = lib.hipMemUnmap
        # One set-access / unmap over a run of mappings until ROCm refuses one.
        self._runs = True

    # -- the one status check ------------------------------------------------------------
    def _fail(self, call: str, rc: int, detail: str = "") -> NoReturn:
        try:
            raw = self._lib.hipGetErrorName(rc)
            name = raw.decode(errors="replace") if raw else f"hipError_t {rc}"
        except Exception:  # naming the error must not hide it
            name = f"hipError_t {rc}"
        if rc == HIP_ERROR_OUT_OF_MEMORY:
            raise OutOfPhysicalMemoryError(call, rc, name, detail)
        raise DriverError(call, rc, name, detail)

    def _on_device(self, fn: Any, *args: Any) -> int:
        """Run ``fn(*args)`` with this device current on the calling thread."""
        lib = self._lib
        previous = ctypes.c_int()
        rc = lib.hipGetDevice(ctypes.byref(previous))
        if rc:
            self._fail("hipGetDevice", rc)
        switch = previous.value != self._device
        if switch:
            rc = lib.hipSetDevice(self._device)
            if rc:
                self._fail("hipSetDevice", rc, f"device {self.index}")
        try:
            return fn(*args)
        finally:
            if switch:
                lib.hipSetDevice(previous.value)

    # -- identity and capacity ------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    def info(self) -> DeviceInfo:
        with self._lock:
            if self._info is None:
                lib = self._lib
                name = ctypes.create_string_buffer(256)
                rc = lib.hipDeviceGetName(name, len(name), self._device)
                if rc:
                    self._fail("hipDeviceGetName", rc)
                bus = ctypes.create_string_buffer(64)
                rc = lib.hipDeviceGetPCIBusId(bus, len(bus), self._device)
                if rc:
                    self._fail("hipDeviceGetPCIBusId", rc)
                total = ctypes.c_size_t()
                rc = lib.hipDeviceTotalMem(ctypes.byref(total), self._device)
                if rc:
                    self._fail("hipDeviceTotalMem", rc)
                self._info = DeviceInfo(
                    backend=self.backend,
                    index=self.index,
                    name=name.value.decode(errors="replace").strip(),
                    pci_bus_id=bus.value.decode(errors="replace").strip(),
                    total_bytes=total.value,
                    granularity=self._granularity,
                )
            return self._info

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        rc = self._on_device(self._lib.hipMemGetInfo, ctypes.byref(free), ctypes.byref(total))
        if rc:
            self._fail("hipMemGetInfo", rc, f"device {self.index}")
        return free.value, total.value

    # -- virtual address space --------------------------------------------------------------
    def reserve(self, size: int) -> int:
        self._check_size("size", size)
        ptr = ctypes.c_void_p()
        rc = self._lib.hipMemAddressReserve(ctypes.byref(ptr), size, self._granularity, None, 0)
        if rc:
            self._fail("hipMemAddressReserve", rc, f"reserving {size} bytes of address space")
        va = ptr.value
        assert va, "hipMemAddressReserve succeeded, so the address is not NULL"
        with self._lock:
            self._reservations[va] = size
        return va

    def free_reservation(self, va: int, size: int) -> None:
        with self._lock:
            check_free_reservation(self._reservations, self._mapped, va, size)
            rc = self._lib.hipMemAddressFree(va, size)
            if rc:
                self._fail("hipMemAddressFree", rc, f"freeing {size} bytes at {va:#x}")
            del self._reservations[va]

    # -- physical memory (the hot path) ------------------------------------------------------
    def create(self, size: int) -> int:
        if size <= 0 or size % self._granularity:
            self._check_size("size", size)
        handle = ctypes.c_void_p()
        rc = self._hipMemCreate(ctypes.byref(handle), size, self._p_prop, 0)
        if rc:
            self._fail("hipMemCreate", rc, f"{size} bytes on device {self.index}")
        return handle.value

    def release(self, handle: int) -> None:
        rc = self._hipMemRelease(handle)
        if rc:
            self._fail("hipMemRelease", rc, f"handle {handle!r}")

    def map(self, va: int, size: int, handle: int) -> None:
        if va in self._mapped:
            raise MappingError(
                f"map(va={va:#x}, size={size}): {va:#x} is already mapped; unmap it first"
            )
        rc = self._hipMemMap(va, size, 0, handle, 0)
        if rc:
            self._fail(
                "hipMemMap",
                rc,
                f"mapping {size} bytes at {va:#x}: the range must lie inside a reservation, "
                "be aligned to the granularity, not overlap a mapping, and size must equal "
                "the handle's size",
            )
        self._mapped[va] = size

    def set_access(self, va: int, size: int) -> None:
        if self._runs and self._mapped.get(va, size) != size:  # a run of mappings
            rc = self._hipMemSetAccess(va, size, self._p_access, 1)
            if not rc:
                return
            self._runs_refused("hipMemSetAccess", rc)
            for v, s in self._mappings_in(va, size):
                self.set_access(v, s)
            return
        rc = self._hipMemSetAccess(va, size, self._p_access, 1)
        if rc:
            self._fail(
                "hipMemSetAccess", rc, f"{size} bytes at {va:#x} must be covered by mappings"
            )

    def unmap_range(self, va: int, size: int, count: int) -> None:
        """One ``hipMemUnmap`` over ``count`` adjacent mappings of ``size``
        bytes, as on CUDA; per mapping if this ROCm refuses a run."""
        if count < 1:
            raise MappingError(f"unmap_range(count={count}): needs at least one mapping")
        mapped = self._mapped
        vas = range(va, va + count * size, size)
        for v in vas:
            if mapped.get(v) != size:
                raise MappingError(
                    f"unmap_range(va={va:#x}, size={size}, count={count}): no mapping of "
                    f"{size} bytes starts at {v:#x}"
                )
        if self._runs and count > 1:
            rc = self._hipMemUnmap(va, size * count)
            if not rc:
                for v in vas:
                    del mapped[v]
                return
            self._runs_refused("hipMemUnmap", rc)
        for i, v in enumerate(vas):
            try:
                self.unmap(v, size)
            except DriverError as exc:
                exc.unmapped = i  # type: ignore[attr-defined]
                raise

    def _runs_refused(self, call: str, rc: int) -> None:
        """This ROCm refused one call over a run of mappings (untested on
        hardware: CUDA takes it): from now on one call per mapping."""
        self._runs = False
        log.warning(
            "%s over several mappings failed (hipError_t %d); kvcached makes one call "
            "per mapping from now on",
            call,
            rc,
        )

    def _mappings_in(self, va: int, size: int) -> list[tuple[int, int]]:
        out, pos, end = [], va, va + size
        while pos < end:
            s = self._mapped.get(pos)
            if s is None:
                raise MappingError(f"set_access(va={va:#x}, size={size}): {pos:#x} is not mapped")
            out.append((pos, s))
            pos += s
        return out

    def unmap(self, va: int, size: int) -> None:
        mapped = self._mapped.pop(va, None)
        if mapped != size:
            if mapped is not None:
                self._mapped[va] = mapped
            raise MappingError(
                f"unmap(va={va:#x}, size={size}): no mapping of that size starts there"
                + (f" (the mapping there has {mapped} bytes)" if mapped is not None else "")
            )
        rc = self._hipMemUnmap(va, size)
        if rc:
            self._mapped[va] = size  # still mapped: the call changed nothing
            self._fail("hipMemUnmap", rc, f"unmapping {size} bytes at {va:#x}")

    # -- tensors ---------------------------------------------------------------------------------
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return device_tensor(va, nbytes, self._torch_device)

    def synchronize(self) -> None:
        rc = self._on_device(self._lib.hipDeviceSynchronize)
        if rc:
            self._fail("hipDeviceSynchronize", rc, f"device {self.index}")

    # -- helpers -----------------------------------------------------------------------------------
    def _check_size(self, name: str, size: int) -> None:
        if size <= 0 or size % self._granularity:
            raise MappingError(
                f"{name}={size}: must be a positive multiple of the granularity "
                f"({self._granularity} bytes)"
            )
