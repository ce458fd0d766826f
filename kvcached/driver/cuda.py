"""The ``cuda`` backend: CUDA's virtual memory management through cuda-python.

Every call goes through ``cuda.bindings.driver`` (cuda-python 12.6+/13.x; the
old ``from cuda import cuda`` module is gone in 13.x) on the device's
*primary* context, the one torch's runtime uses, so tensors over the mapped
memory are valid for torch's kernels.

Hot path (per page): ``cuMemCreate -> cuMemMap -> cuMemSetAccess`` to grow,
``cuMemUnmap -> cuMemRelease`` to shrink; for a run of adjacent pages one
``cuMemSetAccess`` and one ``cuMemUnmap`` (:meth:`CudaDriver.unmap_range`)
cover every mapping of the run. Each is one Cython call with
arguments prepared once (the allocation properties and the access descriptor
are built in ``__init__``), one status test, and for map/unmap one dict update
that records which ranges are mapped, so a wrong unmap is a clear
:class:`~kvcached.errors.MappingError` instead of whatever the driver does
with it. Failure messages are built only on failure.

Contexts: the VMM calls take the device explicitly (in the allocation
properties and the access descriptor), but the driver still wants *a* current
context on the calling thread, and kvcached is called from torch's threads and
from its own refill thread. Each thread is therefore checked once: if it has
no current context, the primary context of this device is made current; if it
has one (torch's), it is left alone. Calls that act on "the current device"
(``cuMemGetInfo``, ``cuCtxSynchronize``) push this device's primary context
for their duration instead.

Handles are cuda-python's ``CUmemGenericAllocationHandle`` objects, passed
back to the driver unchanged (cheaper than converting to and from ``int``).
"""

from __future__ import annotations

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

try:
    from cuda.bindings import driver as cu
except ImportError:  # cuda-python missing or too old: reported by CudaDriver()
    cu = None

NO_DRIVER_MESSAGE = (
    "no NVIDIA driver found (libcuda.so.1); install the NVIDIA driver or set KVCACHED_DRIVER=host"
)
NO_BINDINGS_MESSAGE = (
    "cuda-python is not installed or too old (need `from cuda.bindings import driver`); "
    "pip install 'cuda-python>=12.6', or set KVCACHED_DRIVER=host"
)


def _status_name(err: Any) -> str:
    name = getattr(err, "name", None)
    if name:
        return str(name)
    try:
        return cu.CUresult(int(err)).name
    except (ValueError, TypeError, AttributeError):
        return f"CUresult {int(err)}"


def _fail(call: str, err: Any, detail: str = "") -> NoReturn:
    """Raise the error for status ``err`` of ``call``: the one status check of
    this backend (callers test ``if err:`` first, so success costs nothing)."""
    code = int(err)
    if cu is not None and code == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise OutOfPhysicalMemoryError(call, code, _status_name(err), detail)
    raise DriverError(call, code, _status_name(err), detail)


class _ThreadState(threading.local):
    ready = False


