"""The HIP backend's argument marshalling, against a stand-in for libamdhip64.

ROCm cannot run here, so :class:`FakeHip` plays the library: each of its calls
is a real ctypes function pointer (a ``CFUNCTYPE`` callback) declared with the
C prototype of ``hip_runtime_api.h``, written here independently of
``kvcached/driver/hip.py``. A call from the driver therefore crosses a real C
call boundary: if the driver declared a type wrong (a ``c_int`` for a
``size_t``, a struct by value for a pointer), the callee sees the wrong value.
Structs are read back at the byte offsets the header's layout gives, not
through the driver's ``ctypes.Structure`` classes.
"""

from __future__ import annotations

import ctypes
import struct

import pytest

from kvcached.driver import hip
from kvcached.driver.hip import HipDriver
from kvcached.errors import (
    ConfigError,
    DriverError,
    DriverUnavailableError,
    MappingError,
    OutOfPhysicalMemoryError,
)

MIB = 1 << 20
GRANULARITY = 2 * MIB
VA_BASE = 0x7F00_0000_0000
ERROR_NAMES = {
    0: b"hipSuccess",
    1: b"hipErrorInvalidValue",
    2: b"hipErrorOutOfMemory",
    100: b"hipErrorNoDevice",
    101: b"hipErrorInvalidDevice",
}

c_int, c_uint, size_t, u64, vp = (
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_size_t,
    ctypes.c_ulonglong,
    ctypes.c_void_p,
)


def read_prop(address: int) -> dict:
    """hipMemAllocationProp at ``address``: {int type; int requestedHandleType;
    {int type; int id} location; void* win32HandleMetaData; {u8, u8, u16} allocFlags}."""
    raw = ctypes.string_at(address, 28)
    type_, handle_type, loc_type, loc_id, win32, compression, rdma, usage = struct.unpack(
        "<iiiiQBBH", raw
    )
    return {
        "type": type_,
        "requestedHandleType": handle_type,
        "location": (loc_type, loc_id),
        "win32HandleMetaData": win32,
        "allocFlags": (compression, rdma, usage),
    }


def read_access(address: int) -> dict:
    """hipMemAccessDesc at ``address``: {{int type; int id} location; int flags}."""
    loc_type, loc_id, flags = struct.unpack("<iii", ctypes.string_at(address, 12))
    return {"location": (loc_type, loc_id), "flags": flags}


