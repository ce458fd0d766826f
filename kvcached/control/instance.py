"""A kvcached instance inside one engine process: its pools, its snapshot, its limit.

Every process that holds KV pools has one :class:`Instance` (see
:func:`get_instance`), named by ``KVCACHED_IPC_NAME`` or a distinct default
(:mod:`kvcached.control.naming`). The instance

* publishes a snapshot of its pools for ``kvctl`` every :data:`TICK_S`;
* watches its limit on every device it uses (the per-GPU ledger's instance
  record, written by ``kvctl limit`` or :func:`kvcached.control.set_limit`) and,
  while the instance's charge on a device is above it, asks its pools there to
  release idle memory (reserved pages, unreferenced prefix-cache blocks). In-use
  blocks are never taken; new growth past the limit is denied by the ledger
  itself. Raising the limit lets the pools grow again up to their startup size.

Pools are anything that satisfies :class:`PoolSource`: a plain
:class:`~kvcached.memory.cache.KVCache` through :class:`KVCachePool`, or an
engine integration's own planner.

Limit enforcement, step by step: the control thread sees a new revision and
calls ``apply_limit`` (a :class:`KVCachePool` caps its page pool, whose own
thread then releases idle pages down to the cap at once); from the next tick
on, while the instance's ledger charge on a device is still above the limit,
it calls ``reclaim`` on the pools there. With coalesced handles (the default
``max_handle_bytes``) memory goes back by whole extents, each only once all
its pages are idle.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvcached.control.naming import instance_name
from kvcached.control.snapshot import SnapshotPublisher
from kvcached.control.yielding import YieldPass
from kvcached.log import get_logger

if TYPE_CHECKING:
    from kvcached.config import Config

log = get_logger("kvcached.control")

#: Seconds between two passes of the control thread: publish, then enforce limits.
TICK_S = 0.2
#: Seconds between two looks at the limit revisions (a read of the mapped ledger,
#: no lock): a new limit is acted on within this, not a whole tick, so an instance
#: woken by raising its limit (``kvcached serve``'s ``kv`` sleep) grows again at once.
REVISION_POLL_S = 0.02
#: While the engine steps (its loop called :meth:`Instance.note_step` within this many
#: seconds), the step looks at the revisions itself and the control thread wakes only
#: at its tick. Each wake of a Python thread takes the GIL from the step's thread for
#: the switch: a thread waking every 20 ms cost a loop busy in Python 1.2-2.3% of its
#: speed on a 2-core VM (``benchmarks/control_gil.py``), and an eager vLLM step is Python
#: from end to end.
STEPPING_WINDOW_S = 0.5


@dataclass(frozen=True)
class PoolUsage:
    """One pool at one moment, as published for ``kvctl``."""

    name: str
    gpu: str
    backend: str
    blocks_used: int = 0
    blocks_total: int = 0
    block_bytes: int = 0
    pages_mapped: int = 0
    pages_reserved: int = 0
    bytes_mapped: int = 0
    bytes_reserved: int = 0
    prefix_cache_bytes: int = 0
    virtual_bytes: int = 0
    misses: int = 0
    #: Bytes the last missed allocation lacked, where the engine knows (0: not known).
    short_bytes: int = 0
    # Page ops a planning engine (vLLM's) sent its workers so far, and how
    # many of them ran beside a step rather than before it (0 elsewhere).
    page_maps: int = 0
    page_unmaps: int = 0
    page_ops_overlapped: int = 0
    #: Steps that waited for ops still running beside earlier steps.
    page_op_waits: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_cache(
        cls,
        name: str,
        gpu: str,
        backend: str,
        u: Any,
        *,
        prefix_cache_bytes: int = 0,
        misses: int = 0,
        short_bytes: int = 0,
    ) -> PoolUsage:
        """The reading of a pool backed by one :class:`~kvcached.memory.KVCache`,
        from its ``usage()`` ``u``."""
        return cls(
            name=name,
            gpu=gpu,
            backend=backend,
            blocks_used=u.blocks_used,
            blocks_total=u.blocks_total,
            block_bytes=u.page_bytes // max(1, u.blocks_per_page),
            pages_mapped=u.pages_mapped,
            pages_reserved=u.pages_reserved,
            bytes_mapped=u.bytes_mapped,
            bytes_reserved=u.pages_reserved * u.page_bytes,
            prefix_cache_bytes=prefix_cache_bytes,
            virtual_bytes=u.pages_total * u.page_bytes,
            misses=misses,
            short_bytes=short_bytes,
        )


@runtime_checkable
class PoolSource(Protocol):
    """What an instance needs from one KV pool."""

    def pool_usage(self) -> PoolUsage:
        """A consistent reading of the pool (cheap; called every tick)."""

    def apply_limit(self, limit_bytes: int | None) -> None:
        """The instance's limit on this pool's device changed (``None``:
        unlimited). Cap growth accordingly; grow back when it rises."""

    def reclaim(self, nbytes: int) -> int:
        """Release up to (at least, where whole pages make it so) ``nbytes`` of
        idle memory: reserved pages first, then unreferenced prefix-cache
        blocks, never blocks in use. Returns the bytes released."""

    # Optional: ``hold_reserve(seconds)``, map no reserve for that long (the
    # yield pass calls it where a neighbour is short; kvcached.control.yielding).


class LimitWatch(Protocol):
    """The pool's account on its device's ledger (:class:`kvcached.ledger.PoolBudget`).
    An optional ``ledger_path`` attribute is published, so ``kvctl`` finds the
    ledger without the instance's ``KVCACHED_LEDGER_DIR``."""

    @property
    def limit(self) -> int: ...

    @property
    def limit_revision(self) -> int: ...

    def instance_charged(self) -> int: ...

    def flush(self) -> None: ...


