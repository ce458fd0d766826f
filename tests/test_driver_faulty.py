"""The fault-injecting wrapper: the right error types, and no half-done state."""

from __future__ import annotations

import os

import pytest

from kvcached.driver.faulty import FaultyDriver, InjectedFault
from kvcached.driver.host import GRANULARITY as G
from kvcached.driver.host import HostDriver
from kvcached.errors import DriverError, OutOfPhysicalMemoryError
from kvcached.units import MIB


@pytest.fixture
def host():
    return HostDriver(index=200_000 + os.getpid(), capacity=64 * MIB)


def test_nth_create_fails_as_out_of_memory_and_takes_nothing(host):
    d = FaultyDriver(host, fail_nth={"create": 2})
    first = d.create(G)
    with pytest.raises(OutOfPhysicalMemoryError) as err:
        d.create(G)
    assert isinstance(err.value, InjectedFault)
    assert (err.value.call, err.value.name, err.value.code) == ("memfd_create", "ENOMEM", 12)
    assert host.own_bytes() == G  # the failed call took no memory
    third = d.create(G)
    assert d.calls["create"] == 3 and d.injected["create"] == 1
    d.release(first)
    d.release(third)
    assert host.own_bytes() == 0


def test_failed_map_leaves_range_unmapped(host):
    d = FaultyDriver(host)
    va = d.reserve(2 * G)
    h = d.create(G)
    d.fail_next("map")
    with pytest.raises(DriverError) as err:
        d.map(va, G, h)
    assert err.value.call == "mmap"
    assert int(d.tensor(va, G).sum()) == 0
    d.map(va, G, h)  # the range is free: the retry succeeds
    d.tensor(va, G).fill_(4)
    assert int(d.tensor(va, G)[5]) == 4
    d.fail_next("unmap")
    with pytest.raises(DriverError):
        d.unmap(va, G)
    assert int(d.tensor(va, G)[5]) == 4  # still mapped, data intact
    d.unmap(va, G)
    d.fail_next("release")
    with pytest.raises(DriverError):
        d.release(h)
    assert host.own_bytes() == G  # a failed release keeps the memory
    d.release(h)
    assert host.own_bytes() == 0
    d.free_reservation(va, 2 * G)


def test_cuda_names_for_cuda_backends(host):
    class FakeCuda:
        backend = "cuda"
        index = 0

    d = FaultyDriver(host, fail_nth={"map": 1})
    d.inner = FakeCuda()  # only the naming path is exercised
    with pytest.raises(OutOfPhysicalMemoryError) as err:
        d._before("map")
    assert (err.value.call, err.value.name, err.value.code) == (
        "cuMemMap",
        "CUDA_ERROR_OUT_OF_MEMORY",
        2,
    )


def test_probability_is_seeded_and_repeatable(host):
    def pattern(seed):
        d = FaultyDriver(host, probability={"set_access": 0.5}, seed=seed)
        va = d.reserve(G)
        h = d.create(G)
        d.map(va, G, h)
        seen = []
        for _ in range(40):
            try:
                d.set_access(va, G)
                seen.append(0)
            except DriverError:
                seen.append(1)
        d.unmap(va, G)
        d.release(h)
        d.free_reservation(va, G)
        return seen

    a, b = pattern(3), pattern(3)
    assert a == b and 5 < sum(a) < 35


def test_unknown_call_is_refused(host):
    with pytest.raises(ValueError, match="not one of"):
        FaultyDriver(host, fail_nth={"mmap": 1})


def test_unmap_range_counts_as_its_unmaps_and_fails_whole(host):
    d = FaultyDriver(host, fail_nth={"unmap": 3})
    va = d.reserve(4 * G)
    handles = [d.create(G) for _ in range(4)]
    for i, h in enumerate(handles):
        d.map(va + i * G, G, h)
    d.set_access(va, 4 * G)
    d.tensor(va, 4 * G).fill_(7)
    with pytest.raises(DriverError) as err:
        d.unmap_range(va, G, 4)  # unmaps 1-4: the 3rd is chosen, so none happens
    assert "injected fault #3 of unmap" in str(err.value)
    assert int(d.tensor(va, 4 * G).min()) == 7  # every page still mapped
    assert d.calls["unmap"] == 4 and d.injected["unmap"] == 1
    d.unmap_range(va, G, 4)
    assert d.calls["unmap"] == 8 and int(d.tensor(va, 4 * G).max()) == 0
    for h in handles:
        d.release(h)
    d.free_reservation(va, 4 * G)


def test_the_default_unmap_range_says_how_many_went(host):
    from kvcached.driver.base import Driver

    d = FaultyDriver(host, fail_nth={"unmap": 2})
    va = d.reserve(3 * G)
    handles = [d.create(G) for _ in range(3)]
    for i, h in enumerate(handles):
        d.map(va + i * G, G, h)
    with pytest.raises(DriverError) as err:
        Driver.unmap_range(d, va, G, 3)  # the base class's loop: one unmap each
    assert err.value.unmapped == 1  # the first went, the second failed, the third waits
    d.unmap_range(va + G, G, 2)
    for h in handles:
        d.release(h)
    d.free_reservation(va, 3 * G)
