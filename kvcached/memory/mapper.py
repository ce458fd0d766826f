"""Physical memory under the virtual KV tensors, one *extent* at a time.

An extent is a run of adjacent pages ``[first, first+count)`` mapped by one set
of physical handles (one handle on ``CONTIGUOUS``, one per layer and buffer on
``PER_LAYER``). The driver charges per handle, not per byte, so growing many
pages as one extent is cheap; but a handle is mapped whole and unmapped whole,
so an extent is also the unit of release: its pages come back together or not
at all. Callers that want 2 MiB reclaim granularity map one page per extent.

Rules this class keeps:

* a page belongs to at most one extent; an extent is *live* (mapped, usable),
  *in flight* (being mapped or unmapped by one thread) or *quarantined*;
* growth goes ``grant -> (create -> map -> set_access) per handle``; whatever
  fails is undone in reverse, and bytes never created are refunded at once.
  Extents of adjacent pages grown together (a *run*) share their
  ``set_access`` calls: every handle of the run's lane ``i`` is created and
  mapped, then one call enables the whole lane; a failure undoes the run,
  but for the extents before the failed call when it failed in the last
  lane (with one handle a page, always): those are whole, enabled and kept;
* release goes ``synchronize -> unmap -> release -> refund``, one
  ``unmap_range`` per lane of a run of adjacent extents of one size released
  together; a refund follows a confirmed release only. A handle whose unmap
  or release failed keeps its charge and leaves its extent quarantined
  (unusable, still counted as mapped) until :meth:`PageMapper.retry_quarantined` finishes the job;
* driver calls never run under the lock.

This is the page-level API an integration can use on its own (a vLLM worker
mapping the pages its scheduler chose): :meth:`PageMapper.map_pages` and
:meth:`PageMapper.unmap_pages`.

Growth is the hot path (one ``take`` of the page pool per new page when
coalescing is off), so its Python work per extent is kept to a few
microseconds: the address of every handle is arithmetic on strides computed
once, an extent keeps its handles in a list (per-handle states exist only
once a teardown starts), and :meth:`PageMapper.map_runs` maps several extents
behind one validation, one lock for the claims, one grant and one lock to
publish them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from kvcached.driver.base import Handle
from kvcached.errors import DriverError, MappingError, OutOfPhysicalMemoryError
from kvcached.log import get_logger
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.spec import PageShape
from kvcached.memory.tensors import PagedTensors
from kvcached.units import MIB

log = get_logger("kvcached.memory")

DEFAULT_MAX_HANDLE_BYTES = 64 * MIB

# handle states
_CREATED, _MAPPED, _UNMAPPED, _RELEASED = range(4)


class PageBackend(Protocol):
    """What :class:`~kvcached.memory.pages.PageAllocator` needs from a mapper.

    :class:`PageMapper` is the in-process implementation. Under tensor
    parallelism the scheduler's process holds no KV tensors: an integration
    passes the allocator a proxy with these members that asks every worker's
    own :class:`PageMapper` to do the same call (all succeed, or the ones that
    did are undone) and whose ``budget`` reports the smallest headroom of the
    ranks.
    """

    budget: PhysicalBudget
    geometry: PageShape
    page_bytes: int
    max_run_pages: int
    mapped_pages: int

    def map_run(self, first: int, count: int) -> bool: ...

    # Optional: ``map_runs(spans) -> int`` (how many leading spans were mapped;
    # see PageMapper.map_runs) and ``is_mapped(page) -> bool``. The page pool
    # uses them when both are there, else calls map_run once per span.
    # The pool keeps no list of its own quarantine: it calls
    # ``retry_quarantined()`` (every extent) and asks ``extent_of`` what stays.

    def unmap_runs(self, spans: list[tuple[int, int]]) -> list[bool]: ...

    def retry_quarantined(
        self, spans: list[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]: ...

    def extent_of(self, page: int) -> tuple[int, int] | None: ...

    def unmap_all(self) -> bool: ...


class Extent:
    """Pages ``[first, first+count)`` and their handles.

    Handle ``i`` maps lane ``i`` of the extent (see
    :meth:`~kvcached.memory.tensors.VirtualKVTensors.extent_ranges`). While it
    is built, ``handles[:mapped]`` are mapped and any handle after them is
    created only; a teardown turns that into one state per handle
    (``states``), which a retry of a quarantined extent picks up from.
    """

    __slots__ = ("first", "count", "handles", "mapped", "states", "quarantined", "busy")

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self.handles: list[Handle] = []
        self.mapped = 0
        self.states: bytearray | None = None
        self.quarantined = False
        self.busy = True  # in flight until published

    def __repr__(self) -> str:
        state = "quarantined" if self.quarantined else "busy" if self.busy else "live"
        return f"<Extent pages [{self.first}, {self.first + self.count}) {state}>"


class PageMapper:
    """Maps and unmaps pages of one :class:`~kvcached.memory.tensors.PagedTensors`
    (:class:`~kvcached.memory.tensors.VirtualKVTensors` or
    :class:`~kvcached.memory.ranges.RangeKVTensors`) against a budget.

    ``max_handle_bytes`` caps one handle; extents longer than
    :attr:`max_run_pages` are refused (``0`` turns coalescing off: one page per
    extent). ``before_unmap`` runs once before each batch of unmaps; the default
    waits for the device (``driver.synchronize``) so no kernel still reads the
    pages.
    """

    def __init__(
        self,
        tensors: PagedTensors,
        budget: PhysicalBudget,
        *,
        max_handle_bytes: int = DEFAULT_MAX_HANDLE_BYTES,
        before_unmap: Callable[[], None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.driver = tensors.driver
        self.geometry = g = tensors.geometry
        self.budget = budget
        self.page_bytes = g.page_bytes
        self.max_run_pages = max(1, max_handle_bytes // g.handle_bytes_per_page)
        self.before_unmap = before_unmap or self.driver.synchronize
        self._num_pages = g.num_pages
        # (va of page 0, page stride) of each lane (a handle's address range):
        # lane i of an extent is (va_i + first * stride_i, count * stride_i).
        self._strides = tensors.handle_strides()
        self._lock = threading.Lock()
        self._owner: list[Extent | None] = [None] * g.num_pages
        self._quarantine: dict[int, Extent] = {}
        self.mapped_pages = 0  # pages of live, in-flight and quarantined extents

    # -- queries ------------------------------------------------------------------------
    @property
    def handles_per_page(self) -> int:
        """Physical handles (address ranges) a one-page extent maps."""
        return len(self._strides)

    def extent_of(self, page: int) -> tuple[int, int] | None:
        """``(first, count)`` of the extent holding ``page``, or ``None``."""
        ext = self._owner[page]
        return None if ext is None else (ext.first, ext.count)

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` is live: mapped, usable, not in flight."""
        ext = self._owner[page]
        return ext is not None and not ext.busy and not ext.quarantined

    @property
    def quarantined_pages(self) -> int:
        with self._lock:
            return sum(e.count for e in self._quarantine.values())

    def held_bytes(self) -> int:
        """Bytes of handles created and not yet released (live, in-flight and
        quarantined extents). Equals what this mapper holds charged."""
        with self._lock:
            seen: set[int] = set()
            total = 0
            for ext in self._owner:
                if ext is not None and id(ext) not in seen:
                    seen.add(id(ext))
                    total += self._held(ext)
            return total

    def _held(self, ext: Extent) -> int:
        """Bytes of ``ext``'s handles created and not yet released."""
        sizes = [ext.count * stride for _, stride in self._strides]
        if ext.states is None:
            return sum(sizes[: len(ext.handles)])
        return sum(size for size, st in zip(sizes, ext.states, strict=False) if st != _RELEASED)

    def quarantined_extents(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(e.first, e.count) for e in self._quarantine.values()]

    # -- growth -------------------------------------------------------------------------
    def map_run(self, first: int, count: int) -> bool:
        """Map pages ``[first, first+count)`` as one extent: :meth:`map_runs`
        of one span.

        ``False`` when the budget denies it or the device is out of memory /
        fails (the attempt is undone). Raises :class:`MappingError` for a range
        outside the cache, longer than :attr:`max_run_pages`, or overlapping a
        page that is already mapped."""
        return self.map_runs([(first, count)]) == 1

    def map_runs(self, spans: list[tuple[int, int]]) -> int:
        """Map each ``(first, count)`` span as one extent, in order, and stop
        at the first that cannot be mapped. Returns how many leading spans
        are now live; the rest are untouched (a failed one is undone, or
        quarantined when it could not be).

        One grant covers every span; what is not mapped is refunded. Extents
        of adjacent pages are built as a run (:meth:`_build_run`, which says
        which extents of a failed run are kept). Raises :class:`MappingError`,
        changing nothing, when any span is outside the cache, longer than
        :attr:`max_run_pages`, or overlaps a mapped page or another span. If
        it raises later (an interrupt), the spans before the run in flight
        are live and the rest as above."""
        exts, pages = self._claim_spans(spans)
        if not exts:
            return 0
        try:
            granted = self.budget.grant(pages * self.page_bytes)
        except BaseException:
            self._forget_all(exts)
            raise
        if not granted:
            self._forget_all(exts)
            return 0
        done = 0
        try:
            n = len(exts)
            while done < n:
                j = done + 1
                end = exts[done].first + exts[done].count
                while j < n and exts[j].first == end:
                    end += exts[j].count
                    j += 1
                if j == done + 1:
                    self._build(exts[done])
                else:
                    try:
                        self._build_run(exts[done:j])
                    except DriverError as exc:
                        done += getattr(exc, "built", 0)  # whole extents before the failure
                        raise
                done = j
        except DriverError as exc:
            level = log.debug if isinstance(exc, OutOfPhysicalMemoryError) else log.warning
            level(
                "mapping pages [%d, %d) failed, undone: %s",
                exts[done].first,
                exts[-1].first + exts[-1].count,
                exc,
            )
            self._abandon(exts, done)
        except BaseException:
            self._abandon(exts, done)
            raise
        finally:  # the spans before `done` go live (after an undo of the rest)
            lock = self._lock
            lock.acquire()
            try:
                for i in range(done):
                    exts[i].busy = False
            finally:
                lock.release()
        return done

    def _claim_spans(self, spans: list[tuple[int, int]]) -> tuple[list[Extent], int]:
        """Validate every span, then own all their pages under one hold of the
        lock (or none: :class:`MappingError`). Returns the new extents, in
        flight, and their pages."""
        num_pages, max_run = self._num_pages, self.max_run_pages
        exts = []
        pages = 0
        for first, count in spans:
            if (
                first.__class__ is not int
                or count.__class__ is not int
                or first < 0
                or count < 1
                or count > max_run
                or first + count > num_pages
            ):
                first, count = self._check_span(first, count)
            exts.append(Extent(first, count))
            pages += count
        if not exts:
            return exts, 0
        owner = self._owner
        lock = self._lock
        lock.acquire()
        try:  # claim every page, or none
            for ext in exts:
                first = ext.first
                if ext.count == 1 and owner[first] is None:
                    owner[first] = ext
                else:
                    self._claim_pages(ext, exts)
            self.mapped_pages += pages
        finally:
            lock.release()
        return exts, pages

    def _check_span(self, first: object, count: object) -> tuple[int, int]:
        """The slow check of one span: its ints, or :class:`MappingError`."""
        g = self.geometry
        if (
            not isinstance(first, int)
            or not isinstance(count, int)
            or count < 1
            or first < 0
            or first + count > g.num_pages
        ):
            raise MappingError(
                f"map_run(first={first}, count={count}): needs 0 <= first, count >= 1, "
                f"first + count <= {g.num_pages}"
            )
        if count > self.max_run_pages:
            raise MappingError(
                f"map_run(count={count}): at most {self.max_run_pages} pages per extent"
            )
        return int(first), int(count)

    def _claim_pages(self, ext: Extent, claiming: list[Extent]) -> None:
        """Own every page of ``ext``; if one is taken, drop the claims of
        ``claiming`` (this call's extents) and raise. Lock held."""
        owner = self._owner
        first = ext.first
        for p in range(first, first + ext.count):
            if owner[p] is not None:
                taken = owner[p]
                self._unclaim(claiming)
                raise MappingError(f"map_run: page {p} is already in {taken!r}")
        for p in range(first, first + ext.count):
            owner[p] = ext

    def _build(self, ext: Extent) -> None:
        """Create, map and enable each handle of ``ext`` in turn (each lane
        is its own address range, so its access is set once it is mapped).
        ``ext.handles`` and ``ext.mapped`` say how far it got if one fails."""
        driver = self.driver
        create, map_, set_access = driver.create, driver.map, driver.set_access
        first, count = ext.first, ext.count
        handles = ext.handles
        for base, stride in self._strides:
            size = count * stride
            va = base + first * stride
            handle = create(size)
            handles.append(handle)
            map_(va, size, handle)
            ext.mapped += 1
            set_access(va, size)

    def _build_run(self, run: list[Extent]) -> None:
        """:meth:`_build` for two extents of adjacent pages or more: lane ``i``
        of every extent is created and mapped, then enabled by one
        ``set_access`` over the run's lane ``i`` (a run of 32 one-handle pages grew 1.04x as fast
        as one call per page on an H200, ``benchmarks/driver_runs.py``).

        If a call fails, each extent's ``handles`` and ``mapped`` say how far
        it got, and the error carries ``built``: how many leading extents of
        the run are whole. Those are the ones before the failed call when it
        failed in the last lane (with one handle a page, every lane is the
        last): they are enabled here and kept, as one call per page would
        have kept them. Every other extent of the run is left to be undone."""
        driver = self.driver
        create, map_, set_access = driver.create, driver.map, driver.set_access
        first = run[0].first
        last = len(self._strides) - 1
        for s, (base, stride) in enumerate(self._strides):
            start_va = va = base + first * stride
            k = 0
            try:
                for ext in run:
                    size = ext.count * stride
                    handle = create(size)
                    ext.handles.append(handle)
                    map_(va, size, handle)
                    ext.mapped += 1
                    va += size
                    k += 1
            except DriverError as exc:
                built = self._enable_built(start_va, va, k if s == last else 0)
                exc.built = built  # type: ignore[attr-defined]
                raise
            set_access(start_va, va - start_va)

    def _enable_built(self, start_va: int, end_va: int, k: int) -> int:
        """Enable ``[start_va, end_va)``, the last lane of the ``k`` whole
        extents before a failed call in :meth:`_build_run`; returns how many
        are kept (0 when there are none or the call fails: undone then)."""
        if not k:
            return 0
        try:
            self.driver.set_access(start_va, end_va - start_va)
        except DriverError as exc:
            log.warning("enabling %d mapped pages failed, undone too: %s", k, exc)
            return 0
        return k

    def _unclaim(self, exts: list[Extent]) -> None:
        owner = self._owner
        for ext in exts:
            for p in range(ext.first, ext.first + ext.count):
                if owner[p] is ext:
                    owner[p] = None

    def _abandon(self, exts: list[Extent], done: int) -> None:
        """Growth stopped in the run that starts at ``exts[done]``: undo, in
        reverse, every extent after ``done`` that holds a handle, and drop
        the rest, refunding what they were granted."""
        page_bytes = self.page_bytes
        rest = exts[done:]
        started = [ext for ext in rest if ext.handles]
        for ext in reversed(started):
            self._undo(ext, ext.count * page_bytes)
        untouched = [ext for ext in rest if not ext.handles]
        if untouched:
            self._forget_all(untouched)
            self._refund(sum(ext.count for ext in untouched) * page_bytes)

    def _forget_all(self, exts: list[Extent]) -> None:
        """:meth:`_forget` for several extents, under one hold of the lock."""
        with self._lock:
            owner = self._owner
            quarantine = self._quarantine
            pages = 0
            for ext in exts:
                first, count = ext.first, ext.count
                if count == 1:
                    if owner[first] is ext:
                        owner[first] = None
                else:
                    for p in range(first, first + count):
                        if owner[p] is ext:
                            owner[p] = None
                if quarantine:
                    quarantine.pop(first, None)
                pages += count
            self.mapped_pages -= pages

    def _undo(self, ext: Extent, granted: int) -> None:
        """Unwind a half-built extent in reverse; refund what never became or
        no longer is memory; quarantine whatever could not be undone."""
        created = sum(ext.count * stride for _, stride in self._strides[: len(ext.handles)])
        clean = self._teardown(ext)
        held = self._held(ext)
        # `granted - created` was never allocated; released handles were refunded
        # by _teardown.
        self._refund(granted - created)
        if clean:
            self._forget(ext)
        else:
            log.error(
                "could not undo a failed growth of pages [%d, %d): %d bytes stay "
                "charged and quarantined until trim",
                ext.first,
                ext.first + ext.count,
                held,
            )
            with self._lock:
                ext.quarantined = True
                ext.busy = False
                self._quarantine[ext.first] = ext

    def map_pages(self, pages: Iterable[int]) -> bool:
        """Map every page in ``pages`` (any order), adjacent ones as shared
        extents of up to :attr:`max_run_pages`. All or nothing: on ``False``
        every extent this call mapped is unmapped again."""
        done: list[tuple[int, int]] = []
        for first, count in runs(sorted(pages), self.max_run_pages):
            if not self.map_run(first, count):
                for f, c in reversed(done):
                    self.unmap_run(f, c)
                return False
            done.append((first, count))
        return True

    # -- release ------------------------------------------------------------------------
    def unmap_run(self, first: int, count: int) -> bool:
        """Unmap and release pages ``[first, first+count)``, which must be a
        union of whole live extents. ``True`` when every handle was released
        and refunded; ``False`` when some extent is now quarantined."""
        return all(self.unmap_runs([(first, count)]))

    def unmap_runs(self, spans: list[tuple[int, int]]) -> list[bool]:
        """:meth:`unmap_run` for several ``(first, count)`` spans behind one
        ``before_unmap``; one result per span. Validates every span before
        touching any."""
        claimed: list[list[Extent]] = []
        with self._lock:  # claim every span, or none
            try:
                for first, count in spans:
                    claimed.append(self._claim_locked(first, count))
            except BaseException:
                for exts in claimed:
                    for ext in exts:
                        ext.busy = False
                raise
        if not claimed:
            return []
        self.before_unmap()
        if len(claimed) == 1:
            return [self._release(claimed[0])]
        if self._release([ext for exts in claimed for ext in exts]):  # runs across spans
            return [True] * len(claimed)
        return [not any(ext.quarantined for ext in exts) for exts in claimed]

    def unmap_pages(self, pages: Iterable[int]) -> bool:
        """Unmap every page in ``pages``; they must cover whole extents."""
        ids = sorted(pages)
        return all(self.unmap_runs(runs(ids, len(ids) or 1)))

    def _claim_locked(self, first: int, count: int) -> list[Extent]:
        """Mark the live extents that make up ``[first, first+count)`` busy;
        :class:`MappingError` (claiming none of them) if they do not. Lock held."""
        owner = self._owner
        if count == 1 and first.__class__ is int and 0 <= first < len(owner):
            ext = owner[first]
            if (
                ext is not None
                and ext.count == 1
                and ext.first == first
                and not ext.busy
                and not ext.quarantined
            ):
                ext.busy = True
                return [ext]
        exts, p, end = [], first, first + count
        while p < end:
            ext = owner[p] if 0 <= p < len(owner) else None
            if ext is None or ext.first != p or ext.busy or ext.quarantined or p + ext.count > end:
                for e in exts:
                    e.busy = False
                raise MappingError(
                    f"unmap [{first}, {end}): page {p} does not start a live extent "
                    f"that ends inside the range ({ext!r}); a handle is unmapped whole"
                )
            ext.busy = True
            exts.append(ext)
            p += ext.count
        return exts

    def _release(self, exts: list[Extent]) -> bool:
        """Unmap and release claimed extents (``before_unmap`` has run);
        ``True`` when every one is gone, else the rest are quarantined.
        Adjacent extents of one size, as pages released together are, go
        by runs: one ``unmap_range`` per lane of the run, then a release
        per handle (see :meth:`_release_runs`); any other extent, or one
        whose run failed, by :meth:`_teardown`."""
        gone: list[Extent] = []
        bad: list[Extent] = []
        if len(exts) > 1:
            if exts[0].first > exts[-1].first:
                exts = exts[::-1]  # pages are released highest first: runs ascend now
            rest = self._release_runs(exts, gone)
        else:
            rest = exts
        for ext in rest:
            if self._teardown(ext):
                gone.append(ext)
            else:
                bad.append(ext)
        if gone:
            self._forget_all(gone)
        for ext in bad:
            with self._lock:
                ext.quarantined = True
                ext.busy = False
                self._quarantine[ext.first] = ext
            log.warning(
                "pages [%d, %d) quarantined: a handle could not be unmapped or "
                "released; its charge is kept and trim retries it",
                ext.first,
                ext.first + ext.count,
            )
        return not bad

    def _release_runs(self, exts: list[Extent], gone: list[Extent]) -> list[Extent]:
        """Unmap runs of adjacent, fully mapped extents of one size among
        ``exts`` (a run is extents in ascending order in ``exts``, each
        starting where the one before it ends), one ``unmap_range`` per lane
        of a run, and release their handles; released extents go to ``gone``
        and their bytes are refunded. Returns the extents left for
        :meth:`_teardown` (not in a run, or their run failed: their
        ``states`` say how far)."""
        rest: list[Extent] = []
        freed = 0
        i, n = 0, len(exts)
        while i < n:
            j = self._run_end(exts, i)
            if j - i == 1:
                rest.append(exts[i])
            else:
                run = exts[i:j]
                if self._unmap_run(run):
                    freed += self._release_handles(run, gone, rest)
                else:
                    rest.extend(run)
            i = j
        self._refund(freed)
        return rest

    def _run_end(self, exts: list[Extent], i: int) -> int:
        """The end of the run of ``exts`` that starts at ``i``: fully mapped
        extents of one size, each starting where the one before it ends
        (``i + 1`` when ``exts[i]`` starts no run)."""
        nh = len(self._strides)
        ext = exts[i]
        j, n = i + 1, len(exts)
        if ext.states is not None or ext.mapped != nh:
            return j
        count = ext.count
        end = ext.first + count
        while j < n:
            nxt = exts[j]
            if nxt.first != end or nxt.count != count or nxt.states is not None or nxt.mapped != nh:
                break
            end += count
            j += 1
        return j

    def _unmap_run(self, run: list[Extent]) -> bool:
        """One ``unmap_range`` per lane of ``run``, the last lane first.
        ``False`` when one fails: every extent of the run then has its
        per-handle ``states`` (what the failed call unmapped counted as
        unmapped), for :meth:`_teardown` to finish."""
        unmap_range = self.driver.unmap_range
        strides = self._strides
        nh = len(strides)
        first, count, k = run[0].first, run[0].count, len(run)
        for s in range(nh - 1, -1, -1):
            base, stride = strides[s]
            try:
                unmap_range(base + first * stride, count * stride, k)
            except DriverError as exc:
                log.warning(
                    "unmap of %d mappings of %d bytes at %#x failed, retried one by one: %s",
                    k,
                    count * stride,
                    base + first * stride,
                    exc,
                )
                went = getattr(exc, "unmapped", 0)
                for idx, e in enumerate(run):
                    st = e.states = bytearray([_MAPPED]) * nh
                    st[s + 1 :] = bytes([_UNMAPPED]) * (nh - s - 1)
                    if idx < went:
                        st[s] = _UNMAPPED
                return False
        return True

    def _release_handles(self, run: list[Extent], gone: list[Extent], rest: list[Extent]) -> int:
        """Release every handle of the unmapped extents of ``run``, the last
        lane first; an extent whose release failed keeps its ``states`` and
        goes to ``rest``, the others to ``gone``. Returns the bytes released."""
        release = self.driver.release
        sizes = [run[0].count * stride for _, stride in self._strides]
        nh = len(sizes)
        ext_bytes = sum(sizes)
        freed = 0
        for e in run:
            handles = e.handles
            for h in range(nh - 1, -1, -1):
                try:
                    release(handles[h])
                except DriverError as exc:
                    log.warning("release of a %d-byte handle failed: %s", sizes[h], exc)
                    e.states = bytearray([_UNMAPPED]) * (h + 1) + bytearray([_RELEASED]) * (
                        nh - h - 1
                    )
                    freed += sum(sizes[h + 1 :])
                    rest.append(e)
                    break
            else:
                freed += ext_bytes
                gone.append(e)
        return freed

    def _teardown(self, ext: Extent) -> bool:
        """Unmap and release every handle of ``ext`` in reverse; refund what was
        confirmed released. ``True`` when nothing is left. The caller has
        already run ``before_unmap`` (or nothing was ever visible to kernels)."""
        driver = self.driver
        states = ext.states
        if states is None:  # first teardown: per-handle states from the build
            states = ext.states = bytearray([_MAPPED]) * ext.mapped + bytearray([_CREATED]) * (
                len(ext.handles) - ext.mapped
            )
        first, count = ext.first, ext.count
        freed = 0
        for i in range(len(states) - 1, -1, -1):
            base, stride = self._strides[i]
            va, size = base + first * stride, count * stride
            if states[i] == _MAPPED:
                try:
                    driver.unmap(va, size)
                    states[i] = _UNMAPPED
                except DriverError as exc:
                    log.warning("unmap of %d bytes at %#x failed: %s", size, va, exc)
                    continue
            if states[i] in (_CREATED, _UNMAPPED):
                try:
                    driver.release(ext.handles[i])
                    states[i] = _RELEASED
                    freed += size
                except DriverError as exc:
                    log.warning("release of a %d-byte handle failed: %s", size, exc)
        self._refund(freed)
        return states.count(_RELEASED) == len(states)

    def _refund(self, nbytes: int) -> None:
        if nbytes > 0:
            self.budget.refund(nbytes)

    def _forget(self, ext: Extent) -> None:
        with self._lock:
            owner = self._owner
            for p in range(ext.first, ext.first + ext.count):
                if owner[p] is ext:
                    owner[p] = None
            self._quarantine.pop(ext.first, None)
            self.mapped_pages -= ext.count

    def retry_quarantined(
        self, spans: list[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]:
        """Try again to unmap and release quarantined extents: those given as
        ``(first, count)`` in ``spans``, or every one (``None``). Returns the
        spans now released (their pages are free again)."""
        with self._lock:
            if spans is None:
                spans = [(e.first, e.count) for e in self._quarantine.values() if not e.busy]
            todo: list[Extent | None] = []
            for first, count in spans:
                ext = self._quarantine.get(first)
                if ext is None or ext.busy or ext.count != count:
                    todo.append(None)
                else:
                    ext.busy = True
                    todo.append(ext)
        done: list[tuple[int, int]] = []
        if not any(todo):
            return done
        self.before_unmap()
        for ext in todo:
            if ext is None:
                continue
            if self._teardown(ext):
                self._forget(ext)
                done.append((ext.first, ext.count))
                log.info("quarantined pages [%d, %d) released", ext.first, ext.first + ext.count)
            else:
                with self._lock:
                    ext.busy = False
        return done

    def unmap_all(self) -> bool:
        """Release every live and quarantined extent (shutdown). ``True`` when
        nothing is left mapped."""
        with self._lock:
            exts = []
            seen: set[int] = set()
            for ext in self._owner:
                if (
                    ext is not None
                    and not ext.busy
                    and not ext.quarantined
                    and ext.first not in seen
                ):
                    seen.add(ext.first)
                    ext.busy = True
                    exts.append(ext)
        if exts:
            self.before_unmap()
            self._release(exts)
        self.retry_quarantined()
        self.budget.flush()
        return self.mapped_pages == 0


def runs(sorted_ids: list[int], max_len: int) -> list[tuple[int, int]]:
    """Split ascending page ids into ``(first, count)`` runs of adjacent ids,
    each at most ``max_len`` long. Raises :class:`MappingError` on duplicates."""
    out: list[tuple[int, int]] = []
    if not sorted_ids:
        return out
    first = prev = sorted_ids[0]
    for p in sorted_ids[1:]:
        if p == prev:
            raise MappingError(f"page {p} is listed twice")
        if p == prev + 1 and p - first < max_len:
            prev = p
            continue
        out.append((first, prev - first + 1))
        first = prev = p
    out.append((first, prev - first + 1))
    return out