class KVCachePool:
    """:class:`PoolSource` for a :class:`~kvcached.memory.cache.KVCache`.

    ``evict_cached(nbytes) -> int`` is the engine's hook to drop unreferenced
    prefix-cache blocks (it frees their blocks into the cache and returns the
    bytes it expects released); ``prefix_cache_bytes()`` reports what they hold.
    :attr:`misses` is published as is: the engine adds one for every
    allocation the cache refused (``alloc`` returned ``None``).
    """

    def __init__(
        self,
        cache: Any,
        name: str = "kv",
        *,
        evict_cached: Callable[[int], int] | None = None,
        prefix_cache_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.cache = cache
        self.name = name
        self._evict_cached = evict_cached
        self._prefix_cache_bytes = prefix_cache_bytes
        info = cache.driver.info()
        self.gpu, self.backend = info.pci_bus_id, info.backend
        self.misses = 0

    def pool_usage(self) -> PoolUsage:
        return PoolUsage.of_cache(
            self.name,
            self.gpu,
            self.backend,
            self.cache.usage(),
            prefix_cache_bytes=self._prefix_cache_bytes() if self._prefix_cache_bytes else 0,
            misses=self.misses,
            short_bytes=self.cache.blocks.last_miss_pages * self.cache.geometry.page_bytes,
        )

    def apply_limit(self, limit_bytes: int | None) -> None:
        self.cache.set_limit(limit_bytes or None)

    def hold_reserve(self, seconds: float) -> None:
        self.cache.pages.hold_reserve(seconds)

    def reclaim(self, nbytes: int) -> int:
        before = self.cache.usage().bytes_mapped
        self.cache.trim()
        released = before - self.cache.usage().bytes_mapped
        if released < nbytes and self._evict_cached is not None:
            self._evict_cached(nbytes - released)
            self.cache.trim()
            released = before - self.cache.usage().bytes_mapped
        return max(0, released)


@dataclass
class _Member:
    source: PoolSource
    watch: LimitWatch | None
    revision_seen: int = -1
    fresh: bool = False  #: its limit changed this pass: let its own cap act first
    flush_error: tuple[str, str] | None = None  #: the last refund flush failure logged


class Instance:
    """This process' part of a kvcached instance. Use :func:`get_instance`."""

    def __init__(
        self,
        name: str,
        engine: str = "kvcached",
        engine_version: str = "",
        tick_s: float = TICK_S,
        start: bool = True,
        *,
        yield_idle: bool = False,
    ) -> None:
        from kvcached import __version__

        self.name = name
        self.engine = engine
        self.engine_version = engine_version
        self.started_at = time.time()
        self._kvcached_version = __version__
        self._members: list[_Member] = []
        self._lock = threading.Lock()
        self._publisher = SnapshotPublisher(name)
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # a step saw a new revision, or close()
        self._thread: threading.Thread | None = None
        self._stepped_at = -STEPPING_WINDOW_S  # monotonic time of the last step
        self._next_look = 0.0  # when a step looks at the revisions next
        #: Times the control thread woke (diagnostics: fewer while the engine steps).
        self.wakeups = 0
        self.reclaimed_bytes = 0
        #: The yield pass (``KVCACHED_YIELD_IDLE``; None: off).
        self.yielding = YieldPass(name) if yield_idle else None
        self.publish()
        if start:
            self._thread = threading.Thread(target=self._run, name="kvcached-control", daemon=True)
            self._thread.start()

    # -- pools ------------------------------------------------------------------------------
    def add_pool(self, source: PoolSource, watch: LimitWatch | None = None) -> None:
        """Track ``source``; ``watch`` is its ledger account (limits are read from it)."""
        with self._lock:
            self._members.append(_Member(source, watch))
        self.enforce()
        self.publish()

    def remove_pool(self, source: PoolSource) -> None:
        with self._lock:
            self._members = [m for m in self._members if m.source is not source]
        self.publish()

    @property
    def pools(self) -> list[PoolSource]:
        with self._lock:
            return [m.source for m in self._members]

    # -- snapshot ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            members = list(self._members)
        pools = []
        for m in members:
            entry = m.source.pool_usage().as_dict()
            if m.watch is not None:
                limit = m.watch.limit
                entry["limit_bytes"] = limit or None
                entry["limit_revision"] = m.watch.limit_revision
                ledger = getattr(m.watch, "ledger_path", None)
                if isinstance(ledger, str):
                    entry["ledger"] = ledger
            pools.append(entry)
        return {
            "instance": self.name,
            "pid": os.getpid(),
            "engine": self.engine,
            "engine_version": self.engine_version,
            "kvcached_version": self._kvcached_version,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "reclaimed_bytes": self.reclaimed_bytes,
            "yielded_bytes": self.yielding.yielded_bytes if self.yielding else 0,
            "yielded_by_gpu": dict(self.yielding.by_device) if self.yielding else {},
            "pools": pools,
        }

    def publish(self) -> None:
        self._publisher.publish(self.snapshot())

    # -- limits -----------------------------------------------------------------------------
    def enforce(self) -> int:
        """One pass: pass limit changes to the pools, and release idle memory on
        every device where the instance is over its limit. Returns bytes released."""
        with self._lock:
            members = list(self._members)
        released = 0
        by_gpu: dict[str, list[_Member]] = {}
        for m in members:
            if m.watch is None:
                continue
            revision = m.watch.limit_revision
            m.fresh = revision != m.revision_seen
            gpu = m.source.pool_usage().gpu
            if m.fresh:
                first = m.revision_seen < 0
                m.revision_seen = revision
                limit = m.watch.limit
                m.source.apply_limit(limit or None)
                if revision and not (first and not limit):
                    log.info(
                        "instance %s: limit %s (revision %d) on %s",
                        self.name,
                        limit or "none",
                        revision,
                        gpu,
                    )
            by_gpu.setdefault(gpu, []).append(m)
        for group in by_gpu.values():
            watch = group[0].watch
            assert watch is not None
            limit = watch.limit
            if not limit or any(m.fresh for m in group):
                # Unlimited, or just lowered: a pool's own cap releases idle pages
                # down to the limit (exactly, page by page); reclaim only what that
                # leaves above it, from the next tick on.
                continue
            for m in group:  # batched refunds first: they are memory already released
                self._flush(m)
            over = watch.instance_charged() - limit
            for m in group:
                if over <= 0:
                    break
                got = m.source.reclaim(over)
                self._flush(m)
                over -= got
                released += got
        self.reclaimed_bytes += released
        return released

    def yield_idle(self) -> int:
        """The yield pass where it is on (:mod:`kvcached.control.yielding`): post
        calls for this instance's misses, release idle memory to neighbours'.
        Returns the bytes released."""
        if self.yielding is None:
            return 0
        with self._lock:
            members = [m for m in self._members if m.watch is not None]
        groups: dict[str, list[tuple[Any, Any, Any]]] = {}
        for m in members:
            usage = m.source.pool_usage()
            groups.setdefault(usage.gpu, []).append((m.source, m.watch, usage))
        by_source = {id(m.source): m for m in members}
        return self.yielding.run(groups, lambda source: self._flush(by_source[id(source)]))

    def _flush(self, member: _Member) -> None:
        """Write a pool's batched refunds. A failed flush keeps its batch (the ledger
        retries it with the next one), so reclaim goes on; the failure is logged once
        per pool and error until a flush succeeds again."""
        try:
            member.watch.flush()  # type: ignore[union-attr]
        except Exception as e:
            seen = (type(e).__name__, str(e))
            if member.flush_error != seen:
                member.flush_error = seen
                log.warning(
                    "instance %s: refund flush of pool %s failed (kept for the next one): %s",
                    self.name,
                    member.source.pool_usage().name,
                    e,
                    exc_info=True,
                )
        else:
            member.flush_error = None

    def _limit_changed(self) -> bool:
        with self._lock:
            members = list(self._members)
        return any(
            m.watch is not None and m.watch.limit_revision != m.revision_seen for m in members
        )

    def note_step(self) -> None:
        """Called by the engine's loop on its own thread, every step: while it
        steps, the step looks at the limit revisions every :data:`REVISION_POLL_S`
        (wakes the control thread on a change) and the control thread sleeps
        until its tick (:data:`STEPPING_WINDOW_S`). Cheap: a clock read when
        there is nothing to look at."""
        now = time.monotonic()
        self._stepped_at = now
        if now >= self._next_look:
            self._next_look = now + REVISION_POLL_S
            if self._limit_changed():
                self._wake.set()

    def _run(self) -> None:
        tick = self._tick_s
        due = time.monotonic() + tick
        while not self._stop.is_set():
            now = time.monotonic()
            wait = due - now
            if now - self._stepped_at >= STEPPING_WINDOW_S:
                wait = min(wait, REVISION_POLL_S)
            woken = self._wake.wait(max(wait, 0.0))
            self._wake.clear()
            if self._stop.is_set():
                break
            self.wakeups += 1
            try:
                now = time.monotonic()
                if now < due and not woken and not self._limit_changed():
                    continue
                due = now + tick
                self.enforce()
                self.yield_idle()
                self.publish()
            except Exception:  # the control thread must outlive one bad pass
                log.exception("instance %s: control pass failed", self.name)

    def close(self) -> None:
        """Stop the control thread and remove the snapshot. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._publisher.close()


_instance: Instance | None = None
_instance_lock = threading.Lock()


def get_instance(
    engine: str, engine_version: str, *, ipc_name: str | None, yield_idle: bool = False
) -> Instance:
    """This process' instance, created on first use and named by
    :func:`kvcached.control.naming.instance_name` from ``ipc_name`` (the caller's
    ``config.ipc_name``: ``KVCACHED_IPC_NAME``, or None for the default name);
    ``yield_idle`` (``config.yield_idle``) is the creator's."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = Instance(
                instance_name(engine, ipc_name), engine, engine_version, yield_idle=yield_idle
            )
        return _instance