class FakeHip:
    """A libamdhip64 stand-in with ``devices`` GPUs. ``calls`` records
    ``(name, args)`` with structs decoded; ``fail[name] = rc`` makes the next
    call of ``name`` return ``rc``."""

    def __init__(self, devices: int = 2, init_rc: int = 0) -> None:
        self.devices = devices
        self.init_rc = init_rc
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}
        self.current = 0
        self.next_va = VA_BASE
        self.next_handle = 0x5000_0000_1000
        self.handles: set[int] = set()
        self._names = {rc: ctypes.create_string_buffer(name) for rc, name in ERROR_NAMES.items()}
        self._unknown = ctypes.create_string_buffer(b"hipErrorUnknown")
        self._keep = []
        p = ctypes.POINTER
        self._define("hipInit", c_int, [c_uint], self._init)
        self._define("hipDeviceGet", c_int, [p(c_int), c_int], self._device_get)
        self._define("hipGetDevice", c_int, [p(c_int)], self._get_device)
        self._define("hipSetDevice", c_int, [c_int], self._set_device)
        self._define("hipGetDeviceCount", c_int, [p(c_int)], self._count)
        self._define("hipDeviceGetName", c_int, [vp, c_int, c_int], self._name)
        self._define("hipDeviceGetPCIBusId", c_int, [vp, c_int, c_int], self._bus)
        self._define("hipDeviceTotalMem", c_int, [p(size_t), c_int], self._total)
        self._define("hipDeviceSynchronize", c_int, [], lambda: self._rc("hipDeviceSynchronize"))
        self._define("hipGetErrorName", vp, [c_int], self._error_name, record=False)
        self._define("hipMemGetInfo", c_int, [p(size_t), p(size_t)], self._mem_info)
        self._define(
            "hipMemGetAllocationGranularity", c_int, [p(size_t), vp, c_int], self._granularity
        )
        self._define("hipMemAddressReserve", c_int, [p(vp), size_t, size_t, vp, u64], self._reserve)
        self._define("hipMemAddressFree", c_int, [vp, size_t], self._plain("hipMemAddressFree"))
        self._define("hipMemCreate", c_int, [p(vp), size_t, vp, u64], self._create)
        self._define("hipMemRelease", c_int, [vp], self._release)
        self._define("hipMemMap", c_int, [vp, size_t, size_t, vp, u64], self._plain("hipMemMap"))
        self._define("hipMemSetAccess", c_int, [vp, size_t, vp, size_t], self._set_access)
        self._define("hipMemUnmap", c_int, [vp, size_t], self._plain("hipMemUnmap"))

    def _define(self, name, restype, argtypes, impl, record=True) -> None:
        def entry(*args):
            if record:
                self.calls.append((name, args))
            return impl(*args)

        fn = ctypes.CFUNCTYPE(restype, *argtypes)(entry)
        self._keep.append(fn)
        setattr(self, name, fn)

    def _rc(self, name: str) -> int:
        return self.fail.pop(name, 0)

    def _plain(self, name: str):
        return lambda *args: self._rc(name)

    def named(self, name: str) -> list[tuple]:
        return [args for call, args in self.calls if call == name]

    # -- implementations (arguments as C sees them) ------------------------------------
    def _init(self, flags):
        return self.init_rc or self._rc("hipInit")

    def _device_get(self, out, ordinal):
        if not 0 <= ordinal < self.devices:
            return 101
        out[0] = ordinal
        return self._rc("hipDeviceGet")

    def _get_device(self, out):
        out[0] = self.current
        return 0

    def _set_device(self, device):
        self.current = device
        return 0

    def _count(self, out):
        out[0] = self.devices
        return 0

    def _name(self, buf, length, device):
        ctypes.memmove(buf, b"AMD Instinct MI300X\0", min(length, 20))
        return 0

    def _bus(self, buf, length, device):
        text = f"0000:{0x0C + device:02x}:00.0\0".encode()
        ctypes.memmove(buf, text, min(length, len(text)))
        return 0

    def _total(self, out, device):
        out[0] = 192 << 30
        return 0

    def _error_name(self, rc):
        return ctypes.addressof(self._names.get(rc, self._unknown))

    def _mem_info(self, free, total):
        free[0], total[0] = 100 << 30, 192 << 30
        return self._rc("hipMemGetInfo")

    def _granularity(self, out, prop, option):
        self.calls[-1] = ("hipMemGetAllocationGranularity", (read_prop(prop), option))
        out[0] = GRANULARITY
        return 0

    def _reserve(self, out, size, alignment, addr, flags):
        rc = self._rc("hipMemAddressReserve")
        if not rc:
            out[0] = self.next_va
            self.next_va += size + GRANULARITY
        return rc

    def _create(self, out, size, prop, flags):
        self.calls[-1] = ("hipMemCreate", (out, size, read_prop(prop), flags))
        rc = self._rc("hipMemCreate")
        if not rc:
            out[0] = self.next_handle
            self.handles.add(self.next_handle)
            self.next_handle += 0x40
        return rc

    def _release(self, handle):
        rc = self._rc("hipMemRelease")
        if not rc:
            self.handles.discard(handle)
        return rc

    def _set_access(self, va, size, desc, count):
        self.calls[-1] = ("hipMemSetAccess", (va, size, read_access(desc), count))
        return self._rc("hipMemSetAccess")


@pytest.fixture
def fake() -> FakeHip:
    return FakeHip()


def test_struct_layouts_match_the_header():
    assert ctypes.sizeof(hip.HipMemLocation) == 8
    assert ctypes.sizeof(hip.HipMemAccessDesc) == 12
    assert ctypes.sizeof(hip.HipMemAllocationProp) == 32
    assert hip.HipMemAllocationProp.location.offset == 8
    assert hip.HipMemAllocationProp.win32HandleMetaData.offset == 16
    assert hip.HipMemAllocationProp.allocFlags.offset == 24
    assert hip.HipMemAccessDesc.flags.offset == 8


def test_init_asks_granularity_with_a_pinned_device_prop(fake):
    driver = HipDriver(1, lib=fake)
    assert driver.granularity == GRANULARITY
    assert fake.named("hipInit") == [(0,)]
    ((prop, option),) = fake.named("hipMemGetAllocationGranularity")
    assert prop == {
        "type": 1,
        "requestedHandleType": 0,
        "location": (1, 1),
        "win32HandleMetaData": 0,
        "allocFlags": (0, 0, 0),
    }
    assert option == 0  # hipMemAllocationGranularityMinimum


