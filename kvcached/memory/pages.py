"""Which pages are mapped, which hold blocks, and how many more may be.

:class:`PageAllocator` is the page-level policy over a
:class:`~kvcached.memory.mapper.PageMapper`: it hands pages to the block manager
(``take``), takes them back (``give_back``), keeps a small pool of pre-mapped
idle pages ready, and enforces a cap on mapped pages (the instance limit).

Invariants (checked by ``tests/memory``):

* every page is in exactly one state: *unmapped*, *idle* (mapped, no blocks),
  *used* (mapped, held by the block manager), *busy* (being mapped or unmapped
  by one thread) or *quarantined* (an unmap or release failed; still charged);
* the mapper's quarantine is the only list of what stays charged: a page here
  is quarantined only while the mapper holds an extent on it, and a failed
  span, a trim and ``close`` ask the mapper (``extent_of``) rather than keep
  a list of their own that a retry elsewhere could leave stale;
* the counters ``n_idle``, ``n_used``, ``n_busy``, ``n_quarantined`` and
  ``n_unmapped`` equal a recount of the states, and sum to ``num_pages``;
* pages are mapped in *runs* (extents, see the mapper); a run is released only
  when every page in it is idle, so a used page is never unmapped;
* growth stays within ``min(n_unmapped, cap - mapped)`` and what the budget
  grants (a take asks it once, through the mapper's grant; a denial undoes the
  pick and misses); lowering the cap never takes a used page, it only stops
  growth and releases idle runs (now, and as more become idle);
* driver calls never run under the lock, and the lock is never held while
  taking another (the block manager's lock is always taken first); growth
  (a take that maps, a refill, ``map_idle``) runs under a second lock, the
  grow lock of a :class:`GrowGate` that every allocator over one driver
  shares, taken before the first, so one thread calls the driver to grow at
  a time.

Idle pages are reused from runs that still hold a used page first, then from
wholly idle runs, lowest id first; growth picks the lowest unmapped ids, or,
for a take of several pages that mapped pages would split, the lowest hole
that holds them all, so they are mapped and released as one run. The working
set stays packed in few runs, and whole runs go idle, where they can be
released: coalescing costs reclaim granularity only while a run is shared.

Growth is on the engine's hot path (a take of one new page per decode step
that fills a page), so it is written for few Python operations: one lock to
pick, one ``map_run`` (or one ``map_runs`` for several spans), one lock to
publish. About 2 us of Python per page on a 2-core VM, against 40-50 us of
driver calls per 2 MiB page on an H200 (``benchmarks/grow_overhead.py``).
"""

from __future__ import annotations

import heapq
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvcached.errors import ConfigError
from kvcached.log import get_logger
from kvcached.memory.mapper import PageBackend

log = get_logger("kvcached.memory")

UNMAPPED, IDLE, USED, BUSY, QUARANTINED = range(5)
_UNMAPPED_BYTE = bytes([UNMAPPED])
_QUARANTINED_BYTE = bytes([QUARANTINED])
_BYTE = tuple(bytes([s]) for s in range(5))  # state -> one byte, for slice stores

#: A take of up to this many pages looks for a hole that holds them all when
#: the lowest unmapped pages are split (a C-level search of the page states).
CONTIGUOUS_PICK_MAX = 256
#: Handles the pool's refill grows per hold of the grow lock: enough for one
#: run of adjacent one-handle pages to share its set-access call (16 pages,
#: about 0.6 ms on an H200), while a waiting take still waits for little.
REFILL_STEP_HANDLES = 16

# How often the background thread looks at the pool even when nobody woke it
# (a lowered limit is honoured within this, should a wake-up be missed).
MAINTENANCE_INTERVAL_S = 0.5