def note_step() -> None:
    """:meth:`Instance.note_step` of this process' instance, if it has one (for an
    engine loop that does not hold its instance)."""
    instance = _instance
    if instance is not None:
        instance.note_step()


def current_instance() -> Instance:
    """This process' instance; ``LookupError`` when none was created yet (by
    :func:`get_instance` or :func:`open_kv_cache`)."""
    with _instance_lock:
        if _instance is None:
            raise LookupError(
                "this process has no kvcached instance yet: open_kv_cache() or "
                "get_instance() creates it"
            )
        return _instance


def _forget_after_fork() -> None:
    global _instance, _instance_lock
    _instance = None
    _instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def open_kv_cache(
    spec: Any,
    *,
    engine: str = "kvcached",
    engine_version: str = "",
    name: str = "kv",
    evict_cached: Callable[[int], int] | None = None,
    prefix_cache_bytes: Callable[[], int] | None = None,
    config: Config,
    **kwargs: Any,
) -> Any:
    """A :class:`~kvcached.memory.cache.KVCache` charged to this device's ledger
    under this process' instance, and registered with the instance (snapshot,
    limits). ``kwargs`` go to ``KVCache`` (``driver``, ``num_blocks``, ...).
    Close the cache, then :func:`close_kv_cache`, when the engine stops.

    ``config``: the settings the caller read (:func:`kvcached.config.get_config`,
    the ``KVCACHED_*`` variables, at its entry point); the instance's name, the
    driver, the ledger and the cache are given them."""
    from kvcached.driver import default_driver
    from kvcached.ledger import open_pool_budget
    from kvcached.memory.cache import KVCache

    instance = get_instance(
        engine, engine_version, ipc_name=config.ipc_name, yield_idle=config.yield_idle
    )
    driver = kwargs.pop("driver", None) or default_driver(config=config)
    budget = open_pool_budget(driver, instance.name, config=config)
    try:
        cache = KVCache(spec, driver=driver, budget=budget, config=config, **kwargs)
    except BaseException:
        budget.close()
        raise
    source = KVCachePool(
        cache, name, evict_cached=evict_cached, prefix_cache_bytes=prefix_cache_bytes
    )
    cache.control_source = source
    instance.add_pool(source, budget)
    return cache


def close_kv_cache(cache: Any) -> None:
    """Undo :func:`open_kv_cache`: leave the instance, unmap, close the budget."""
    source = getattr(cache, "control_source", None)
    if source is not None and _instance is not None:
        _instance.remove_pool(source)
    cache.close()
    cache.budget.close()
