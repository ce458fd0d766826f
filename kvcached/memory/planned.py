"""A page backend that plans instead of mapping: for a scheduler that holds no KV.

Under vLLM the process that decides which blocks exist (the engine core) holds
no KV tensors; its workers do. :class:`PlannedPages` stands in for a
:class:`~kvcached.memory.mapper.PageMapper` under a
:class:`~kvcached.memory.pages.PageAllocator`: the page policy (idle reserve,
cap, trim, best-fit blocks above it) runs unchanged, and every map or unmap it
decides becomes a :data:`PageOp` in a queue that the integration carries to
the workers, who apply it with their own mappers in the same order.

Accounting (the rules of ``kvcached.memory.budget`` with a delay in between):

* a map is granted here, when it is planned, before any worker creates memory;
  a denial is ``False`` from :meth:`map_run`, a scheduling miss;
* an unmap is refunded only after the workers confirmed it: the bytes of the
  unmaps taken with :meth:`take_ops` are handed to the caller, which refunds
  them (:meth:`confirm`) once every worker has applied those ops;
* a map and an unmap of the same run that are both still queued cancel out:
  an unmap of a run whose map was never sent refunds at once (nothing was
  created), and a map of a run whose unmap was never sent keeps the mapping
  (nothing is granted twice).

Page ``0`` can be *premapped*: the workers map it themselves at start (vLLM's
null block lives there and dummy runs write it before any plan exists). Its
map is granted but never queued. It is never unmapped, except while
:attr:`PlannedPages.release_page0` is set (the planner parks the null block of
an idle engine held at zero); mapped again, its map is queued like any other.
"""

from __future__ import annotations

from kvcached.errors import MappingError
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.spec import PageShape

#: One page operation: ``("map" | "unmap", first_page, page_count)``. Plain
#: tuples so that they pickle small and fast to every worker.
PageOp = tuple[str, int, int]
MAP, UNMAP = "map", "unmap"


class PlannedPages:
    """The :class:`~kvcached.memory.mapper.PageBackend` of a planner. See the
    module docstring. Not thread-safe: one scheduler thread drives it."""

    def __init__(
        self,
        geometry: PageShape,
        budget: PhysicalBudget,
        *,
        max_run_pages: int,
        premapped_page0: bool = True,
    ) -> None:
        if max_run_pages < 1:
            raise MappingError(f"max_run_pages={max_run_pages}: must be >= 1")
        self.geometry = geometry
        self.budget = budget
        self.page_bytes = geometry.page_bytes
        self.max_run_pages = max_run_pages
        self.mapped_pages = 0
        self._extents: dict[int, int] = {}  # first page -> count, of planned mappings
        self._owner = [-1] * geometry.num_pages  # page -> first page of its extent
        self._queue: list[PageOp] = []
        self._queued_refund = 0  # bytes of queued unmaps, refunded after confirmation
        self._page0_premapped = premapped_page0
        #: Set while the null block is parked: page 0 may then be unmapped.
        self.release_page0 = False
        self.maps = 0
        self.unmaps = 0
        self.cancelled = 0

    # -- the PageBackend protocol ---------------------------------------------------
    def map_run(self, first: int, count: int) -> bool:
        g = self.geometry
        if count < 1 or first < 0 or first + count > g.num_pages or count > self.max_run_pages:
            raise MappingError(
                f"map_run(first={first}, count={count}) is outside the plan "
                f"({g.num_pages} pages, runs of at most {self.max_run_pages})"
            )
        for p in range(first, first + count):
            if self._owner[p] != -1:
                raise MappingError(f"map_run: page {p} is already planned")
        nbytes = count * self.page_bytes
        op = (UNMAP, first, count)
        if op in self._queue:  # its unmap was never sent: the workers still map it
            self._queue.remove(op)
            self._queued_refund -= nbytes
            self.cancelled += 1
        elif not self.budget.grant(nbytes):
            return False
        elif first == 0 and self._page0_premapped:
            if count != 1:
                raise MappingError(
                    "page 0 is premapped by the workers: it must be a run of its own"
                )
            self._page0_premapped = False
        else:
            self._queue.append((MAP, first, count))
            self.maps += 1
        self._extents[first] = count
        for p in range(first, first + count):
            self._owner[p] = first
        self.mapped_pages += count
        return True

    def unmap_runs(self, spans: list[tuple[int, int]]) -> list[bool]:
        for first, count in spans:
            if self._extents.get(first) != count:
                raise MappingError(f"unmap [{first}, {first + count}) is not one planned run")
            if first == 0 and not self.release_page0:
                raise MappingError("page 0 (the null block's) is never unmapped")
        for first, count in spans:
            nbytes = count * self.page_bytes
            op = (MAP, first, count)
            if op in self._queue:  # never sent: nothing was created
                self._queue.remove(op)
                self.budget.refund(nbytes)
                self.cancelled += 1
            else:
                self._queue.append((UNMAP, first, count))
                self._queued_refund += nbytes
                self.unmaps += 1
            del self._extents[first]
            for p in range(first, first + count):
                self._owner[p] = -1
            self.mapped_pages -= count
        return [True] * len(spans)

    def retry_quarantined(
        self, spans: list[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]:
        return []  # nothing is quarantined here: a worker's failure is its own error

    def extent_of(self, page: int) -> tuple[int, int] | None:
        first = self._owner[page]
        return None if first == -1 else (first, self._extents[first])

    def unmap_all(self) -> bool:
        spans = [(f, c) for f, c in self._extents.items() if f != 0]
        self.unmap_runs(spans)
        return True

    # -- the queue ------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether ops wait to be carried to the workers."""
        return bool(self._queue)

    def take_ops(self) -> tuple[list[PageOp], int]:
        """The queued ops, oldest first, and the bytes their unmaps free; the
        caller refunds those bytes once every worker applied the ops."""
        ops, refund = self._queue, self._queued_refund
        self._queue, self._queued_refund = [], 0
        return ops, refund

    def confirm(self, refund_bytes: int) -> None:
        """Every worker applied ops whose unmaps free ``refund_bytes``: refund them."""
        if refund_bytes:
            self.budget.refund(refund_bytes)