def test_page_life_marshals_every_argument(fake):
    driver = HipDriver(1, lib=fake)
    size = 8 << 30  # above 4 GiB: a size_t declared as int would be cut
    va = driver.reserve(size)
    assert va == VA_BASE
    ((_, got_size, alignment, addr, flags),) = fake.named("hipMemAddressReserve")
    assert (got_size, alignment, addr, flags) == (size, GRANULARITY, None, 0)

    handle = driver.create(64 * MIB)
    assert handle in fake.handles and handle > 1 << 32  # the whole pointer came back
    ((_, got_size, prop, flags),) = fake.named("hipMemCreate")
    assert got_size == 64 * MIB and flags == 0
    assert prop["type"] == 1 and prop["location"] == (1, 1) and prop["requestedHandleType"] == 0

    driver.map(va + 2 * GRANULARITY, 64 * MIB, handle)
    assert fake.named("hipMemMap") == [(va + 2 * GRANULARITY, 64 * MIB, 0, handle, 0)]

    driver.set_access(va + 2 * GRANULARITY, 64 * MIB)
    assert fake.named("hipMemSetAccess") == [
        (va + 2 * GRANULARITY, 64 * MIB, {"location": (1, 1), "flags": 3}, 1)
    ]

    driver.unmap(va + 2 * GRANULARITY, 64 * MIB)
    assert fake.named("hipMemUnmap") == [(va + 2 * GRANULARITY, 64 * MIB)]
    driver.release(handle)
    assert fake.named("hipMemRelease") == [(handle,)]
    assert handle not in fake.handles
    driver.free_reservation(va, size)
    assert fake.named("hipMemAddressFree") == [(va, size)]


def test_out_of_memory_is_its_own_error_with_hips_name(fake):
    driver = HipDriver(0, lib=fake)
    fake.fail["hipMemCreate"] = 2
    with pytest.raises(OutOfPhysicalMemoryError) as info:
        driver.create(GRANULARITY)
    assert (info.value.call, info.value.code, info.value.name) == (
        "hipMemCreate",
        2,
        "hipErrorOutOfMemory",
    )


def test_a_failed_map_raises_and_records_nothing(fake):
    driver = HipDriver(0, lib=fake)
    va = driver.reserve(4 * GRANULARITY)
    handle = driver.create(GRANULARITY)
    fake.fail["hipMemMap"] = 1
    with pytest.raises(DriverError) as info:
        driver.map(va, GRANULARITY, handle)
    assert not isinstance(info.value, OutOfPhysicalMemoryError)
    assert (info.value.call, info.value.name) == ("hipMemMap", "hipErrorInvalidValue")
    assert f"{va:#x}" in str(info.value)
    driver.map(va, GRANULARITY, handle)  # nothing was recorded as mapped
    with pytest.raises(MappingError, match="already mapped"):
        driver.map(va, GRANULARITY, handle)


def test_unmap_checks_the_range_before_calling_hip(fake):
    driver = HipDriver(0, lib=fake)
    va = driver.reserve(4 * GRANULARITY)
    handle = driver.create(2 * GRANULARITY)
    driver.map(va, 2 * GRANULARITY, handle)
    with pytest.raises(MappingError, match="no mapping of that size"):
        driver.unmap(va, GRANULARITY)
    with pytest.raises(MappingError):
        driver.unmap(va + 2 * GRANULARITY, GRANULARITY)
    assert fake.named("hipMemUnmap") == []
    fake.fail["hipMemUnmap"] = 1
    with pytest.raises(DriverError, match="hipMemUnmap"):
        driver.unmap(va, 2 * GRANULARITY)
    driver.unmap(va, 2 * GRANULARITY)  # still recorded as mapped after the failure
    assert len(fake.named("hipMemUnmap")) == 2


def test_free_reservation_refuses_live_mappings_and_unknown_ranges(fake):
    driver = HipDriver(0, lib=fake)
    va = driver.reserve(4 * GRANULARITY)
    handle = driver.create(GRANULARITY)
    driver.map(va + GRANULARITY, GRANULARITY, handle)
    with pytest.raises(MappingError, match="still inside"):
        driver.free_reservation(va, 4 * GRANULARITY)
    with pytest.raises(MappingError, match="no reservation"):
        driver.free_reservation(va, 2 * GRANULARITY)
    driver.unmap(va + GRANULARITY, GRANULARITY)
    driver.free_reservation(va, 4 * GRANULARITY)
    with pytest.raises(MappingError, match="no reservation"):
        driver.free_reservation(va, 4 * GRANULARITY)


def test_sizes_off_the_granularity_are_refused_before_hip(fake):
    driver = HipDriver(0, lib=fake)
    with pytest.raises(MappingError, match="granularity"):
        driver.create(GRANULARITY + 4096)
    with pytest.raises(MappingError, match="granularity"):
        driver.reserve(0)
    assert fake.named("hipMemCreate") == [] and fake.named("hipMemAddressReserve") == []


