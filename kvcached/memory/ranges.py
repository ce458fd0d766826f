"""Virtual KV memory as one reservation whose pages are byte ranges ("lanes").

Some engines allocate their KV cache as one flat buffer and lay it out
themselves (vLLM: one ``int8`` backing tensor, per-layer strided views whose
storage offsets are fixed by its own layout). kvcached then does not decide
where layers live; it reserves that buffer and maps pages under it.

A :class:`PageLanes` geometry says where a page lies. The buffer is cut into
*lanes* ``(base, stride)`` (a layer's region, a head's region inside it, or the
whole buffer for a block-outermost layout); page ``k`` is the bytes
``[base + k*stride, base + (k+1)*stride)`` of every lane, i.e. the same blocks in
every lane. Rules the class checks when it is built:

* every ``base`` and ``stride`` is a multiple of the driver granularity, so a page
  maps on its own, and adjacent pages of one lane are one contiguous run (an
  extent of one handle per lane);
* lanes never overlap and all lie inside the buffer (rounded up to the
  granularity);
* page ``k`` holds blocks ``[k*blocks_per_page, (k+1)*blocks_per_page)``.

:class:`RangeKVTensors` owns the reservation and offers what
:class:`~kvcached.memory.mapper.PageMapper` needs of a tensor set (``driver``,
``geometry``, ``extent_ranges``, ``handle_strides``), so the memory layer's mapper, with its undo
stack and quarantine, maps these pages unchanged.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from kvcached.driver.base import Driver
from kvcached.errors import ConfigError, KVCachedError, MappingError
from kvcached.log import get_logger

log = get_logger("kvcached.memory")


@dataclass(frozen=True)
class PageLanes:
    """Where each page of a flat KV buffer lies. See the module docstring."""

    size: int
    lanes: tuple[tuple[int, int], ...]
    num_pages: int
    blocks_per_page: int
    granularity: int

    def __post_init__(self) -> None:
        g = self.granularity
        if not isinstance(g, int) or g < 1:
            raise ConfigError("granularity", g, "a positive number of bytes")
        if self.size < 1:
            raise ConfigError("size", self.size, "a buffer of at least one byte")
        if self.num_pages < 1 or self.blocks_per_page < 1:
            raise ConfigError(
                "num_pages/blocks_per_page",
                (self.num_pages, self.blocks_per_page),
                "at least one page of at least one block",
            )
        if not self.lanes:
            raise ConfigError("lanes", self.lanes, "at least one (base, stride) lane")
        end_of_buffer = -(-self.size // g) * g
        previous_end = 0
        for base, stride in sorted(self.lanes):
            if base % g or stride % g or stride <= 0:
                raise ConfigError(
                    "lanes",
                    (base, stride),
                    f"base and stride multiples of the granularity ({g} bytes)",
                )
            if base < previous_end:
                raise ConfigError("lanes", self.lanes, "lanes that do not overlap")
            previous_end = base + self.num_pages * stride
            if previous_end > end_of_buffer:
                raise ConfigError(
                    "lanes",
                    (base, stride),
                    f"{self.num_pages} pages of {stride} bytes from {base} end past the "
                    f"{end_of_buffer}-byte buffer",
                )

    @property
    def page_bytes(self) -> int:
        """Physical bytes of one page (all lanes)."""
        return sum(stride for _, stride in self.lanes)

    @property
    def handle_bytes_per_page(self) -> int:
        """The largest handle one page needs (one handle per lane)."""
        return max(stride for _, stride in self.lanes)

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.blocks_per_page

    @property
    def reservation_bytes(self) -> int:
        g = self.granularity
        return -(-self.size // g) * g

    def page_of(self, block: int) -> int:
        return block // self.blocks_per_page

    def run_ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(offset, length)`` in the buffer of pages ``[first, first+count)``,
        one range per lane."""
        if first < 0 or count < 1 or first + count > self.num_pages:
            raise MappingError(
                f"pages [{first}, {first + count}) are outside the {self.num_pages} pages"
            )
        return [(base + first * stride, count * stride) for base, stride in self.lanes]


def _free(driver: Driver, reservation: list[tuple[int, int]]) -> None:
    while reservation:
        va, size = reservation.pop()
        try:
            driver.free_reservation(va, size)
        except KVCachedError as exc:  # mappings left inside: keep the range, say so
            log.warning("KV address space at %#x kept: %s", va, exc)


class RangeKVTensors:
    """One reservation of a :class:`PageLanes` buffer, and a flat tensor over it.

    Owns the address space: :meth:`close` gives it back (idempotent; unmap
    every page first), as does the garbage collector as a last resort.
    """

    def __init__(self, driver: Driver, lanes: PageLanes) -> None:
        if driver.granularity > lanes.granularity or lanes.granularity % driver.granularity:
            raise ConfigError(
                "granularity",
                lanes.granularity,
                f"a multiple of the driver's granularity ({driver.granularity} bytes)",
            )
        self.driver = driver
        self.geometry = lanes
        self.lanes = lanes
        size = lanes.reservation_bytes
        self.va = driver.reserve(size)
        self._reservation = [(self.va, size)]
        self._lock = threading.Lock()
        self.closed = False
        self._finalizer = weakref.finalize(self, _free, driver, self._reservation)

    def extent_ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(va, size)`` of each handle that maps pages ``[first, first+count)``
        as one extent (one per lane)."""
        va = self.va
        return [(va + off, n) for off, n in self.lanes.run_ranges(first, count)]

    def handle_strides(self) -> tuple[tuple[int, int], ...]:
        """``(va, stride)`` of each lane: handle ``i`` of pages ``[first,
        first+count)`` maps ``(va_i + first * stride_i, count * stride_i)``."""
        return tuple((self.va + base, stride) for base, stride in self.lanes.lanes)

    def buffer(self, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """The whole buffer (``lanes.size`` bytes) as a 1-D tensor of ``dtype``
        bytes on the driver's device, aliasing the reservation. Reads of an
        unmapped page give zeros on the host backend; writes fault."""
        if self.closed:
            raise MappingError("the KV buffer was closed")
        raw = self.driver.tensor(self.va, self.lanes.size)
        return raw if dtype == torch.uint8 else raw.view(dtype)

    def close(self) -> None:
        """Give the address space back. Idempotent."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._finalizer()

    def __enter__(self) -> RangeKVTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