class CudaDriver(Driver):
    """One CUDA device (``index`` as CUDA and torch number it, after
    ``CUDA_VISIBLE_DEVICES``). Thread-safe: every call is one driver call plus
    GIL-atomic bookkeeping.

    Invariants: ``_mapped`` holds exactly the ``va -> size`` of the mappings
    made by :meth:`map` and not yet removed by :meth:`unmap`; ``_reservations``
    holds the ``va -> size`` of the live reservations.
    """

    backend = "cuda"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        if cu is None:
            raise DriverUnavailableError(NO_BINDINGS_MESSAGE)
        try:
            (err,) = cu.cuInit(0)
        except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError
            raise DriverUnavailableError(f"{NO_DRIVER_MESSAGE} ({exc})") from None
        if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
            raise DriverUnavailableError(
                "the NVIDIA driver reports no CUDA device (check CUDA_VISIBLE_DEVICES and "
                "nvidia-smi), or set KVCACHED_DRIVER=host"
            )
        if err:
            _fail("cuInit", err)
        err, self._device = cu.cuDeviceGet(index)
        if err == cu.CUresult.CUDA_ERROR_INVALID_DEVICE:
            (_, count) = cu.cuDeviceGetCount()
            raise ConfigError(
                "index",
                index,
                f"this process sees {count} CUDA device(s), numbered from 0 after "
                "CUDA_VISIBLE_DEVICES",
            )
        if err:
            _fail("cuDeviceGet", err, f"device {index}")
        err, self._ctx = cu.cuDevicePrimaryCtxRetain(self._device)
        if err:
            _fail("cuDevicePrimaryCtxRetain", err, f"device {index}")
        self._closed = False
        self._thread = _ThreadState()
        self._bind_thread()

        device_location = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = device_location
        prop.location.id = index
        access = cu.CUmemAccessDesc()
        access.location.type = device_location
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._prop = prop
        self._access = [access]
        err, granularity = cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        if err:
            _fail("cuMemGetAllocationGranularity", err, f"device {index}")
        self._granularity = int(granularity)
        self._torch_device = torch.device("cuda", index)
        self._info: DeviceInfo | None = None
        self._mapped: dict[int, int] = {}
        self._reservations: dict[int, int] = {}
        self._lock = threading.Lock()  # cold paths only (reservations, info)

        # The hot calls, looked up once.
        self._cuMemCreate = cu.cuMemCreate
        self._cuMemRelease = cu.cuMemRelease
        self._cuMemMap = cu.cuMemMap
        self._cuMemSetAccess = cu.cuMemSetAccess
        self._cuMemUnmap = cu.cuMemUnmap

    # -- contexts ------------------------------------------------------------------------
    def _bind_thread(self) -> None:
        """Give the calling thread a current context (ours) unless it has one."""
        if self._closed:
            raise DriverUnavailableError(f"{self!r} was closed; get a new driver")
        err, current = cu.cuCtxGetCurrent()
        if err:
            _fail("cuCtxGetCurrent", err)
        if int(current) == 0:
            (err,) = cu.cuCtxSetCurrent(self._ctx)
            if err:
                _fail("cuCtxSetCurrent", err, f"primary context of device {self.index}")
        self._thread.ready = True

    def _push(self) -> None:
        if self._closed:
            raise DriverUnavailableError(f"{self!r} was closed; get a new driver")
        (err,) = cu.cuCtxPushCurrent(self._ctx)
        if err:
            _fail("cuCtxPushCurrent", err, f"primary context of device {self.index}")

    @staticmethod
    def _pop() -> None:
        err, _ = cu.cuCtxPopCurrent()
        if err:
            _fail("cuCtxPopCurrent", err)

    # -- identity and capacity ---------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    def info(self) -> DeviceInfo:
        with self._lock:
            if self._info is None:
                err, name = cu.cuDeviceGetName(256, self._device)
                if err:
                    _fail("cuDeviceGetName", err)
                err, bus = cu.cuDeviceGetPCIBusId(64, self._device)
                if err:
                    _fail("cuDeviceGetPCIBusId", err)
                err, total = cu.cuDeviceTotalMem(self._device)
                if err:
                    _fail("cuDeviceTotalMem", err)
                self._info = DeviceInfo(
                    backend=self.backend,
                    index=self.index,
                    name=_c_string(name),
                    pci_bus_id=_c_string(bus),
                    total_bytes=int(total),
                    granularity=self._granularity,
                )
            return self._info

    def mem_info(self) -> tuple[int, int]:
        self._push()
        try:
            err, free, total = cu.cuMemGetInfo()
        finally:
            self._pop()
        if err:
            _fail("cuMemGetInfo", err, f"device {self.index}")
        return int(free), int(total)

    # -- virtual address space ---------------------------------------------------------
    def reserve(self, size: int) -> int:
        self._check_size("size", size)
        if not self._thread.ready:
            self._bind_thread()
        err, ptr = cu.cuMemAddressReserve(size, self._granularity, 0, 0)
        if err:
            _fail("cuMemAddressReserve", err, f"reserving {size} bytes of address space")
        va = int(ptr)
        with self._lock:
            self._reservations[va] = size
        return va

    def free_reservation(self, va: int, size: int) -> None:
        with self._lock:
            check_free_reservation(self._reservations, self._mapped, va, size)
            if not self._thread.ready:
                self._bind_thread()
            (err,) = cu.cuMemAddressFree(va, size)
            if err:
                _fail("cuMemAddressFree", err, f"freeing {size} bytes at {va:#x}")
            del self._reservations[va]

    # -- physical memory (the hot path) ------------------------------------------------
    def create(self, size: int) -> Any:
        if size <= 0 or size % self._granularity:
            self._check_size("size", size)
        if not self._thread.ready:
            self._bind_thread()
        err, handle = self._cuMemCreate(size, self._prop, 0)
        if err:
            _fail("cuMemCreate", err, f"{size} bytes on device {self.index}")
        return handle

    def release(self, handle: Any) -> None:
        if not self._thread.ready:
            self._bind_thread()
        (err,) = self._cuMemRelease(handle)
        if err:
            _fail("cuMemRelease", err, f"handle {handle!r}")

    def map(self, va: int, size: int, handle: Any) -> None:
        if va in self._mapped:
            raise MappingError(
                f"map(va={va:#x}, size={size}): {va:#x} is already mapped; unmap it first"
            )
        if not self._thread.ready:
            self._bind_thread()
        (err,) = self._cuMemMap(va, size, 0, handle, 0)
        if err:
            _fail(
                "cuMemMap",
                err,
                f"mapping {size} bytes at {va:#x}: the range must lie inside a reservation, "
                "be aligned to the granularity, not overlap a mapping, and size must equal "
                "the handle's size",
            )
        self._mapped[va] = size

    def set_access(self, va: int, size: int) -> None:
        if not self._thread.ready:
            self._bind_thread()
        (err,) = self._cuMemSetAccess(va, size, self._access, 1)
        if err:
            _fail("cuMemSetAccess", err, f"{size} bytes at {va:#x} must be covered by mappings")

    def unmap(self, va: int, size: int) -> None:
        mapped = self._mapped.pop(va, None)
        if mapped != size:
            if mapped is not None:
                self._mapped[va] = mapped
            raise MappingError(
                f"unmap(va={va:#x}, size={size}): no mapping of that size starts there"
                + (f" (the mapping there has {mapped} bytes)" if mapped is not None else "")
            )
        if not self._thread.ready:
            self._bind_thread()
        (err,) = self._cuMemUnmap(va, size)
        if err:
            self._mapped[va] = size  # still mapped: the call changed nothing
            _fail("cuMemUnmap", err, f"unmapping {size} bytes at {va:#x}")

    def unmap_range(self, va: int, size: int, count: int) -> None:
        """One ``cuMemUnmap`` over ``count`` adjacent mappings of ``size``
        bytes (the driver accepts a range covered by whole mappings)."""
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
        for v in vas:
            del mapped[v]
        if not self._thread.ready:
            self._bind_thread()
        (err,) = self._cuMemUnmap(va, size * count)
        if err:
            for v in vas:  # still mapped: the call changed nothing
                mapped[v] = size
            _fail("cuMemUnmap", err, f"unmapping {count} mappings of {size} bytes at {va:#x}")

    # -- tensors -------------------------------------------------------------------------
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return device_tensor(va, nbytes, self._torch_device)

    def synchronize(self) -> None:
        self._push()
        try:
            (err,) = cu.cuCtxSynchronize()
        finally:
            self._pop()
        if err:
            _fail("cuCtxSynchronize", err, f"device {self.index}")

    def close(self) -> None:
        """Release this driver's reference on the primary context. Idempotent;
        the driver must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        (err,) = cu.cuDevicePrimaryCtxRelease(self._device)
        if err and err != cu.CUresult.CUDA_ERROR_DEINITIALIZED:
            _fail("cuDevicePrimaryCtxRelease", err, f"device {self.index}")

    # -- helpers ---------------------------------------------------------------------------
    def _check_size(self, name: str, size: int) -> None:
        if size <= 0 or size % self._granularity:
            raise MappingError(
                f"{name}={size}: must be a positive multiple of the granularity "
                f"({self._granularity} bytes)"
            )


def _c_string(raw: bytes | str) -> str:
    if isinstance(raw, bytes):
        raw = raw.split(b"\0", 1)[0].decode(errors="replace")
    return raw.split("\0", 1)[0].strip()
