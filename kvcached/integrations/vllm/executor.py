"""A vLLM worker's side of kvcached: the virtual KV buffer and its pages.

:class:`PageExecutor` owns this rank's reservation (one
:class:`~kvcached.memory.ranges.RangeKVTensors` of exactly the bytes vLLM asked
for) and a :class:`~kvcached.memory.mapper.PageMapper` over it. It decides
nothing: the engine core plans and charges every page, and the executor
applies the ops it receives, in order, before the step that needs them.

* Page 0 (vLLM's null block, written by dummy and warm-up runs before any
  plan exists) is mapped at start and never unmapped.
* Unmaps come before a step's first kernel too; the mapper synchronizes the
  device first, so no earlier step still reads the page.
* A map the device refuses although the ledger granted it (the ledger is an
  estimate) is retried for :data:`MAP_RETRY_S`, while calibration catches up,
  then reported as failed; the caller raises, since the step is already
  decided and a kernel must never touch an unmapped page.
* The worker calibrates its device's ledger (it is the process that can ask
  the driver), without owning a pool there.
* Ops a step does not touch (the planner's ``overlap``) run in a thread of the
  executor's own beside the step (:meth:`PageExecutor.overlap`), batches in
  queue order; they may still run beside later steps, until the planner makes
  a step wait for them (:meth:`PageExecutor.finish`): one that uses a page
  they map, or has ops of its own to apply first. The worker waits before it
  applies anything itself, so the mapper is never driven by two threads at
  once and every op still lands in queue order. The driver calls release the GIL,
  so the step's own thread keeps launching kernels meanwhile. But the page
  thread needs the GIL back after every call, and a step busy in Python hands
  it over only at the interpreter's switch interval (5 ms): on an H100 a
  32-handle page took 354 ms beside a thread busy in Python instead of 2 ms
  (``benchmarks/driver_gil.py``). While overlapped ops run, the switch
  interval is therefore :data:`OVERLAP_SWITCH_INTERVAL_S` (9.9 ms a page
  there, the busy thread keeping 0.93 of its speed), and the interval the
  process had is put back as soon as they end.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvcached.config import Config
from kvcached.driver.base import Driver
from kvcached.errors import CapacityError
from kvcached.integrations.vllm.stalls import StepStalls
from kvcached.log import get_logger
from kvcached.memory.composite_budget import PrechargedBudget
from kvcached.memory.mapper import PageMapper
from kvcached.memory.planned import MAP, UNMAP, PageOp
from kvcached.memory.ranges import PageLanes, RangeKVTensors
from kvcached.units import MIB

log = get_logger("integrations.vllm")

#: How long a worker keeps retrying a map the device refused.
MAP_RETRY_S = 5.0

#: The interpreter's switch interval while overlapped ops run (module docstring);
#: ``None`` leaves the process' own.
OVERLAP_SWITCH_INTERVAL_S: float | None = 2e-5

# One lowered interval at a time per process (every executor of a process shares it).
_switch_lock = threading.Lock()
_switch_saved: list[float] = []


def _lower_switch_interval() -> None:
    with _switch_lock:
        if OVERLAP_SWITCH_INTERVAL_S is None:
            return
        current = sys.getswitchinterval()
        _switch_saved.append(current)
        sys.setswitchinterval(min(current, OVERLAP_SWITCH_INTERVAL_S))


def _restore_switch_interval() -> None:
    with _switch_lock:
        if _switch_saved:
            saved = _switch_saved.pop()
            if not _switch_saved:
                sys.setswitchinterval(saved)


class PageExecutor:
    """See the module docstring. One per worker process (per KV allocation)."""

    def __init__(
        self,
        driver: Driver,
        lanes: PageLanes,
        *,
        calibrate: bool = True,
        settings: Config | None = None,
    ) -> None:
        self.driver = driver
        self.lanes = lanes
        self.tensors = RangeKVTensors(driver, lanes)
        self.budget = PrechargedBudget()
        self.mapper = PageMapper(
            self.tensors,
            self.budget,
            max_handle_bytes=lanes.num_pages * lanes.handle_bytes_per_page,
        )
        self.calibrator = None
        self._thread: ThreadPoolExecutor | None = None
        self._overlapped: list[Future[bool]] = []  # batches in flight, in queue order
        self.overlapped_maps = False  # whether the ops in flight there map pages
        self.failed_maps = 0
        self.maps = 0
        self.unmaps = 0
        self.stalls = StepStalls()
        try:
            if not self.mapper.map_run(0, 1):
                raise CapacityError(
                    f"kvcached could not map the first page of the KV cache "
                    f"({lanes.page_bytes / MIB:.1f} MiB, the null block's) on {driver!r}"
                )
            if calibrate:
                from kvcached.ledger import open_ledger

                ledger = open_ledger(driver, config=settings)
                self.calibrator = ledger.calibrator(driver).start()
        except BaseException:
            self.close()
            raise

    def buffer(self) -> torch.Tensor:
        """vLLM's backing buffer: ``lanes.size`` bytes of ``int8`` over the reservation."""
        return self.tensors.buffer(torch.int8)

    def apply(self, ops: Sequence[PageOp]) -> bool:
        """Apply ``ops`` in order (runs of unmaps share one device sync, runs
        of maps one ``map_runs``).
        ``False`` when a map failed even after retrying (the ops before it are
        applied, the rest not)."""
        mapper = self.mapper
        i, n = 0, len(ops)
        while i < n:
            kind, first, count = ops[i]
            if kind == UNMAP:
                spans = []
                while i < n and ops[i][0] == UNMAP:
                    spans.append((ops[i][1], ops[i][2]))
                    i += 1
                for (f, c), ok in zip(spans, mapper.unmap_runs(spans), strict=True):
                    if not ok:
                        log.warning(
                            "pages [%d, %d) could not be released; kept quarantined", f, f + c
                        )
                self.unmaps += len(spans)
                continue
            assert kind == MAP, f"invariant: a page op is map or unmap, not {kind!r}"
            spans = []
            while i < n and ops[i][0] == MAP:  # one map_runs: adjacent extents share calls
                spans.append((ops[i][1], ops[i][2]))
                i += 1
            if not self._map(spans):
                return False
        return True

    def overlap(self, ops: Sequence[PageOp]) -> None:
        """Start applying ``ops`` in the executor's thread, after any batch
        still in flight there (one thread: queue order is kept); :meth:`finish`
        waits for all of them."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvcached-page-ops")
        self.overlapped_maps = self.overlapped_maps or any(op[0] == MAP for op in ops)
        _lower_switch_interval()
        try:
            self._overlapped.append(self._thread.submit(self._apply_beside, list(ops)))
        except BaseException:
            _restore_switch_interval()
            raise

    def _apply_beside(self, ops: list[PageOp]) -> bool:
        """:meth:`apply` in the executor's thread, the switch interval lowered
        by :meth:`overlap` until it ends."""
        began = time.perf_counter()
        try:
            return self.apply(ops)
        finally:
            _restore_switch_interval()
            self.stalls.ran_beside(time.perf_counter() - began)

    @property
    def overlapping(self) -> bool:
        """Whether ops started by :meth:`overlap` await :meth:`finish`."""
        return bool(self._overlapped)

    def finish(self) -> bool:
        """Wait for every batch :meth:`overlap` started (at once if none is in
        flight). ``False`` if any returned ``False`` as :meth:`apply` does; the
        first exception is raised here, once all of them have ended."""
        futures, self._overlapped = self._overlapped, []
        self.overlapped_maps = False
        ok, error = True, None
        for future in futures:
            try:
                ok = future.result() and ok
            except BaseException as exc:  # the later batches still run: wait for them too
                error = error or exc
        if error is not None:
            raise error
        return ok

    def _map(self, spans: list[tuple[int, int]]) -> bool:
        """Map ``spans`` in order (one ``map_runs``, so runs of adjacent
        extents share their set-access calls), retrying what the device
        refused; ``False`` once that has failed for :data:`MAP_RETRY_S`."""
        mapper = self.mapper
        deadline = time.monotonic() + MAP_RETRY_S
        while True:
            if mapper.quarantined_pages:
                mapper.retry_quarantined()
            done = mapper.map_runs(spans)
            self.maps += done
            spans = spans[done:]
            if not spans:
                return True
            self.failed_maps += 1
            if time.monotonic() >= deadline:
                first, count = spans[0]
                log.error(
                    "device refused %.1f MiB the ledger granted (pages [%d, %d)) for %.0f s",
                    count * self.lanes.page_bytes / MIB,
                    first,
                    first + count,
                    MAP_RETRY_S,
                )
                return False
            time.sleep(0.05)

    def map_warmup(self, pages: int) -> bool:
        """Map pages ``[1, pages)`` for a startup warm-up that writes KV into
        real blocks before any plan exists (vLLM 0.26's V2 runner). Not charged:
        like the warm-up's activations, it lives seconds, before this instance
        holds a pool, and calibration sees it; :meth:`unmap_warmup` gives it back."""
        return pages <= 1 or self.mapper.map_run(1, pages - 1)

    def unmap_warmup(self, pages: int) -> None:
        if pages > 1 and not all(self.mapper.unmap_runs([(1, pages - 1)])):
            log.warning("warm-up pages [1, %d) could not be released; kept quarantined", pages)

    def describe(self) -> dict[str, Any]:
        """What the engine core needs to plan and charge this rank."""
        info = self.driver.info()
        free, total = self.driver.mem_info()
        lanes = self.lanes
        return {
            "ok": True,
            "device_id": info.pci_bus_id,
            "backend": info.backend,
            "index": info.index,
            "free": int(free),
            "total": int(total),
            "granularity": lanes.granularity,
            "num_pages": lanes.num_pages,
            "blocks_per_page": lanes.blocks_per_page,
            "page_bytes": lanes.page_bytes,
            "lanes": len(lanes.lanes),
            "size": lanes.size,
            "handle_bytes_per_page": lanes.handle_bytes_per_page,
        }

    @property
    def mapped_pages(self) -> int:
        return self.mapper.mapped_pages

    def close(self) -> None:
        """Unmap everything and give the address space back (shutdown). Idempotent."""
        try:
            if not self.finish():
                log.warning("pages mapped while the last step ran were refused at shutdown")
        except Exception:  # shutdown goes on: everything is unmapped below
            log.exception("page ops overlapped with the last step failed")
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        if self.calibrator is not None:
            self.calibrator.stop()
            self.calibrator = None
        if self.mapper.unmap_all():
            self.tensors.close()
