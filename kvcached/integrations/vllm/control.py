"""The engine core's kvcached instance: ledger pools, limits, reclaim, snapshots.

The engine core is the process that holds vLLM's block pool, so it is the one
that registers a pool on every rank's device ledger (under the instance name
the API server resolved, :mod:`kvcached.control.naming`) and joins the
control layer (:func:`kvcached.control.instance.get_instance`): one
:class:`VllmPoolSource` per device, with that device's ledger pools as its
limit watch.

The control layer's thread never touches vLLM's state. ``apply_limit`` and
``reclaim`` post a request and wake the engine core with vLLM's own
``WAKEUP`` message; :meth:`EngineContext.serve_control` then runs on the
engine core's thread (between steps, or at once when it is idle), evicts and
trims, and flushes the resulting unmaps to the workers.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from kvcached.control.instance import PoolUsage
from kvcached.integrations.vllm.planner import StepPlanner
from kvcached.integrations.vllm.stalls import ScheduleCost
from kvcached.log import get_logger

log = get_logger("integrations.vllm")

#: How long the control thread waits for the engine core to carry out a reclaim.
RECLAIM_WAIT_S = 1.0


class DeviceWatch:
    """The control layer's ``LimitWatch`` of one device: its ledger pools (one
    per rank on that device; they share the instance's limit record)."""

    def __init__(self, pools: Sequence[Any]) -> None:
        self.pools = list(pools)

    @property
    def limit(self) -> int:
        return self.pools[0].limit

    @property
    def limit_revision(self) -> int:
        return self.pools[0].limit_revision

    def instance_charged(self) -> int:
        return self.pools[0].instance_charged()

    @property
    def ledger_path(self) -> str:
        """Published in the snapshot, so ``kvctl`` finds this device's ledger."""
        return self.pools[0].ledger_path

    def flush(self) -> None:
        for pool in self.pools:
            pool.flush()

    # The ranks on one device share its ledger: a call goes in the first one's record.
    def post_want(self, nbytes: int) -> bool:
        return self.pools[0].post_want(nbytes)

    def neighbour_wants(self) -> list[Any]:
        return self.pools[0].neighbour_wants()

    def device_room(self) -> int:
        return self.pools[0].device_room()


