"""The host backend, for real: memfds mapped into an mmap reservation."""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcached.driver.host import GRANULARITY, HostDriver
from kvcached.driver.tensor import view_as
from kvcached.errors import MappingError, OutOfPhysicalMemoryError
from kvcached.units import MIB

G = GRANULARITY


@pytest.fixture
def driver():
    # A device id of this test process alone, so helpers or other tests running
    # beside it do not move its free-memory figures.
    return HostDriver(index=100_000 + os.getpid(), capacity=256 * MIB)


def rss_shmem_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


def test_identity_and_capacity(driver):
    info = driver.info()
    assert info.backend == "host"
    assert info.pci_bus_id == f"host-{driver.index}"
    assert info.total_bytes == 256 * MIB
    assert info.granularity == G
    free, total = driver.mem_info()
    assert total == 256 * MIB and 0 < free <= total


@pytest.mark.slow
def test_random_remaps_keep_every_other_page_intact(driver):
    pages = 24
    va = driver.reserve(pages * G)
    raw = driver.tensor(va, pages * G)
    words = raw.view(torch.int64).view(pages, G // 8)
    mapped: dict[int, tuple[object, int]] = {}  # page -> (handle, stamp)
    rng = random.Random(1)
    for step in range(150):
        page = rng.randrange(pages)
        if page in mapped:
            handle, _ = mapped.pop(page)
            driver.unmap(va + page * G, G)
            driver.release(handle)
            assert int(words[page].abs().sum()) == 0, "an unmapped page must read zeros"
        else:
            handle = driver.create(G)
            driver.map(va + page * G, G, handle)
            driver.set_access(va + page * G, G)
            assert int(words[page].abs().sum()) == 0, "a new page starts zeroed"
            words[page].fill_(step + 1)
            mapped[page] = (handle, step + 1)
        for other, (_, stamp) in mapped.items():
            row = words[other]
            assert (
                int(row[0]) == stamp and int(row[-1]) == stamp and int(row[len(row) // 2]) == stamp
            )
    for page, (handle, _) in mapped.items():
        driver.unmap(va + page * G, G)
        driver.release(handle)
    driver.free_reservation(va, pages * G)
    assert driver.own_bytes() == 0


def test_typed_views_alias_mapped_pages_without_copy(driver):
    va = driver.reserve(4 * G)
    h = driver.create(2 * G)
    driver.map(va + G, 2 * G, h)
    raw = driver.tensor(va, 4 * G)
    kv = view_as(raw, torch.float16, (2, 4, 16, 8, 64), offset=G)
    kv.fill_(1.5)
    again = view_as(driver.tensor(va + G, 2 * G), torch.float16, (2, 4, 16, 8, 64))
    assert again.data_ptr() == va + G
    assert bool((again == 1.5).all())
    with pytest.raises(ValueError, match="needs"):
        view_as(raw, torch.float32, (4 * G,))
    driver.unmap(va + G, 2 * G)
    driver.release(h)
    driver.free_reservation(va, 4 * G)


def test_double_map_and_bad_unmap_are_refused(driver):
    va = driver.reserve(4 * G)
    h = driver.create(G)
    driver.map(va, G, h)
    other = driver.create(2 * G)
    with pytest.raises(MappingError, match="already mapped"):
        driver.map(va, 2 * G, other)
    with pytest.raises(MappingError, match="no mapping of that size"):
        driver.unmap(va + G, G)
    with pytest.raises(MappingError, match="no mapping of that size"):
        driver.unmap(va, 2 * G)
    with pytest.raises(MappingError, match="not inside a reservation"):
        driver.map(va + 4 * G, 2 * G, other)
    with pytest.raises(MappingError, match="multiples of the granularity"):
        driver.map(va + 4096, 2 * G, other)
    with pytest.raises(MappingError, match="mapped whole"):
        driver.map(va + 2 * G, G, other)
    with pytest.raises(MappingError, match="not mapped"):
        driver.set_access(va, 2 * G)
    with pytest.raises(MappingError, match="still inside"):
        driver.free_reservation(va, 4 * G)
    # the refused calls changed nothing: the first mapping still holds its data
    driver.tensor(va, G).fill_(9)
    assert int(driver.tensor(va, G)[123]) == 9
    driver.release(other)
    with pytest.raises(MappingError, match="already released"):
        driver.release(other)
    driver.unmap(va, G)
    driver.release(h)
    driver.free_reservation(va, 4 * G)
    with pytest.raises(MappingError, match="no reservation"):
        driver.free_reservation(va, 4 * G)


def test_capacity_is_enforced(driver):
    handles = [driver.create(64 * MIB) for _ in range(4)]
    with pytest.raises(OutOfPhysicalMemoryError) as err:
        driver.create(G)
    assert err.value.call == "memfd_create" and err.value.name == "ENOMEM"
    free, _ = driver.mem_info()
    assert free == 0
    for h in handles:
        driver.release(h)
    assert driver.mem_info()[0] == 256 * MIB


def test_rss_follows_touch_and_release(driver):
    va = driver.reserve(32 * G)
    before = rss_shmem_kib()
    h = driver.create(32 * G)
    driver.map(va, 32 * G, h)
    driver.tensor(va, 32 * G).fill_(1)
    touched = rss_shmem_kib()
    assert touched - before >= 60 * 1024, (before, touched)
    driver.unmap(va, 32 * G)
    driver.release(h)
    after = rss_shmem_kib()
    assert after - before < 4 * 1024, (before, touched, after)
    driver.free_reservation(va, 32 * G)


def test_release_while_mapped_keeps_memory_until_unmap(driver):
    va = driver.reserve(G)
    h = driver.create(G)
    driver.map(va, G, h)
    driver.release(h)
    driver.tensor(va, G).fill_(3)  # still backed
    assert driver.own_bytes() == G
    driver.unmap(va, G)
    assert driver.own_bytes() == 0
    driver.free_reservation(va, G)


@pytest.mark.slow
def test_free_memory_is_shared_across_processes(driver):
    """Another process' handles on the same device lower this one's free memory,
    and come back when that process dies."""
    script = textwrap.dedent(f"""
        import sys, time
        from kvcached.driver.host import HostDriver
        d = HostDriver(index={driver.index}, capacity={driver.capacity})
        hs = [d.create(32 << 20) for _ in range(2)]
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        free, total = driver.mem_info()
        assert free == total - 64 * MIB
        with pytest.raises(OutOfPhysicalMemoryError):
            driver.create(200 * MIB)
    finally:
        child.kill()
        child.wait(10)
    assert driver.mem_info()[0] == driver.capacity


@pytest.mark.slow
def test_write_to_unmapped_range_faults(driver):
    """A stray write faults loudly (SIGSEGV) rather than corrupting memory."""
    script = textwrap.dedent("""
        from kvcached.driver.host import HostDriver
        d = HostDriver(index=7, capacity=64 << 20)
        va = d.reserve(4 << 20)
        t = d.tensor(va, 4 << 20)
        assert int(t.sum()) == 0
        print("read ok", flush=True)
        t[10] = 1
        print("wrote", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "read ok" in out.stdout and "wrote" not in out.stdout
    assert out.returncode == -11, (out.returncode, out.stderr[-500:])


def test_unmap_range_removes_a_run_in_one_call_and_keeps_its_neighbours(driver):
    g = driver.granularity
    va = driver.reserve(6 * g)
    handles = [driver.create(g) for _ in range(5)]
    for i, h in enumerate(handles):
        driver.map(va + i * g, g, h)
    driver.set_access(va, 5 * g)  # one call over five mappings
    for i in range(5):
        ctypes.memset(va + i * g, 0x20 + i, g)
    with pytest.raises(MappingError, match="starts at"):
        driver.unmap_range(va + 2 * g, g, 4)  # page 5 is not mapped: nothing changes
    assert ctypes.string_at(va + 4 * g, 2) == b"\x24\x24"
    with pytest.raises(MappingError, match="count=0"):
        driver.unmap_range(va, g, 0)
    driver.unmap_range(va + g, g, 3)
    assert ctypes.string_at(va + g, 2) == b"\0\0"  # zero pages again
    assert ctypes.string_at(va + 3 * g + g - 2, 2) == b"\0\0"
    assert ctypes.string_at(va, 2) == b"\x20\x20"
    assert ctypes.string_at(va + 4 * g, 2) == b"\x24\x24"
    for h in handles[1:4]:
        driver.release(h)  # unmapped and released: their memory goes back
    assert driver.own_bytes() == 2 * g
    h = driver.create(3 * g)  # the hole takes a new mapping
    driver.map(va + g, 3 * g, h)
    driver.unmap(va + g, 3 * g)
    driver.unmap_range(va, g, 1)
    driver.unmap(va + 4 * g, g)
    for h2 in (handles[0], handles[4], h):
        driver.release(h2)
    driver.free_reservation(va, 6 * g)