def test_mem_info_and_synchronize_run_on_this_device_and_switch_back(fake):
    driver = HipDriver(1, lib=fake)
    fake.current = 0
    fake.calls.clear()
    assert driver.mem_info() == (100 << 30, 192 << 30)
    assert [c for c, _ in fake.calls] == [
        "hipGetDevice",
        "hipSetDevice",
        "hipMemGetInfo",
        "hipSetDevice",
    ]
    assert fake.named("hipSetDevice") == [(1,), (0,)]
    fake.calls.clear()
    fake.current = 1  # already current: no switch
    driver.synchronize()
    assert [c for c, _ in fake.calls] == ["hipGetDevice", "hipDeviceSynchronize"]
    fake.current = 0
    fake.fail["hipMemGetInfo"] = 1
    with pytest.raises(DriverError, match="hipMemGetInfo"):
        driver.mem_info()
    assert fake.current == 0  # switched back even though the call failed


def test_info_decodes_the_strings(fake):
    info = HipDriver(1, lib=fake).info()
    assert info.backend == "hip" and info.index == 1
    assert info.name == "AMD Instinct MI300X"
    assert info.pci_bus_id == "0000:0d:00.0"
    assert info.total_bytes == 192 << 30 and info.granularity == GRANULARITY


def test_no_device_and_a_wrong_index_say_what_to_do():
    with pytest.raises(DriverUnavailableError, match="KVCACHED_DRIVER=host"):
        HipDriver(0, lib=FakeHip(init_rc=100))
    with pytest.raises(ConfigError, match="index=3 is not valid: this process sees 2 HIP"):
        HipDriver(3, lib=FakeHip())


def test_a_missing_library_names_it_and_the_variable(monkeypatch):
    monkeypatch.setattr(hip, "LIBRARY_NAMES", ("libamdhip64-kvcached-test-absent.so",))
    monkeypatch.setattr(hip, "_library", None)
    with pytest.raises(DriverUnavailableError) as info:
        HipDriver(0)
    message = str(info.value)
    assert "libamdhip64" in message and "KVCACHED_DRIVER" in message


def test_a_library_without_vmm_calls_is_unavailable(fake):
    del fake.hipMemCreate
    with pytest.raises(DriverUnavailableError, match="hipMemCreate"):
        HipDriver(0, lib=fake)


def _run_of_three(driver: HipDriver) -> tuple[int, list[int]]:
    va = driver.reserve(8 * GRANULARITY)
    handles = [driver.create(GRANULARITY) for _ in range(3)]
    for i, h in enumerate(handles):
        driver.map(va + i * GRANULARITY, GRANULARITY, h)
    return va, handles


def test_a_run_of_mappings_takes_one_set_access_and_one_unmap(fake):
    driver = HipDriver(0, lib=fake)
    va, handles = _run_of_three(driver)
    driver.set_access(va, 3 * GRANULARITY)
    assert fake.named("hipMemSetAccess") == [
        (va, 3 * GRANULARITY, {"location": (1, 0), "flags": 3}, 1)
    ]
    with pytest.raises(MappingError, match="starts at"):
        driver.unmap_range(va, GRANULARITY, 4)  # page 3 is not mapped
    assert fake.named("hipMemUnmap") == []
    driver.unmap_range(va, GRANULARITY, 3)
    assert fake.named("hipMemUnmap") == [(va, 3 * GRANULARITY)]
    for h in handles:
        driver.release(h)
    driver.free_reservation(va, 8 * GRANULARITY)  # nothing is recorded as mapped


def test_if_rocm_refuses_a_run_the_driver_goes_on_per_mapping(fake, caplog):
    driver = HipDriver(0, lib=fake)
    va, handles = _run_of_three(driver)
    fake.fail["hipMemSetAccess"] = 1  # the run call fails, each mapping's then succeeds
    driver.set_access(va, 3 * GRANULARITY)
    sizes = [(args[0], args[1]) for args in fake.named("hipMemSetAccess")]
    assert sizes == [(va, 3 * GRANULARITY)] + [
        (va + i * GRANULARITY, GRANULARITY) for i in range(3)
    ]
    assert "one call per mapping" in caplog.text
    driver.unmap_range(va, GRANULARITY, 3)  # no run is tried any more
    assert fake.named("hipMemUnmap") == [(va + i * GRANULARITY, GRANULARITY) for i in range(3)]
    for h in handles:
        driver.release(h)
    driver.free_reservation(va, 8 * GRANULARITY)


def test_a_refused_run_unmap_is_retried_per_mapping_and_counts_what_went(fake):
    driver = HipDriver(0, lib=fake)
    va, handles = _run_of_three(driver)
    fake.fail["hipMemUnmap"] = 1  # the run call; the per-mapping unmaps succeed
    driver.unmap_range(va, GRANULARITY, 3)
    assert len(fake.named("hipMemUnmap")) == 4
    for h in handles:
        driver.release(h)
    driver.free_reservation(va, 8 * GRANULARITY)
