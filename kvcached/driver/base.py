"""The one interface every device backend implements.

A backend hands out three kinds of things: *virtual address ranges* (reserved,
never backed by themselves), *physical handles* (memory of N bytes, a multiple
of :attr:`Driver.granularity`), and *mappings* of a whole handle at an offset of
a reservation. The life of a page is always::

    reserve -> create -> map -> set_access -> (use) -> unmap -> release

and whatever fails halfway is undone in reverse by the caller (the memory
layer keeps an undo stack). Runs of adjacent mappings cost fewer calls: one
``set_access`` may cover several mappings made one by one, and one
``unmap_range`` removes several. The H200 charges mostly per mapping even
then: runs of 32 grew 1.04x and shrank 1.07x the per-page loops
(``benchmarks/driver_runs.py``, ``benchmarks/results/h200/run13``). Sizes and offsets are multiples of the granularity;
a handle is mapped whole, at offset 0 of the handle (CUDA's rule), and
unmapped whole.

Handles are opaque to callers: cuda-python's ``CUmemGenericAllocationHandle``
on CUDA (handed back to the driver as is, the cheapest form), an ``int`` on
HIP, a small object on the host backend. Pass them back unchanged.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

Handle = Any


@dataclass(frozen=True)
class DeviceInfo:
    """What a user and the ledger need to know to name a device."""

    backend: str
    index: int
    name: str
    pci_bus_id: str
    total_bytes: int
    granularity: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Driver(abc.ABC):
    """A device's virtual-memory calls. One instance per device, shared by the
    whole process (see :func:`kvcached.driver.get_driver`).

    Invariants the implementations keep:

    * every failed call raises :class:`~kvcached.errors.DriverError` (or its
      subclass :class:`~kvcached.errors.OutOfPhysicalMemoryError` when the device
      has no memory left) and leaves the device as it was before the call;
    * ``map`` never replaces an existing mapping and ``unmap`` only removes a
      mapping made by ``map`` with the same ``va`` and ``size``.
    """

    backend: ClassVar[str]

    def __init__(self, index: int) -> None:
        self.index = index

    # -- identity and capacity ------------------------------------------------
    @property
    @abc.abstractmethod
    def granularity(self) -> int:
        """The smallest size and alignment of a handle and a mapping, in bytes."""

    @abc.abstractmethod
    def info(self) -> DeviceInfo:
        """Backend, index, name, PCI bus id, total memory and granularity."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, as every process on it sees them."""

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device:
        """The torch device whose tensors may alias this driver's mappings."""

    # -- virtual address space --------------------------------------------------
    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space; return its start."""

    @abc.abstractmethod
    def free_reservation(self, va: int, size: int) -> None:
        """Give back a reservation. Every mapping inside must be unmapped first."""

    # -- physical memory ----------------------------------------------------------
    @abc.abstractmethod
    def create(self, size: int) -> Handle:
        """Create a physical handle of ``size`` bytes (device memory is taken now)."""

    @abc.abstractmethod
    def release(self, handle: Handle) -> None:
        """Release a handle. Its memory returns to the device once it is unmapped."""

    @abc.abstractmethod
    def map(self, va: int, size: int, handle: Handle) -> None:
        """Map the whole ``handle`` (``size`` bytes) at ``va`` inside a reservation."""

    @abc.abstractmethod
    def set_access(self, va: int, size: int) -> None:
        """Make ``[va, va+size)`` readable and writable by this device. One call
        may cover several adjacent mappings."""

    @abc.abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Remove the mapping at ``va`` of ``size`` bytes."""

    def unmap_range(self, va: int, size: int, count: int) -> None:
        """Remove ``count`` adjacent mappings of ``size`` bytes each, the first
        at ``va``. The GPU and host backends do it in one call, all or nothing
        (on an error every mapping is still there). This default makes one
        :meth:`unmap` per mapping; when one fails, the error's ``unmapped``
        attribute says how many leading mappings are gone."""
        for i in range(count):
            try:
                self.unmap(va + i * size, size)
            except Exception as exc:
                exc.unmapped = i  # type: ignore[attr-defined]
                raise

    # -- tensors ---------------------------------------------------------------------
    @abc.abstractmethod
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` tensor of ``nbytes`` that aliases ``[va, va+nbytes)``
        without copying. View it as any dtype and shape with
        :func:`kvcached.driver.tensor.view_as`."""

    def synchronize(self) -> None:
        """Wait until every kernel that may read a mapping has finished (before
        unmap). The host backend has nothing to wait for."""

    def close(self) -> None:
        """Drop process-wide resources (contexts). Idempotent."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend}:{self.index}>"


def check_free_reservation(
    reservations: dict[int, int], mapped: dict[int, int], va: int, size: int
) -> None:
    """Refuse to free a reservation that is not one (``va``, ``size``) or that
    still holds mappings: the bookkeeping the GPU backends share."""
    from kvcached.errors import MappingError

    if reservations.get(va) != size:
        raise MappingError(
            f"free_reservation(va={va:#x}, size={size}): no reservation starts there with that size"
        )
    inside = sum(1 for m in list(mapped) if va <= m < va + size)
    if inside:
        raise MappingError(
            f"free_reservation(va={va:#x}): {inside} mapping(s) are still inside; unmap them first"
        )