class GrowGate:
    """Who may call the driver to grow: one thread at a time per device.

    Two threads creating and mapping at once are slower than the same calls
    in turn (the CUDA driver serializes them and each handoff wakes a
    thread: ``benchmarks/driver_threads.py``), also when they grow different
    caches, so every :class:`PageAllocator` over one driver shares one gate
    (:func:`gate_for`). ``take_waiting`` tells a pool refill that a take wants
    the lock: a lock is not fair, and the refill would otherwise win it back
    page after page."""

    __slots__ = ("lock", "take_waiting", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.take_waiting = False


_gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def gate_for(driver: object | None) -> GrowGate:
    """The grow gate of ``driver`` (a new one for ``None``, or for an object
    that cannot be weakly referenced: a backend with no driver of its own)."""
    if driver is None:
        return GrowGate()
    with _gates_lock:
        try:
            gate = _gates.get(driver)
            if gate is None:
                gate = _gates[driver] = GrowGate()
        except TypeError:
            return GrowGate()
        return gate


class _Run:
    """A mapped extent as the allocator sees it: its pages and how many are used."""

    __slots__ = ("first", "count", "used")

    def __init__(self, first: int, count: int, used: int) -> None:
        self.first = first
        self.count = count
        self.used = used


class PageAllocator:
    """Page policy for one KV cache group; see the module docstring.

    ``mapper`` is a :class:`~kvcached.memory.mapper.PageMapper` (or any
    :class:`~kvcached.memory.mapper.PageBackend`, e.g. a tensor-parallel proxy).

    ``min_reserved`` / ``max_reserved``: idle mapped pages kept ready
    (``KVCACHED_MIN_RESERVED_PAGES`` / ``KVCACHED_MAX_RESERVED_PAGES``).
    ``background=True`` refills and trims the pool on a daemon thread, off the
    engine's hot path; ``False`` does the same work inline at the end of
    ``take`` / ``give_back`` (deterministic, for tests and single-threaded use).
    """

    def __init__(
        self,
        mapper: PageBackend,
        *,
        min_reserved: int = 0,
        max_reserved: int = 0,
        background: bool = True,
    ) -> None:
        if not 0 <= min_reserved <= max_reserved:
            raise ConfigError(
                "min_reserved/max_reserved",
                (min_reserved, max_reserved),
                "0 <= min_reserved <= max_reserved (KVCACHED_MIN/MAX_RESERVED_PAGES)",
            )
        self.mapper = mapper
        self.budget = mapper.budget
        self.page_bytes = mapper.page_bytes
        self.num_pages = n = mapper.geometry.num_pages
        self.min_reserved = min_reserved
        self.max_reserved = max_reserved
        self._lock = threading.Lock()
        # Held around driver growth, taken before _lock; shared by every
        # allocator over this mapper's driver.
        self._gate = gate_for(getattr(mapper, "driver", None))
        self._grow_lock = self._gate.lock
        self._state = bytearray(n)  # all UNMAPPED
        self._run: list[_Run | None] = [None] * n
        self._idle_runs: dict[int, _Run] = {}  # live runs with no used page
        # Idle pages, lowest id first, in two heaps (plus stale entries, skipped
        # on pop): those of runs that still hold a used page ("pinned", reused
        # first) and those of wholly idle runs ("loose", reused last, so whole
        # runs stay idle and can be released).
        self._pinned: list[int] = []
        self._loose: list[int] = []
        self._unmapped_lo = 0  # no unmapped page below this index
        self.n_idle = 0
        self.n_used = 0
        self.n_busy = 0
        self.n_quarantined = 0
        self.n_unmapped = n
        self.cap_pages = n
        self._closed = False
        self._refill_wanted = False
        self._reserve_held_until = 0.0  # time.monotonic(): no refill before it
        self._wake = threading.Event()
        # Held by the pool thread around each round of maintain(), and by paused().
        self._round = threading.Lock()
        self._thread: threading.Thread | None = None
        # Growth maps every span of a take behind one call when the mapper can
        # (PageMapper.map_runs); any other PageBackend gets map_run per span.
        self._batch = callable(getattr(mapper, "map_runs", None)) and callable(
            getattr(mapper, "is_mapped", None)
        )
        self._map_runs = mapper.map_runs if self._batch else self._map_spans
        self.background = background
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvcached-pages", daemon=True)
            self._thread.start()

    # -- hot path -------------------------------------------------------------------------
    def growable(self, room: int | None = None) -> int:
        """Pages that may still be mapped now: unmapped, under the cap, and
        within the budget's headroom (``room`` pages, if already read)."""
        grow = self.cap_pages - (self.num_pages - self.n_unmapped)
        if grow > self.n_unmapped:
            grow = self.n_unmapped
        if room is None:
            room = self.budget.headroom() // self.page_bytes
        if room < grow:
            grow = room
        return grow if grow > 0 else 0

    def take(self, n: int) -> list[int] | None:
        """``n`` pages for blocks (idle ones first, then newly mapped), or
        ``None`` when that many cannot be had now. All or nothing."""
        lock = self._lock
        if self.n_idle >= n:  # a peek, confirmed under the lock: most takes stop here
            lock.acquire()
            try:
                if self._closed:
                    return None
                if self.n_idle >= n:
                    pages = self._pop_idle(n)
                    refill = self._after_take()
                else:
                    pages = None
            finally:
                lock.release()
            if pages is not None:
                if refill:
                    self._refill()
                return pages
        # One thread grows at a time: two threads' driver calls at once are
        # slower than the same calls in turn (the driver serializes them, and
        # each handoff wakes a thread), and a take that waited for the pool's
        # refill usually finds the pages it needs idle when it gets the lock.
        grow_lock = self._grow_lock
        gate = self._gate
        gate.take_waiting = True  # a pool refill yields to a waiting take
        grow_lock.acquire()
        gate.take_waiting = False
        try:
            lock.acquire()
            try:
                if self._closed:
                    return None
                n_idle = self.n_idle
                grow = n - n_idle
                if grow <= 0:  # pages came back meanwhile
                    pages = self._pop_idle(n)
                    refill = self._after_take()
                    spans = None
                # Growth (one page at a time on a decode step, so every step
                # counts) asks the budget once, by the mapper's grant: a denial
                # there undoes the pick and misses, as a short headroom would.
                elif self.growable(grow) < grow:
                    return None
                else:
                    pages = self._pop_idle(n_idle) if n_idle else []
                    spans = self._pick_unmapped(grow)
            finally:
                lock.release()
            if spans is not None:
                return self._grow_for_take(spans, pages)
            if refill:
                self._refill(grow_locked=True)
            return pages
        finally:
            grow_lock.release()

    def _grow_for_take(self, spans: list[tuple[int, int]], pages: list[int]) -> list[int] | None:
        """Map a take's picked (busy) ``spans`` and hand them out after the
        idle ``pages`` it took; on a miss every span is settled and the idle
        pages go back. Grow lock held."""
        lock = self._lock
        try:
            done = self._map_runs(spans)
        except BaseException:
            with lock:
                if self._batch:  # _map_spans settles its spans itself
                    self._settle_interrupted(spans)
                self._push_idle(pages)  # the idle pages taken before go back
            raise
        lock.acquire()
        try:
            if done == len(spans):
                self._publish(spans, USED, pages)
                refill = self.n_idle < self.min_reserved and self._after_take()
            else:
                self._publish(spans[:done], IDLE)
                for first, count in spans[done:]:
                    self._fail_span(first, count)
                self._push_idle(pages)
                pages = None
                refill = False
        finally:
            lock.release()
        if pages is None:
            self._maybe_shrink_inline()
        elif refill:
            self._refill(grow_locked=True)
        return pages

    def give_back(self, pages: list[int]) -> None:
        """Pages whose blocks are all free again become idle (and are released
        later if the pool is over ``max_reserved`` or the cap)."""
        with self._lock:
            state = self._state
            for p in pages:
                if state[p] != USED:
                    raise AssertionError(f"give_back: page {p} is not used (state {state[p]})")
            self._push_idle(pages)
            shrink = self._needs_shrink()
        if shrink:
            if self.background:
                self._wake.set()
            else:
                self._shrink()

    # -- lock-held helpers -----------------------------------------------------------------
    def _pop_idle(self, n: int) -> list[int]:
        """Take ``n`` idle pages: pinned runs' first, then loose runs' (once a
        loose run gives a page, its other pages are pinned and come next)."""
        state, run_of = self._state, self._run
        pinned, loose = self._pinned, self._loose
        out = []
        while len(out) < n:
            if pinned:
                p = heapq.heappop(pinned)
                if state[p] != IDLE or run_of[p].used == 0:
                    continue  # stale: taken, released, or its run went loose
            else:
                p = heapq.heappop(loose)
                if state[p] != IDLE or run_of[p].used != 0:
                    continue  # stale: taken, released, or its run got pinned
            state[p] = USED
            run = run_of[p]
            if run.used == 0:
                del self._idle_runs[run.first]
                for q in range(run.first, run.first + run.count):
                    if q != p and state[q] == IDLE:
                        heapq.heappush(pinned, q)
            run.used += 1
            out.append(p)
        self.n_idle -= n
        self.n_used += n
        if len(pinned) + len(loose) > 2 * self.n_idle + 64:  # drop stale entries now and then
            self._pinned = sorted({p for p in pinned if state[p] == IDLE and run_of[p].used})
            self._loose = sorted({p for p in loose if state[p] == IDLE and not run_of[p].used})
        return out

    def _push_idle(self, pages: list[int]) -> None:
        """Used pages become idle (their blocks are all free)."""
        state, run_of = self._state, self._run
        for p in pages:
            state[p] = IDLE
            run = run_of[p]
            run.used -= 1
            if run.used == 0:
                self._idle_runs[run.first] = run
                for q in range(run.first, run.first + run.count):
                    heapq.heappush(self._loose, q)  # every page of the run is idle now
            else:
                heapq.heappush(self._pinned, p)
        self.n_used -= len(pages)
        self.n_idle += len(pages)

    def _after_take(self) -> bool:
        """Ask for a refill when the pool ran low. ``True``: the caller must
        run it inline (``background=False``) once it has let go of the lock."""
        if self.n_idle < self.min_reserved and not self._refill_wanted and not self.reserve_held:
            self._refill_wanted = True
            if self.background:
                self._wake.set()
                return False
            return True
        return False

    def _pick_unmapped(self, n: int) -> list[tuple[int, int]]:
        """Mark ``n`` unmapped pages busy, as spans the mapper can map as one
        extent each: the lowest ones, unless mapped pages split them and a
        hole higher up holds all ``n`` (up to :data:`CONTIGUOUS_PICK_MAX`)."""
        if n <= 0:
            return []
        state = self._state
        first = state.find(_UNMAPPED_BYTE, self._unmapped_lo)
        assert first >= 0, "n_unmapped counts more unmapped pages than exist"
        self.n_unmapped -= n
        self.n_busy += n
        if n == 1:
            state[first] = BUSY
            self._unmapped_lo = first + 1
            return [(first, 1)]
        max_run = self.mapper.max_run_pages
        if n <= CONTIGUOUS_PICK_MAX:
            want = _UNMAPPED_BYTE * n
            if not state.startswith(want, first):
                # The lowest pages are split by mapped ones: the lowest hole
                # that holds all n instead, so they grow (and go back) as one
                # run; the pages below it stay for later takes.
                hole = state.find(want, first)
                if hole >= 0:
                    state[hole : hole + n] = _BYTE[BUSY] * n
                    return [
                        (p, n - (p - hole) if n - (p - hole) < max_run else max_run)
                        for p in range(hole, hole + n, max_run)
                    ]
        spans = []
        if max_run == 1:  # coalescing off: one page per span
            find = state.find
            for _ in range(n - 1):
                state[first] = BUSY
                spans.append((first, 1))
                first = find(_UNMAPPED_BYTE, first + 1)
                assert first >= 0, "n_unmapped counts more unmapped pages than exist"
            state[first] = BUSY
            spans.append((first, 1))
            self._unmapped_lo = first + 1
            return spans
        left = n
        while True:
            seg = state[first : first + (left if left < max_run else max_run)]
            count = len(seg) - len(seg.lstrip(_UNMAPPED_BYTE))  # unmapped pages from first
            end = first + count
            state[first:end] = _BYTE[BUSY] * count
            spans.append((first, count))
            left -= count
            if not left:
                break
            first = state.find(_UNMAPPED_BYTE, end)
            assert first >= 0, "n_unmapped counts more unmapped pages than exist"
        self._unmapped_lo = end  # every page in [old lo, end) is now not unmapped
        return spans

    def _publish(
        self, spans: Sequence[tuple[int, int]], to: int, out: list[int] | None = None
    ) -> None:
        """Busy spans were mapped: each becomes a run of used or idle pages,
        appended to ``out`` if given. Several spans at once, as a take that
        grows publishes them: one call and one counter update for them all."""
        state, run_of = self._state, self._run
        used = to == USED
        total = 0
        for first, count in spans:
            run = _Run(first, count, count if used else 0)
            if count == 1:
                state[first] = to
                run_of[first] = run
                if out is not None:
                    out.append(first)
            else:
                state[first : first + count] = _BYTE[to] * count
                run_of[first : first + count] = [run] * count
                if out is not None:
                    out.extend(range(first, first + count))
            total += count
            if not used:
                self._idle_runs[first] = run
                for p in range(first, first + count):
                    heapq.heappush(self._loose, p)
        self.n_busy -= total
        if used:
            self.n_used += total
        else:
            self.n_idle += total

    def _unbusy(self, first: int, count: int) -> None:
        """A busy span is unmapped again (growth failed, or release succeeded)."""
        if count == 1:
            self._state[first] = UNMAPPED
            self._run[first] = None
        else:
            self._state[first : first + count] = _UNMAPPED_BYTE * count
            self._run[first : first + count] = [None] * count
        self.n_busy -= count
        self.n_unmapped += count
        if first < self._unmapped_lo:
            self._unmapped_lo = first

    def _fail_span(self, first: int, count: int) -> None:
        """A busy span did not get mapped (or released): unmapped when the
        mapper holds nothing there, else quarantined. Another thread's trim
        may have finished the release since the mapper reported the failure,
        so the mapper's book decides, not the failure."""
        if self.mapper.extent_of(first) is None:
            self._unbusy(first, count)
        else:
            self._state[first : first + count] = _BYTE[QUARANTINED] * count
            self.n_busy -= count
            self.n_quarantined += count

    def _drop_released_quarantine(self) -> int:
        """Quarantined pages the mapper holds no extent on any more (a retry,
        by this pool or by anyone else, released them) become unmapped;
        returns how many. Lock held."""
        state, run_of, extent_of = self._state, self._run, self.mapper.extent_of
        released = 0
        p = state.find(_QUARANTINED_BYTE)
        while p >= 0:
            span = extent_of(p)
            if span is None:
                state[p] = UNMAPPED
                run_of[p] = None
                if p < self._unmapped_lo:
                    self._unmapped_lo = p
                released += 1
                p = state.find(_QUARANTINED_BYTE, p + 1)
            else:
                p = state.find(_QUARANTINED_BYTE, span[0] + span[1])
        self.n_quarantined -= released
        self.n_unmapped += released
        return released

    def _needs_shrink(self) -> bool:
        over = self.num_pages - self.n_unmapped - self.cap_pages
        return bool(self._idle_runs) and (over > 0 or self.n_idle > self.max_reserved)

    # -- driver work, outside the lock ------------------------------------------------------
    def _map_spans(self, spans: list[tuple[int, int]]) -> int:
        """Map each busy span with ``map_run`` (a mapper without ``map_runs``);
        stop at the first that fails (the rest would most likely fail the
        same way). Returns how many leading spans were mapped. If a call
        raises, the spans are settled here (mapped ones idle, the rest
        unmapped or quarantined) before the error goes on."""
        for i, (first, count) in enumerate(spans):
            try:
                ok = self.mapper.map_run(first, count)
            except BaseException:
                with self._lock:
                    self._publish(spans[:i], IDLE)
                    for f, c in spans[i:]:
                        self._fail_span(f, c)
                raise
            if not ok:
                return i
        return len(spans)

    def _settle_interrupted(self, spans: list[tuple[int, int]]) -> None:
        """``map_runs`` (or one ``map_run``) raised part way: spans the
        mapper made live become idle, the rest unmapped or quarantined. Lock
        held."""
        is_mapped = getattr(self.mapper, "is_mapped", None)
        for first, count in spans:
            if is_mapped is not None and is_mapped(first):
                self._publish(((first, count),), IDLE)
            else:
                self._fail_span(first, count)

    def _release_runs(self, chosen: list[_Run]) -> int:
        """Unmap runs already marked busy; returns pages released."""
        spans = [(r.first, r.count) for r in chosen]
        try:
            results = self.mapper.unmap_runs(spans)
        except BaseException:
            with self._lock:  # nothing was touched: the runs are idle again
                for r in chosen:
                    self._state[r.first : r.first + r.count] = _BYTE[IDLE] * r.count
                    self.n_busy -= r.count
                    self.n_idle += r.count
                    self._idle_runs[r.first] = r
                    for p in range(r.first, r.first + r.count):
                        heapq.heappush(self._loose, p)
            raise
        released = 0
        with self._lock:
            for r, ok in zip(chosen, results, strict=True):
                if ok:
                    self._unbusy(r.first, r.count)
                    released += r.count
                else:
                    # Another thread's trim may have retried it since: ask the mapper.
                    self._fail_span(r.first, r.count)
        self.budget.flush()
        return released

    def _claim_idle_runs(self, want_pages: int | None) -> list[_Run]:
        """Mark idle runs busy for release, highest first, until ``want_pages``
        pages are covered (``None``: every idle run). Lock held."""
        chosen: list[_Run] = []
        got = 0
        idle_runs, state = self._idle_runs, self._state
        if want_pages is None:
            want_pages = self.num_pages
        for first in sorted(idle_runs, reverse=True):
            if got >= want_pages:
                break
            r = idle_runs.pop(first)
            count = r.count
            if count == 1:
                state[first] = BUSY
            else:
                state[first : first + count] = _BYTE[BUSY] * count
            got += count
            chosen.append(r)
        self.n_idle -= got
        self.n_busy += got
        return chosen

    def _shrink(self) -> int:
        """Release idle runs while over the cap or above ``max_reserved``."""
        with self._lock:
            over = self.num_pages - self.n_unmapped - self.cap_pages
            excess = self.n_idle - self.max_reserved
            want = max(over, excess)
            if want <= 0 or not self._idle_runs:
                return 0
            chosen = self._claim_idle_runs(want)
        return self._release_runs(chosen)

    def hold_reserve(self, seconds: float) -> None:
        """Map no reserve for ``seconds`` from now (a later call may extend it):
        takes map what they need and no more, so memory this pool gave to a
        neighbour that is short (:mod:`kvcached.control.yielding`) is not taken
        straight back. A plain store: any thread may call it."""
        self._reserve_held_until = max(self._reserve_held_until, time.monotonic() + seconds)

    @property
    def reserve_held(self) -> bool:
        """Whether a :meth:`hold_reserve` is in force now."""
        return time.monotonic() < self._reserve_held_until

    def _refill(self, grow_locked: bool = False) -> int:
        """Map idle pages up to ``min_reserved`` (within cap and budget);
        ``grow_locked``: the caller holds the grow lock already."""
        with self._lock:
            self._refill_wanted = False
            if self._closed or self.reserve_held:
                return 0
            want = self.min_reserved - self.n_idle
        if want <= 0:
            return 0
        if grow_locked:
            return self._grow_idle_locked(None)[0]
        return self._grow_idle(None)

    def take_page(self, page: int) -> bool:
        """Page ``page`` itself for blocks: taken if idle, mapped if unmapped
        (within the cap and the budget). ``False`` when it cannot be had now
        (no room, or it is used, busy or quarantined). For an engine that hands
        out a block by id rather than by count (vLLM's ``touch`` of a free block)."""
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ConfigError("page", page, f"a page id in [0, {self.num_pages})")
        with self._grow_lock:
            room = self.budget.headroom() // self.page_bytes
            with self._lock:
                if self._closed:
                    return False
                state = self._state[page]
                if state == IDLE:
                    self._take_idle(page)
                    return True
                if state != UNMAPPED or self.growable(room) < 1:
                    return False
                self._state[page] = BUSY
                self.n_unmapped -= 1
                self.n_busy += 1
            try:
                ok = self.mapper.map_run(page, 1)
            except BaseException:
                with self._lock:
                    self._settle_interrupted([(page, 1)])
                raise
            with self._lock:
                if ok:
                    self._publish(((page, 1),), USED)
                else:
                    self._fail_span(page, 1)
        if not ok:
            self._maybe_shrink_inline()
        return ok

    def _take_idle(self, p: int) -> None:
        """One idle page becomes used (lock held); its heap entry goes stale."""
        state, run = self._state, self._run[p]
        state[p] = USED
        if run.used == 0:
            del self._idle_runs[run.first]
            for q in range(run.first, run.first + run.count):
                if q != p and state[q] == IDLE:
                    heapq.heappush(self._pinned, q)
        run.used += 1
        self.n_idle -= 1
        self.n_used += 1

    def map_idle(self, want: int) -> int:
        """Map up to ``want`` new pages as idle, within the cap and the budget;
        returns how many were mapped (it stops at the first denial). For an
        integration that must have pages granted before it commits to using
        them (vLLM's planner grants before the scheduler's capacity check)."""
        if want <= 0:
            return 0
        return self._grow_idle(want)

    def _grow_idle(self, want: int | None) -> int:
        """Map up to ``want`` new idle pages (``None``: up to ``min_reserved``
        idle, counted under the lock) within the cap and the budget's headroom;
        returns how many were mapped.

        One step at a time (a run of up to ``max_run_pages`` pages, or of
        :data:`REFILL_STEP_HANDLES` handles' pages when that is more), each
        under the grow lock of its own, and the pool's refill stops when
        a take is waiting for that lock: the take waits for one extent at
        most, then usually finds it idle, instead of waiting for the whole
        refill (five pages of a Llama-3-8B cache on the per-layer layout are
        320 handles, about 12 ms on an H200)."""
        step = max(
            self.mapper.max_run_pages,
            REFILL_STEP_HANDLES // getattr(self.mapper, "handles_per_page", 1),
        )
        mapped = 0
        while want is None or mapped < want:
            with self._grow_lock:
                got, asked = self._grow_idle_locked(
                    None if want is None else want - mapped, most=step
                )
            mapped += got
            if got == 0 or got < asked:  # nothing left to do, or a denial
                break
            if want is None and self._gate.take_waiting:
                break  # the take asks for the refill again if it leaves the pool short
        return mapped

    def _grow_idle_locked(self, want: int | None, most: int | None = None) -> tuple[int, int]:
        """One round of :meth:`_grow_idle` (at most ``most`` pages) with the
        grow lock held: ``(pages mapped, pages tried)``."""
        room = self.budget.headroom() // self.page_bytes
        with self._lock:
            if want is None:
                want = self.min_reserved - self.n_idle
            want = min(want, self.growable(room))
            if most is not None and want > most:
                want = most
            if want <= 0 or self._closed:
                return 0, 0
            spans = self._pick_unmapped(want)
        try:
            done = self._map_runs(spans)
        except BaseException:
            if self._batch:  # _map_spans settles its spans itself
                with self._lock:
                    self._settle_interrupted(spans)
            raise
        with self._lock:
            self._publish(spans[:done], IDLE)
            for first, count in spans[done:]:
                self._fail_span(first, count)
        return sum(c for _, c in spans[:done]), want

    def _maybe_shrink_inline(self) -> None:
        if not self.background and self._needs_shrink():
            self._shrink()

    def maintain(self) -> None:
        """Release what is over the cap or the pool's maximum, then refill the
        pool if a take asked for it. The background thread calls this; with
        ``background=False`` ``take`` and ``give_back`` do."""
        if self._needs_shrink():  # an unlocked peek: a vLLM step calls this every step
            self._shrink()
        if self._refill_wanted:
            self._refill()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(MAINTENANCE_INTERVAL_S)
            self._wake.clear()
            if self._closed:
                break
            with self._round:
                if self._closed:
                    break
                try:
                    self.maintain()
                except Exception:  # the pool thread must outlive one bad round
                    log.exception("page pool maintenance failed; retrying on the next round")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the pool thread still: it finishes the round in flight, then
        starts no refill or shrink until the block ends (a wake-up meanwhile
        is served after it). For a reader that needs the pages, the charges
        and the device to agree: a refill is granted before it creates its
        handles, so a reading taken while one runs sees the grant first.
        Calls from other threads (takes, trims, limits) go on as usual; do
        not :meth:`close` inside the block."""
        with self._round:
            yield

    # -- control ------------------------------------------------------------------------------
    def set_cap(self, pages: int) -> None:
        """Cap mapped pages at ``pages`` (``0 <= pages <= num_pages``). Lowering
        stops growth and releases idle runs; used pages stay until freed."""
        if not 0 <= pages <= self.num_pages:
            raise ConfigError("pages", pages, f"a page count in [0, {self.num_pages}]")
        with self._lock:
            self.cap_pages = pages
            shrink = self._needs_shrink()
        if shrink:
            if self.background:
                self._wake.set()
            else:
                self._shrink()

    def trim(self) -> int:
        """Unmap every idle run now and retry quarantined ones. Returns the
        pages released. Idle pages of a run that still has a used page stay."""
        with self._lock:
            chosen = self._claim_idle_runs(None)
        released = self._release_runs(chosen) if chosen else 0
        return released + self.retry_quarantined()

    def retry_quarantined(self) -> int:
        """Retry the release of everything the mapper holds quarantined, also
        a failed growth or release whose thread has not settled it here yet
        (that thread then finds it gone and leaves it unmapped). Returns the
        quarantined pages of this pool now unmapped."""
        done = self.mapper.retry_quarantined()
        with self._lock:
            released = self._drop_released_quarantine() if self.n_quarantined else 0
        if done:
            self.budget.flush()
        return released

    def counts(self) -> dict[str, int]:
        """A consistent snapshot of the counters."""
        with self._lock:
            return {
                "idle": self.n_idle,
                "used": self.n_used,
                "busy": self.n_busy,
                "quarantined": self.n_quarantined,
                "unmapped": self.n_unmapped,
                "cap": self.cap_pages,
            }

    def recount(self) -> dict[str, int]:
        """Counters recomputed from the page states (tests, debugging)."""
        with self._lock:
            s = self._state
            return {
                "idle": s.count(IDLE),
                "used": s.count(USED),
                "busy": s.count(BUSY),
                "quarantined": s.count(QUARANTINED),
                "unmapped": s.count(UNMAPPED),
                "cap": self.cap_pages,
            }

    def state_of(self, page: int) -> int:
        return self._state[page]

    def run_of(self, page: int) -> tuple[int, int] | None:
        run = self._run[page]
        return None if run is None else (run.first, run.count)

    def close(self) -> bool:
        """Stop the pool thread and release every page (shutdown). Returns
        ``True`` when nothing stays mapped. Idempotent."""
        with self._lock:
            already = self._closed
            self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(timeout=10)
            self._thread = None
        if already:
            return self.mapper.mapped_pages == 0
        clean = self.mapper.unmap_all()
        with self._lock:
            for p in range(self.num_pages):
                state = self._state[p]
                if state == UNMAPPED:
                    continue
                if self.mapper.extent_of(p) is None:
                    self._state[p] = UNMAPPED
                    self._run[p] = None
                elif state != BUSY:  # kept by the mapper's quarantine; a trim retries it
                    self._state[p] = QUARANTINED
            s = self._state
            self.n_idle, self.n_used, self.n_busy = s.count(IDLE), s.count(USED), s.count(BUSY)
            self.n_quarantined, self.n_unmapped = s.count(QUARANTINED), s.count(UNMAPPED)
            self._idle_runs.clear()
            self._pinned.clear()
            self._loose.clear()
        return clean
