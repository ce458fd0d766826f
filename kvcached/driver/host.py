"""The ``host`` backend: a real device made of CPU memory.

* A reservation is ``mmap(PROT_NONE)``: address space only, no memory; its
  granule-aligned part is then covered with read-only anonymous zero pages,
  which hold no memory either.
* A physical handle is a ``memfd`` whose pages are allocated at creation
  (``posix_fallocate``), so taking memory happens at ``create`` as on a GPU and
  running out is an error there, not a ``SIGBUS`` later.
* ``map`` is ``mmap(MAP_FIXED | MAP_SHARED)`` of the memfd into the reservation.
* ``unmap`` puts read-only anonymous zero pages back over the range: a read of
  unmapped KV gives zeros, a write faults loudly instead of corrupting;
  ``unmap_range`` does it for a run of adjacent mappings in one ``mmap``.
* ``release`` closes the memfd; its pages go back to the kernel once no mapping
  holds them.

The device has a configurable capacity (the ``capacity`` argument, which the
entry points take from ``KVCACHED_HOST_CAPACITY``; default half of RAM). Its free memory is counted across every process on the machine,
as a GPU's is: each handle is a memfd named after the device, so the sum of the
sizes of such memfds held open by any process is what the device has in use.
``mem_info`` computes that sum exactly (a scan of ``/proc/*/fd``, a few ms, used
at calibration cadence); ``create`` checks the capacity against this process'
exact usage plus other processes' usage as sampled at most
:data:`OTHERS_SAMPLE_S` ago. Keeping processes from racing each other into the
capacity is the per-GPU ledger's job, exactly as on a GPU.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
import time

import torch

from kvcached.driver import _libc
from kvcached.driver.base import DeviceInfo, Driver
from kvcached.errors import DriverError, MappingError, OutOfPhysicalMemoryError
from kvcached.units import MIB

GRANULARITY = 2 * MIB
OTHERS_SAMPLE_S = 0.05
_MEMFD_PREFIX = "kvcached-host:"


def physical_ram() -> int:
    """Bytes of RAM the kernel reports (``MemTotal``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram() -> int:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return physical_ram()


class HostHandle:
    """A physical handle of the host backend: one memfd of ``size`` bytes."""

    __slots__ = ("fd", "size", "mapped", "released")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mapped = 0
        self.released = False

    def __repr__(self) -> str:
        return f"<HostHandle fd={self.fd} size={self.size}>"


class _Reservation:
    __slots__ = ("va", "size", "mappings", "granules")

    def __init__(self, va: int, size: int) -> None:
        self.va = va
        self.size = size
        # mapping start -> (size, handle); no two overlap
        self.mappings: dict[int, tuple[int, HostHandle]] = {}
        # one byte per granule, 1 where mapped: an overlap check is one C-level find
        self.granules = bytearray(size // GRANULARITY)


def _raise_os(call: str, exc: OSError, detail: str = "") -> None:
    code = exc.errno or 0
    name = errno.errorcode.get(code, "EUNKNOWN")
    if code in (errno.ENOMEM, errno.ENOSPC):
        raise OutOfPhysicalMemoryError(call, code, name, detail or exc.strerror or "") from None
    raise DriverError(call, code, name, detail or exc.strerror or "") from None


class HostDriver(Driver):
    """See the module docstring. Thread-safe: one lock guards the bookkeeping."""

    backend = "host"

    def __init__(self, index: int = 0, capacity: int | None = None) -> None:
        super().__init__(index)
        if capacity is None:
            capacity = physical_ram() // 2
        if capacity < GRANULARITY:
            raise ValueError(
                f"host backend capacity={capacity} bytes is below one 2 MiB page; "
                "set KVCACHED_HOST_CAPACITY to e.g. 8G"
            )
        self.capacity = capacity - capacity % GRANULARITY
        self.device_id = f"host-{index}"
        self._memfd_name = f"{_MEMFD_PREFIX}{self.device_id}"
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._reservations: dict[int, _Reservation] = {}
        self._own_bytes = 0
        self._others_bytes = 0
        self._others_at = 0.0
        self._device = torch.device("cpu")

    # -- identity and capacity ------------------------------------------------------
    @property
    def granularity(self) -> int:
        return GRANULARITY

    @property
    def torch_device(self) -> torch.device:
        return self._device

    def info(self) -> DeviceInfo:
        return DeviceInfo(
            backend="host",
            index=self.index,
            name=f"host memory ({os.uname().machine})",
            pci_bus_id=self.device_id,
            total_bytes=self.capacity,
            granularity=GRANULARITY,
        )

    def used_bytes_all_processes(self) -> int:
        """Bytes of this device's handles held by every process (exact scan)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        target = "/memfd:" + self._memfd_name
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            fd_dir = f"/proc/{pid}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue  # gone, or not ours to read
            for fd in fds:
                path = f"{fd_dir}/{fd}"
                try:
                    if not os.readlink(path).startswith(target):
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key not in seen:  # a forked child shares its parent's memfds
                    seen.add(key)
                    total += st.st_size
        return total

    def mem_info(self) -> tuple[int, int]:
        used = self.used_bytes_all_processes()
        with self._lock:
            self._others_bytes = max(0, used - self._own_bytes)
            self._others_at = time.monotonic()
        free = max(0, min(self.capacity - used, available_ram()))
        return free, self.capacity

    # -- virtual address space --------------------------------------------------------
    def reserve(self, size: int) -> int:
        self._check_size("size", size)
        try:
            # Over-reserve by one granule so the start can be aligned like a GPU VA.
            raw = _libc.mmap(
                None,
                size + GRANULARITY,
                _libc.PROT_NONE,
                _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_NORESERVE,
            )
            # Unmapped KV reads as zeros, like upstream's zero page on the GPU, so a
            # stray read of an unused slot cannot kill the engine; writes still fault.
            aligned = (raw + GRANULARITY - 1) // GRANULARITY * GRANULARITY
            self._zero_fill(aligned, size)
        except OSError as exc:
            _raise_os("mmap", exc, f"reserving {size} bytes of address space")
        va = (raw + GRANULARITY - 1) // GRANULARITY * GRANULARITY
        head, tail = va - raw, raw + size + GRANULARITY - (va + size)
        if head:
            _libc.munmap(raw, head)
        if tail:
            _libc.munmap(va + size, tail)
        with self._lock:
            bisect.insort(self._starts, va)
            self._reservations[va] = _Reservation(va, size)
        return va

    def free_reservation(self, va: int, size: int) -> None:
        with self._lock:
            res = self._reservations.get(va)
            if res is None or res.size != size:
                raise MappingError(
                    f"free_reservation(va={va:#x}, size={size}): no reservation starts "
                    "there with that size"
                )
            if res.mappings:
                raise MappingError(
                    f"free_reservation(va={va:#x}): {len(res.mappings)} mapping(s) are "
                    "still inside; unmap them first"
                )
            try:
                _libc.munmap(va, size)
            except OSError as exc:
                _raise_os("munmap", exc)
            del self._reservations[va]
            self._starts.remove(va)

    # -- physical memory ---------------------------------------------------------------
    def create(self, size: int) -> HostHandle:
        self._check_size("size", size)
        with self._lock:
            if time.monotonic() - self._others_at > OTHERS_SAMPLE_S:
                self._lock.release()
                try:
                    others = max(0, self.used_bytes_all_processes() - self._own_bytes)
                finally:
                    self._lock.acquire()
                self._others_bytes, self._others_at = others, time.monotonic()
            if self._own_bytes + self._others_bytes + size > self.capacity:
                raise OutOfPhysicalMemoryError(
                    "memfd_create",
                    errno.ENOMEM,
                    "ENOMEM",
                    f"host device {self.device_id} has {self.capacity} bytes; "
                    f"{self._own_bytes + self._others_bytes} in use, {size} asked",
                )
            self._own_bytes += size
        try:
            fd = os.memfd_create(self._memfd_name, os.MFD_CLOEXEC)
        except OSError as exc:
            self._uncount(size)
            _raise_os("memfd_create", exc)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            self._uncount(size)
            _raise_os("posix_fallocate", exc, f"allocating {size} bytes")
        return HostHandle(fd, size)

    def release(self, handle: HostHandle) -> None:
        with self._lock:
            if handle.released:
                raise MappingError(f"release({handle!r}): the handle was already released")
            handle.released = True
            if handle.mapped == 0:
                self._close(handle)

    def map(self, va: int, size: int, handle: HostHandle) -> None:
        with self._lock:
            if handle.released:
                raise MappingError(f"map({handle!r}): the handle was released")
            if size != handle.size:
                raise MappingError(
                    f"map(va={va:#x}, size={size}): a handle is mapped whole; its size is "
                    f"{handle.size}"
                )
            res = self._find(va, size)
            first, count = (va - res.va) // GRANULARITY, size // GRANULARITY
            taken = res.granules.find(1, first, first + count)
            if taken != -1:
                raise MappingError(
                    f"map(va={va:#x}, size={size}): {res.va + taken * GRANULARITY:#x} is "
                    "already mapped; unmap it first"
                )
            try:
                _libc.mmap(
                    va,
                    size,
                    _libc.PROT_READ | _libc.PROT_WRITE,
                    _libc.MAP_SHARED | _libc.MAP_FIXED,
                    handle.fd,
                    0,
                )
            except OSError as exc:
                self._zero_fill(va, size)
                _raise_os("mmap", exc, f"mapping {size} bytes at {va:#x}")
            res.mappings[va] = (size, handle)
            res.granules[first : first + count] = b"\x01" * count
            handle.mapped += 1

    def set_access(self, va: int, size: int) -> None:
        with self._lock:
            res = self._find(va, size)
            end, pos = va + size, va
            while pos < end:  # the range must be covered by mappings, as on CUDA
                entry = res.mappings.get(pos)
                if entry is None:
                    raise MappingError(
                        f"set_access(va={va:#x}, size={size}): {pos:#x} is not mapped"
                    )
                pos += entry[0]
            if pos != end:
                raise MappingError(
                    f"set_access(va={va:#x}, size={size}): the range ends inside a mapping"
                )

    def unmap(self, va: int, size: int) -> None:
        with self._lock:
            res = self._find(va, size)
            entry = res.mappings.get(va)
            if entry is None or entry[0] != size:
                raise MappingError(
                    f"unmap(va={va:#x}, size={size}): no mapping of that size starts there"
                )
            self._zero_fill(va, size)
            del res.mappings[va]
            first = (va - res.va) // GRANULARITY
            res.granules[first : first + size // GRANULARITY] = bytes(size // GRANULARITY)
            handle = entry[1]
            handle.mapped -= 1
            if handle.released and handle.mapped == 0:
                self._close(handle)

    def unmap_range(self, va: int, size: int, count: int) -> None:
        """``count`` adjacent mappings of ``size`` bytes put back to zero
        pages by one ``mmap`` over the whole range, all or nothing."""
        if count < 1:
            raise MappingError(f"unmap_range(count={count}): needs at least one mapping")
        total = size * count
        with self._lock:
            res = self._find(va, total)
            mappings = res.mappings
            entries = []
            for v in range(va, va + total, size):
                entry = mappings.get(v)
                if entry is None or entry[0] != size:
                    raise MappingError(
                        f"unmap_range(va={va:#x}, size={size}, count={count}): no mapping of "
                        f"{size} bytes starts at {v:#x}"
                    )
                entries.append(entry)
            self._zero_fill(va, total)
            for v in range(va, va + total, size):
                del mappings[v]
            first = (va - res.va) // GRANULARITY
            res.granules[first : first + total // GRANULARITY] = bytes(total // GRANULARITY)
            for _, handle in entries:
                handle.mapped -= 1
                if handle.released and handle.mapped == 0:
                    self._close(handle)

    # -- tensors -------------------------------------------------------------------------
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes <= 0:
            raise ValueError(f"tensor(nbytes={nbytes}): needs at least one byte")
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    # -- helpers ---------------------------------------------------------------------------
    def own_bytes(self) -> int:
        """Bytes of handles this process holds (created, not yet gone)."""
        return self._own_bytes

    def _uncount(self, size: int) -> None:
        with self._lock:
            self._own_bytes -= size

    def _close(self, handle: HostHandle) -> None:
        os.close(handle.fd)
        handle.fd = -1
        self._own_bytes -= handle.size

    def _zero_fill(self, va: int, size: int) -> None:
        try:
            _libc.mmap(
                va,
                size,
                _libc.PROT_READ,
                _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED | _libc.MAP_NORESERVE,
            )
        except OSError as exc:
            _raise_os("mmap", exc, f"restoring zero pages at {va:#x}")

    def _find(self, va: int, size: int) -> _Reservation:
        if va % GRANULARITY or size <= 0 or size % GRANULARITY:
            raise MappingError(
                f"va={va:#x}, size={size}: both must be multiples of the granularity "
                f"({GRANULARITY} bytes) and size above 0"
            )
        i = bisect.bisect_right(self._starts, va) - 1
        if i >= 0:
            res = self._reservations[self._starts[i]]
            if va + size <= res.va + res.size:
                return res
        raise MappingError(f"va={va:#x}, size={size}: the range is not inside a reservation")

    @staticmethod
    def _check_size(name: str, size: int) -> None:
        if size <= 0 or size % GRANULARITY:
            raise MappingError(
                f"{name}={size}: must be a positive multiple of the granularity "
                f"({GRANULARITY} bytes)"
            )
