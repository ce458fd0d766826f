"""The engine core's side of kvcached in vLLM: blocks, pages, and page ops per step.

:class:`StepPlanner` holds the memory layer's page policy and block manager
over a :class:`~kvcached.memory.planned.PlannedPages` backend, so every page
decision becomes an op that rides to the workers on vLLM's own step queue:

* **Grant before the check.** :meth:`reserve` maps (plans and grants) idle
  pages until the blocks ready without growth cover what vLLM is about to
  ask for; vLLM's capacity check then runs against an exact figure, and
  ``get_new_blocks`` never needs to grow (so it cannot fail). A denial only
  stops the growth: the check fails and vLLM's scheduler waits or preempts.
* **Map before use.** The ops planned while ``schedule()`` runs are attached
  to that step's ``SchedulerOutput`` (:meth:`ops_for_step`); every worker
  applies them before the step's first kernel.
* **Refund after confirmation.** The bytes of a step's unmaps are refunded
  when that step's output is processed (:meth:`step_done`): with one rank its
  reply is the confirmation; with several, a step that ran a forward pass is
  (its collectives need every rank past its ops), and the refunds of other
  steps wait for the next such step or an idle flush. Confirmed refunds are
  flushed to the ledger at once, so other instances on the device can use the
  memory while this engine stays busy.
* **Idle flush.** When no step will come, :meth:`flush` sends the queued ops
  through ``collective_rpc``, which returns once every rank applied them.
* **Overlap** (``overlap=True``, always in vLLM since #34; ``False`` keeps every
  op before its step, for tests of that order). A step's ops
  end with what the step itself does not touch: the reserve's refill (pages
  still idle when ``schedule()`` ends) and the unmaps of released pages.
  :meth:`ops_for_step` says how many ops lead up to the last map the step
  needs; a worker applies those before the step's first kernel and the rest
  in a thread of its own beside the step, in queue order.
* **Waiting only for what a step uses.** Ops beside a step may still run
  while later steps do. The planner tells each step whether a worker must
  first finish every op sent beside earlier steps (:attr:`step_waits`,
  ``kvcached_wait``): when the step has ops of its own to apply before it,
  when the block manager took a page an op in flight maps, or when
  ``beside_steps`` (``KVCACHED_BESIDE_STEPS``, default :data:`BESIDE_STEPS_MAX`;
  1 makes the next step always wait) steps have passed since the last such wait. Every
  rank gets the same answer, so they agree on the same steps. The unmaps among
  the ops beside a step are confirmed by the output of the first later step
  that waited (or an idle flush), not the step's own.

Unmaps need no step fence here: a worker applies ops in queue order and
synchronizes its device before any unmap, so every earlier step that could
read the page has finished by then.

Not thread-safe: only the engine core's thread calls it. Other threads (the
control layer's) post requests with :meth:`post_control` and wake the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from kvcached.log import get_logger
from kvcached.memory.blocks import BlockManager
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.mapper import DEFAULT_MAX_HANDLE_BYTES
from kvcached.memory.pages import IDLE, UNMAPPED, PageAllocator
from kvcached.memory.planned import MAP, UNMAP, PageOp, PlannedPages
from kvcached.memory.spec import KVLayout, PageGeometry

log = get_logger("integrations.vllm")

#: At most one line about allocation misses per this many seconds.
MISS_LOG_S = 30.0

#: Steps that may start with ops sent beside earlier steps still in flight
#: before one waits for them: bounds how late their unmaps are confirmed (and
#: refunded to the ledger) while the engine stays busy. The default of
#: ``KVCACHED_BESIDE_STEPS``.
BESIDE_STEPS_MAX = 4


def planner_geometry(
    num_pages: int, blocks_per_page: int, page_bytes: int, granularity: int
) -> PageGeometry:
    """A :class:`PageGeometry` with the planner's numbers: ``num_pages`` pages
    of ``blocks_per_page`` blocks and ``page_bytes`` bytes per rank."""
    if page_bytes % blocks_per_page:
        raise ValueError(
            f"page_bytes={page_bytes} is not a whole number of {blocks_per_page} blocks"
        )
    return PageGeometry(
        layout=KVLayout.CONTIGUOUS,
        num_layers=1,
        buffer_block_bytes=(page_bytes // blocks_per_page,),
        blocks_per_page=blocks_per_page,
        num_pages=num_pages,
        granularity=granularity,
    )


class StepPlanner:
    """See the module docstring.

    ``budget`` charges every rank (a :class:`~kvcached.memory.CompositeBudget`
    of the ranks' ledger pools); ``world_size`` is the number of ranks that
    apply each op; ``rpc(ops)`` sends ops to every rank and returns once all
    applied them (set by the engine core once its executor exists).
    """

    def __init__(
        self,
        geometry: PageGeometry,
        budget: PhysicalBudget,
        *,
        world_size: int = 1,
        min_reserved: int = 0,
        max_reserved: int = 0,
        max_run_bytes: int = DEFAULT_MAX_HANDLE_BYTES,
        rpc: Callable[[list[PageOp]], object] | None = None,
        overlap: bool = True,
        beside_steps: int = BESIDE_STEPS_MAX,
    ) -> None:
        self.geometry = geometry
        self.budget = budget
        self.world_size = world_size
        self.blocks_per_page = geometry.blocks_per_page
        self.num_blocks = geometry.num_blocks
        self.page_bytes = geometry.page_bytes
        self.rpc = rpc
        self.overlap = overlap
        self.beside_steps = beside_steps  #: KVCACHED_BESIDE_STEPS (module docstring)
        self.backend = PlannedPages(
            geometry, budget, max_run_pages=max(1, max_run_bytes // geometry.page_bytes)
        )
        self.pages = PageAllocator(
            self.backend,
            min_reserved=min_reserved,
            max_reserved=max(min_reserved, max_reserved),
            background=False,
        )
        self.blocks = BlockManager(self.pages, reserve_null_block=True, thread_safe=False)
        self.alloc = self.blocks.alloc
        self.free = self.blocks.free
        self.ready_blocks = self.blocks.ready_size
        self.steps = 0
        self.overlapped_ops = 0  # ops sent to run beside their step
        self.beside_waits = 0  # steps that had to wait for ops beside earlier steps
        self.step_waits = True  #: whether the last planned step waits (module docstring)
        # Ops sent beside steps that no step has waited for since: the pages
        # they map, the bytes they unmap, and how many steps sent them.
        self._beside_maps: set[int] = set()
        self._beside_unmapped = 0
        self._beside_since = 0  # the first step that sent them (0: none)
        self.misses = 0
        self.short_blocks = 0  #: blocks the last miss lacked (0: not known)
        self._miss_logged = -MISS_LOG_S
        # (step whose output confirms it, bytes to refund), in step order
        self._inflight: deque[tuple[int, int]] = deque()
        self._control_lock = threading.Lock()
        self._control: dict[str, object] = {}
        self.closed = False

    # -- capacity ------------------------------------------------------------------------
    def reserve(self, target: int) -> bool:
        """Make ``target`` blocks ready without growth, mapping (planning and
        granting) idle pages as needed. ``False`` when the budget, the cap or
        the virtual size stopped the growth short; the caller decides whether
        that is a miss (see :meth:`note_miss`)."""
        short = target - self.blocks.ready_size()
        if short <= 0:
            return True
        want = -(-short // self.blocks_per_page)
        return self.pages.map_idle(want) >= want

    def note_miss(self, short_blocks: int = 0) -> None:
        """vLLM's capacity check is about to fail for want of memory
        (``short_blocks`` short of it): count it, and say so at most once per
        :data:`MISS_LOG_S`."""
        self.misses += 1
        self.short_blocks = short_blocks
        now = time.monotonic()
        if now - self._miss_logged >= MISS_LOG_S:
            self._miss_logged = now
            log.info(
                "KV memory is full (budget, limit or virtual size): %d allocation misses "
                "so far; vLLM's scheduler makes requests wait or preempts",
                self.misses,
            )

    def live_blocks(self) -> int:
        """Blocks handed out and not freed (the null block excluded)."""
        pa = self.pages
        null = 0 if self.blocks.null_parked else 1
        return (pa.n_used + pa.n_idle) * self.blocks_per_page - self.blocks.ready_size() - null

    # -- the null block, parked while held at zero --------------------------------------
    @property
    def null_parked(self) -> bool:
        return self.blocks.null_parked

    def park_null(self) -> bool:
        """Unmap page 0 (the null block's) while no other block lives: an idle
        engine held at zero (``kvcached serve``'s ``kv`` sleep) then holds
        nothing. Only when no step will run before :meth:`unpark_null`."""
        self.backend.release_page0 = True
        if not self.blocks.park_null_block():
            self.backend.release_page0 = False
            return False
        self.pages.trim()
        return True

    def unpark_null(self) -> bool:
        """Map page 0 again (its map rides on the next step, or an idle flush)."""
        if not self.blocks.unpark_null_block():
            return False
        self.backend.release_page0 = False
        return True

    def growable_blocks(self) -> int:
        """Blocks that could still be mapped now (cap, virtual size, budget)."""
        return self.pages.growable() * self.blocks_per_page

    def mapped_bytes(self) -> int:
        """Bytes per rank of every planned mapping (sent or queued)."""
        return self.backend.mapped_pages * self.page_bytes

    # -- steps -----------------------------------------------------------------------------
    def ops_for_step(self) -> tuple[list[PageOp] | None, int, int]:
        """End of ``schedule()``: release idle pages beyond the reserve (a
        queued map of a page nobody used is simply cancelled), then take the
        queued ops for this step. Returns ``(ops or None, step number,
        sync)``: the first ``sync`` ops must be applied before the step's first
        kernel, the rest may overlap the step (all of them without
        ``overlap``; see the module docstring)."""
        self.pages.maintain()
        ops, refund = self.backend.take_ops()
        self.steps += 1
        sync = 0 if not ops else self._sync_prefix(ops) if self.overlap else len(ops)
        self._plan_wait(sync)
        if not ops:
            return None, self.steps, 0
        overlapped = sum(c for kind, _, c in ops[sync:] if kind == UNMAP) * self.page_bytes
        if sync < len(ops):
            if not self.overlapped_ops:
                log.info(
                    "step %d: %d of its %d page ops run beside it (the first step to)",
                    self.steps,
                    len(ops) - sync,
                    len(ops),
                )
            self.overlapped_ops += len(ops) - sync
            self._beside_since = self._beside_since or self.steps
            self._beside_unmapped += overlapped
            for kind, first, count in ops[sync:]:
                if kind == MAP:
                    self._beside_maps.update(range(first, first + count))
        self._inflight.append((self.steps, refund - overlapped))
        return ops, self.steps, sync

    def _plan_wait(self, sync: int) -> None:
        """Decide :attr:`step_waits` for the step being planned (module
        docstring); a step that waits confirms the unmaps sent beside earlier
        steps, by its own output."""
        if not self._beside_since:
            self.step_waits = sync > 0
            return
        state = self.pages.state_of
        wait = (
            sync > 0
            or self.steps - self._beside_since >= self.beside_steps
            or any(state(p) not in (IDLE, UNMAPPED) for p in self._beside_maps)
        )
        self.step_waits = wait
        if wait:
            self.beside_waits += 1
            self._inflight.append((self.steps, self._beside_unmapped))
            self._forget_beside()

    def _forget_beside(self) -> None:
        self._beside_maps.clear()
        self._beside_unmapped = 0
        self._beside_since = 0

    def _sync_prefix(self, ops: list[PageOp]) -> int:
        """How many of ``ops`` lead up to the last map of a page the step can
        use: one the block manager took (an idle page holds no block)."""
        state = self.pages.state_of
        for i in range(len(ops) - 1, -1, -1):
            kind, first, count = ops[i]
            if kind == MAP and any(state(p) != IDLE for p in range(first, first + count)):
                return i + 1
        return 0

    def step_done(self, step: int, forward: bool) -> None:
        """The output of step ``step`` was processed: refund what every rank
        has now confirmed (see the module docstring)."""
        if not (forward or self.world_size == 1):
            return
        inflight = self._inflight
        refunded = 0
        while inflight and inflight[0][0] <= step:
            nbytes = inflight.popleft()[1]
            self.backend.confirm(nbytes)
            refunded += nbytes
        if refunded:
            # The ledger batches refunds below 64 MiB per pool, and batched bytes
            # are this pool's alone: under steady load the engine never idles to
            # flush, and a budget of a few pages stops being shared. A step
            # refunds at most a few pages, so one flush per such step is cheap.
            self.budget.flush()

    @property
    def pending(self) -> bool:
        """Whether ops wait to be carried to the workers, or refunds for a
        confirmation (an idle flush gives both)."""
        return self.backend.pending or bool(self._inflight) or self._beside_since > 0

    def flush(self) -> bool:
        """Send queued ops to every rank now and wait (idle engine). Returns
        whether anything was sent. Everything carried earlier is confirmed too:
        the RPC is queued behind it, and a worker finishes every op still
        running beside a step before it applies an RPC's."""
        if not self.pending or self.rpc is None or self.closed:
            return False
        ops, refund = self.backend.take_ops()
        self.rpc(ops)
        while self._inflight:
            self.backend.confirm(self._inflight.popleft()[1])
        self.backend.confirm(refund + self._beside_unmapped)
        self._forget_beside()
        self.budget.flush()
        return True

    # -- requests from other threads ---------------------------------------------------------
    def post_control(self, kind: str, value: object) -> None:
        """Post a request for the engine thread's next :meth:`take_control`:
        ``("limit", (device, bytes or None))`` or ``("reclaim", bytes)``
        (requests of a kind merge: limits per device, the largest reclaim)."""
        with self._control_lock:
            if kind == "reclaim":
                value = max(int(value), int(self._control.get("reclaim", 0)))  # type: ignore[arg-type]
            elif kind == "limit":
                device, limit = value  # type: ignore[misc]
                limits = dict(self._control.get("limit", {}))  # type: ignore[call-overload]
                limits[device] = limit
                value = limits
            self._control[kind] = value

    def take_control(self) -> dict[str, object]:
        if not self._control:  # unlocked peek: the common case costs nothing
            return {}
        with self._control_lock:
            control, self._control = self._control, {}
        return control

    def close(self) -> None:
        """Stop handing out blocks (engine shutdown). Idempotent."""
        if not self.closed:
            self.closed = True
            self.blocks.close()
