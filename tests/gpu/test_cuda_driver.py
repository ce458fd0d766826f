"""The cuda backend on a real GPU: the host backend's behavioural checks, plus
torch kernels reading and writing tensors that alias kvcached's VA.

Run on the GPU machine (never in CI; skipped without CUDA):

    python3 -m pytest -q -m gpu tests/gpu/test_cuda_driver.py

Every kernel here touches mapped pages only: a kernel that reads an unmapped
address takes the whole CUDA context down with it. The probe of torch's
__cuda_array_interface__ reader over unmapped space runs last for the same
reason.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.cuda_marks import requires_cuda_driver

pytestmark = [pytest.mark.gpu, requires_cuda_driver]

MIB = 1 << 20


@pytest.fixture(scope="module")
def driver():
    from kvcached.driver.cuda import CudaDriver

    d = CudaDriver(0)
    yield d
    d.close()


@pytest.fixture
def G(driver) -> int:
    return driver.granularity


class Pages:
    """A reservation of ``count`` pages of ``page`` bytes, each page one
    handle; tears down whatever is still mapped."""

    def __init__(self, driver, count: int, page: int) -> None:
        self.d, self.count, self.page = driver, count, page
        self.va = driver.reserve(count * page)
        self.handles: dict[int, object] = {}

    def addr(self, slot: int) -> int:
        return self.va + slot * self.page

    def map(self, slot: int, access: bool = True) -> None:
        h = self.d.create(self.page)
        self.d.map(self.addr(slot), self.page, h)
        if access:
            self.d.set_access(self.addr(slot), self.page)
        self.handles[slot] = h

    def unmap(self, slot: int) -> None:
        self.d.synchronize()
        self.d.unmap(self.addr(slot), self.page)
        self.d.release(self.handles.pop(slot))

    def tensor(self, slot: int, pages: int = 1) -> torch.Tensor:
        return self.d.tensor(self.addr(slot), pages * self.page)

    def close(self) -> None:
        for slot in list(self.handles):
            self.unmap(slot)
        self.d.free_reservation(self.va, self.count * self.page)


@pytest.fixture
def pages(driver, G):
    made: list[Pages] = []

    def make(count: int, page: int | None = None) -> Pages:
        p = Pages(driver, count, page or G)
        made.append(p)
        return p

    yield make
    torch.cuda.synchronize()
    for p in made:
        p.close()


def test_identity_matches_torch(driver):
    info = driver.info()
    props = torch.cuda.get_device_properties(0)
    assert info.backend == "cuda" and info.index == 0
    assert info.name == props.name
    assert info.total_bytes == props.total_memory
    g = info.granularity
    assert g >= 2 * MIB and g & (g - 1) == 0
    domain, bus, rest = info.pci_bus_id.split(":")
    if hasattr(props, "pci_bus_id"):
        assert int(bus, 16) == props.pci_bus_id
    free, total = driver.mem_info()
    assert total == info.total_bytes and 0 < free <= total
    assert driver.torch_device == torch.device("cuda", 0)


def test_random_map_unmap_remap_keeps_every_other_page(pages):
    p = pages(32)
    rng = random.Random(0)
    values: dict[int, int] = {}
    for step in range(300):
        free = [s for s in range(p.count) if s not in values]
        if free and (not values or rng.random() < 0.55):
            slot = rng.choice(free)
            p.map(slot)
            values[slot] = step % 250 + 1
            p.tensor(slot).fill_(values[slot])
        else:
            slot = rng.choice(sorted(values))
            p.unmap(slot)
            del values[slot]
            if rng.random() < 0.3:  # remap the same slot with a new handle at once
                p.map(slot)
                values[slot] = 251 + step % 4
                p.tensor(slot).fill_(values[slot])
        if values:
            bad = torch.stack([(p.tensor(s) != v).any() for s, v in values.items()]).any()
            assert not bad.item(), f"a page lost its data at step {step}"
    assert len(values) > 3  # the walk did keep several pages mapped


def test_double_map_and_unmap_of_an_unmapped_range_are_refused(driver, pages, G):
    from kvcached.errors import DriverError, MappingError

    p = pages(8)
    p.map(1)
    h = driver.create(G)
    try:
        with pytest.raises(MappingError, match="already mapped"):
            driver.map(p.addr(1), G, h)
        big = driver.create(2 * G)
        try:  # overlaps slot 1 from slot 0: CUDA itself refuses
            with pytest.raises((DriverError, MappingError)) as info:
                driver.map(p.addr(0), 2 * G, big)
            assert "cuMemMap" in str(info.value) or "already mapped" in str(info.value)
        finally:
            driver.release(big)
    finally:
        driver.release(h)
    with pytest.raises(MappingError, match="no mapping of that size"):
        driver.unmap(p.addr(3), G)
    with pytest.raises(MappingError, match="no mapping of that size"):
        driver.unmap(p.addr(1), 2 * G)
    p.tensor(1).fill_(9)  # the refused calls changed nothing
    assert p.tensor(1).min().item() == 9


def test_freeing_a_reservation(driver, G):
    from kvcached.errors import MappingError

    va = driver.reserve(4 * G)
    h = driver.create(G)
    driver.map(va + G, G, h)
    driver.set_access(va + G, G)
    with pytest.raises(MappingError, match="still inside"):
        driver.free_reservation(va, 4 * G)
    driver.synchronize()
    driver.unmap(va + G, G)
    driver.release(h)
    with pytest.raises(MappingError, match="no reservation"):
        driver.free_reservation(va, 2 * G)
    driver.free_reservation(va, 4 * G)
    with pytest.raises(MappingError, match="no reservation"):
        driver.free_reservation(va, 4 * G)
    va2 = driver.reserve(4 * G)  # the space can be had again
    driver.free_reservation(va2, 4 * G)


@pytest.mark.parametrize("size_mib", [2, 64])
def test_free_memory_drops_by_the_handle_and_comes_back(driver, size_mib):
    size = size_mib * MIB
    slack = 16 * MIB  # driver bookkeeping; nothing else runs on the test GPU
    torch.cuda.synchronize()
    free0, _ = driver.mem_info()
    h = driver.create(size)
    free1, _ = driver.mem_info()
    driver.release(h)
    free2, _ = driver.mem_info()
    assert size <= free0 - free1 <= size + slack, (free0, free1)
    assert abs(free2 - free0) <= slack, (free0, free2)
    assert free2 - free1 >= size - slack


def test_torch_kernels_read_and_write_kvcached_memory(driver, pages, G):
    from kvcached.driver.tensor import view_as

    p = pages(8)
    for slot in range(4):  # four handles, one set_access over all of them
        p.map(slot, access=False)
    driver.set_access(p.addr(0), 4 * G)
    raw = p.tensor(0, pages=4)
    dev = driver.torch_device

    raw.fill_(1)  # fill_ across four separately created handles
    assert raw.sum(dtype=torch.int64).item() == 4 * G

    torch.manual_seed(0)
    n = 512
    a = view_as(raw, torch.float16, (n, n), offset=0)
    b = view_as(raw, torch.float16, (n, n), offset=G)
    c = view_as(raw, torch.float16, (n, n), offset=2 * G + MIB // 2)
    dense_a, dense_b = (
        torch.randn(n, n, device=dev, dtype=torch.float16),
        torch.randn(n, n, device=dev, dtype=torch.float16),
    )
    a.copy_(dense_a)
    b.copy_(dense_b)
    torch.matmul(a, b, out=c)
    torch.testing.assert_close(c, dense_a @ dense_b, rtol=1e-2, atol=5e-2)

    # attention with k straddling the boundary between the second and third handle;
    # a, b, c, q, k, v and out do not overlap (a 512 x 512 fp16 matrix is 512 KiB)
    shape = (2, 8, 256, 64)  # 512 KiB each in fp16
    nbytes = 2 * 8 * 256 * 64 * 2
    q = view_as(raw, torch.float16, shape, offset=3 * G)
    k = view_as(raw, torch.float16, shape, offset=2 * G - nbytes // 2)
    v = view_as(raw, torch.float16, shape, offset=3 * G + nbytes)
    out = view_as(raw, torch.float16, shape, offset=3 * G + 2 * nbytes)
    dense_q, dense_k, dense_v = (
        torch.randn(shape, device=dev, dtype=torch.float16) for _ in range(3)
    )
    q.copy_(dense_q)
    k.copy_(dense_k)
    v.copy_(dense_v)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=causal)
        out.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    # the matmul result, in another page, survived the attention writes
    torch.testing.assert_close(c, dense_a @ dense_b, rtol=1e-2, atol=5e-2)


def test_a_64mib_handle(driver, G):
    size = 64 * MIB
    va = driver.reserve(2 * size)
    h = driver.create(size)
    driver.map(va + size, size, h)
    driver.set_access(va + size, size)
    t = driver.tensor(va + size, size).view(torch.int32)
    t.copy_(torch.arange(t.numel(), device=driver.torch_device, dtype=torch.int32))
    assert t[-1].item() == t.numel() - 1
    assert t.sum(dtype=torch.int64).item() == t.numel() * (t.numel() - 1) // 2
    del t
    driver.synchronize()
    driver.unmap(va + size, size)
    driver.release(h)
    driver.free_reservation(va, 2 * size)


def test_a_new_thread_can_grow_memory_that_torch_then_uses(driver, pages, G):
    p = pages(4)
    errors: list[BaseException] = []

    def grow() -> None:
        try:
            p.map(2)  # first driver call on this thread: it binds a context itself
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=grow)
    t.start()
    t.join()
    assert not errors, errors
    p.tensor(2).fill_(42)
    assert p.tensor(2).float().mean().item() == 42.0


@pytest.mark.parametrize("via", ["storage", "cai"])
def test_both_tensor_routes_alias_the_va(driver, pages, via, G):
    from kvcached.driver.tensor import device_tensor

    p = pages(2)
    p.map(0)
    t = device_tensor(p.addr(0), G, driver.torch_device, via=via)
    assert t.data_ptr() == p.addr(0) and t.device == driver.torch_device
    t.fill_(5)
    other = device_tensor(
        p.addr(0), G, driver.torch_device, via="cai" if via == "storage" else "storage"
    )
    assert other.min().item() == 5 and other.max().item() == 5


def test_a_tensor_over_unmapped_space_works_once_mapped(driver, pages, G):
    p = pages(4)
    whole = p.tensor(0, pages=4)  # made before any page exists, as KV tensors are
    p.map(1)
    whole[G : 2 * G].fill_(3)
    assert whole[G : 2 * G].sum(dtype=torch.int64).item() == 3 * G


def test_asking_for_more_than_the_device_has_is_out_of_memory(driver, G):
    from kvcached.errors import OutOfPhysicalMemoryError

    too_much = (driver.info().total_bytes * 2 // G + 1) * G
    with pytest.raises(OutOfPhysicalMemoryError) as info:
        driver.create(too_much)
    assert info.value.call == "cuMemCreate"
    h = driver.create(G)  # and the device is fine afterwards
    driver.release(h)


def test_shared_driver_and_torch_allocations_coexist(driver):
    from kvcached.driver import get_driver

    shared = get_driver(0, "cuda")
    assert shared.info().pci_bus_id == driver.info().pci_bus_id
    x = torch.ones(1024, 1024, device="cuda:0")
    assert x.sum().item() == 1024 * 1024


def test_cai_route_over_unmapped_space_is_an_error_or_an_alias(driver, pages, G):
    from kvcached.driver.tensor import device_tensor

    p = pages(2)
    try:
        t = device_tensor(p.addr(0), G, driver.torch_device, via="cai")
    except (RuntimeError, ValueError) as exc:
        torch.cuda.synchronize()  # the refusal left no error behind for later kernels
        pytest.skip(f"torch refuses __cuda_array_interface__ over an unmapped VA: {exc}")
    assert t.data_ptr() == p.addr(0)