class EngineContext:
    """Everything kvcached keeps in one vLLM engine core. Built by the engine
    patch once the workers described their KV buffers."""

    def __init__(
        self,
        planner: StepPlanner,
        *,
        instance: Any,
        devices: Sequence[str],
        backend: str,
        pools: Sequence[Any],
        ledgers: Sequence[Any],
    ) -> None:
        self.planner = planner
        self.instance = instance
        self.devices = list(devices)  # per rank
        self.backend = backend
        self.pools = list(pools)  # per rank
        self.ledgers = list(ledgers)
        self.pool: Any = None  # the KvcachedBlockPool, once vLLM built it
        self.sources: list[VllmPoolSource] = []
        self._engine: Any = None
        self._limits: dict[str, int | None] = {}
        self._reclaim_done = threading.Event()
        self.reclaimed = 0
        self.closed = False
        self.step_cost = ScheduleCost()  #: schedule() a step, and kvcached's hooks in it
        #: Whether the null block's page may be released while held at zero (not
        #: under data parallelism: idle ranks' dummy batches may read it).
        self.park_null_ok = True

    # -- wiring ------------------------------------------------------------------------------
    def bind_engine(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def attach_pool(self, pool: Any) -> None:
        """vLLM built the block pool: join the control layer, one source per device."""
        self.pool = pool
        by_device: dict[str, list[int]] = {}
        for rank, device in enumerate(self.devices):
            by_device.setdefault(device, []).append(rank)
        for device, ranks in by_device.items():
            source = VllmPoolSource(self, device, len(ranks))
            self.sources.append(source)
            self.instance.add_pool(source, DeviceWatch([self.pools[r] for r in ranks]))

    def wake(self) -> None:
        """Wake an idle engine core so it serves a posted request."""
        engine = self._engine() if self._engine is not None else None
        queue = getattr(engine, "input_queue", None)
        if queue is None:
            return
        from vllm.v1.engine import EngineCoreRequestType

        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def idle(self) -> bool:
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            return False
        has_work = getattr(engine, "has_work", None)
        if has_work is not None:
            return not has_work()
        return not engine.scheduler.has_requests()

    # -- on the engine core's thread --------------------------------------------------------------
    def serve_control(self) -> None:
        """Carry out posted limit changes and reclaims (engine core thread)."""
        planner = self.planner
        control = planner.take_control()
        if not control:
            if planner.null_parked and self._null_allowed():
                planner.unpark_null()  # a wake whose page 0 was refused: retry each step
            return
        start = planner.mapped_bytes()
        if "limit" in control:
            self._limits.update(control["limit"])  # type: ignore[arg-type]
            planner.blocks.set_limit(self._cap_bytes())  # releases idle pages over the cap
        if "reclaim" in control and self.pool is not None:
            # The amount was computed before a limit posted with it took effect:
            # count what the cap released already.
            wanted = int(control["reclaim"]) - (start - planner.mapped_bytes())  # type: ignore[call-overload]
            if wanted > 0:
                self.pool.reclaim(wanted)
        self._park_or_unpark_null()
        self.reclaimed = max(0, start - planner.mapped_bytes())
        if self.idle():
            planner.flush()
        self._reclaim_done.set()

    def _null_allowed(self) -> bool:
        cap = self._cap_bytes()
        return cap is None or cap >= self.planner.page_bytes

    def _park_or_unpark_null(self) -> None:
        """Held below one page (a limit of 0-ish: ``kvcached serve``'s ``kv``
        sleep) with nothing in use and no request: give back the null block's
        page too, so the instance holds nothing; map it again once the limit
        allows a page. A step never runs while it is parked: no block can be
        allocated, and the engine is idle."""
        planner = self.planner
        if planner.null_parked:
            if self._null_allowed():
                planner.unpark_null()
        elif (
            self.park_null_ok
            and not self._null_allowed()
            and self.idle()
            and planner.live_blocks() == 0
            and planner.park_null()
        ):
            log.info(
                "instance %s: held at zero; the null block's page is released "
                "until the limit allows a page again",
                self.instance.name,
            )

    def _cap_bytes(self) -> int | None:
        """The smallest limit over devices, in bytes per rank (``None``: none)."""
        caps = []
        for device, limit in self._limits.items():
            if limit:
                ranks = self.devices.count(device)
                caps.append(limit // ranks)
        return min(caps) if caps else None

    def flush_if_idle(self) -> None:
        if self.planner.pending and self.idle():
            self.planner.flush()

    # -- from the control thread ------------------------------------------------------------------
    def post_limit(self, device: str, limit: int | None) -> None:
        self.planner.post_control("limit", (device, limit))
        self.wake()

    def request_reclaim(self, nbytes_per_rank: int) -> int:
        self._reclaim_done.clear()
        self.planner.post_control("reclaim", nbytes_per_rank)
        self.wake()
        if self._reclaim_done.wait(RECLAIM_WAIT_S):
            return self.reclaimed
        return 0

    def close(self, workers_gone: bool = False) -> None:
        """Leave the control layer and give the ledger pools back. Idempotent.

        ``workers_gone``: vLLM shut its workers down, so every page they held
        is released: refund it before the pools close. (Otherwise closing
        retires the charge with the budget alike, and a later calibration
        finds the memory free.)"""
        if self.closed:
            return
        self.closed = True
        for source in self.sources:
            self.instance.remove_pool(source)
        if not self.instance.pools:  # the engine core's instance holds only these
            self.instance.close()
        self.planner.close()
        for pool in self.pools:
            if workers_gone:
                held = pool.charged - pool.pending_refund
                if held > 0:
                    pool.refund(held)
            pool.close()


class VllmPoolSource:
    """The control layer's view of one device of a vLLM engine (a ``PoolSource``)."""

    def __init__(self, context: EngineContext, device: str, ranks: int) -> None:
        self.context = context
        self.device = device
        self.ranks = ranks  # ranks of this engine on this device: each holds every page

    def pool_usage(self) -> PoolUsage:
        ctx = self.context
        planner = ctx.planner
        pool = ctx.pool
        pa = planner.pages
        r = self.ranks
        page = planner.page_bytes
        block = page // planner.blocks_per_page
        cached = pool.num_idle_cached if pool is not None else 0
        return PoolUsage(
            name="vllm-kv",
            gpu=self.device,
            backend=ctx.backend,
            blocks_used=max(0, planner.live_blocks() - cached),
            blocks_total=planner.num_blocks - 1,
            block_bytes=block * r,
            pages_mapped=planner.backend.mapped_pages,
            pages_reserved=pa.n_idle,
            bytes_mapped=planner.backend.mapped_pages * page * r,
            bytes_reserved=pa.n_idle * page * r,
            prefix_cache_bytes=cached * block * r,
            virtual_bytes=planner.geometry.num_pages * page * r,
            misses=planner.misses,
            short_bytes=-(-planner.short_blocks // planner.blocks_per_page) * page * r,
            page_maps=planner.backend.maps,
            page_unmaps=planner.backend.unmaps,
            page_ops_overlapped=planner.overlapped_ops,
            page_op_waits=planner.beside_waits,
        )

    def apply_limit(self, limit_bytes: int | None) -> None:
        self.context.post_limit(self.device, limit_bytes)

    def hold_reserve(self, seconds: float) -> None:
        self.context.planner.pages.hold_reserve(seconds)  # a plain store: safe from here

    def reclaim(self, nbytes: int) -> int:
        per_rank = -(-nbytes // self.ranks)
        return self.context.request_reclaim(per_rank) * self.ranks
