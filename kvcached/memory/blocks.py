"""The block manager an engine's scheduler calls: block ids in, block ids out.

Blocks live in pages (``page = block // blocks_per_page``); pages come from a
:class:`~kvcached.memory.pages.PageAllocator`. Placement is best fit: blocks
come from the fullest held pages first (pages are filed by the power-of-two
class of their free count, so the choice is O(1)), then from idle pages, then
from new ones. Live blocks pack into few pages and emptied pages return whole,
to be reused or unmapped.

Three tiers of failure: running out is ``None`` from :meth:`BlockManager.alloc`
(a scheduling miss, retried later); a wrong id handed back raises
:class:`~kvcached.errors.BlockError` and changes nothing; a broken invariant is
an ``assert``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from kvcached.errors import BlockError, CapacityError, ConfigError
from kvcached.memory.pages import PageAllocator

_LIVE, _NULL = 1, 2  # values of the per-block state byte (0: not live)


@dataclass(frozen=True)
class MemoryUsage:
    """One consistent reading of a KV cache group, for the control layer.

    Pages: ``pages_used`` hold live blocks, ``pages_reserved`` are mapped and
    idle (the pre-mapped pool, and idle pages of a run that is partly used),
    ``pages_quarantined`` failed to unmap and stay charged; ``pages_mapped``
    is all three plus pages in flight. ``limit_bytes`` is the cap on mapped
    bytes now in force (the startup size when no limit is set).
    """

    blocks_used: int
    blocks_available: int
    blocks_total: int
    blocks_per_page: int
    pages_used: int
    pages_reserved: int
    pages_quarantined: int
    pages_mapped: int
    pages_total: int
    page_bytes: int
    bytes_mapped: int
    limit_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BlockManager:
    """Allocates KV blocks of one group.

    Thread-safe by default: one lock around ``alloc`` and ``free`` (page
    growth, which calls the driver, runs under it, so concurrent engine
    threads wait for a growing one; the pool thread never takes it). The
    lock is taken with ``acquire``/``release`` (half the cost of a ``with``
    block): about 0.15 us per call, 5-10% of an alloc + free of a typical
    request. An engine whose scheduler is the only caller passes
    ``thread_safe=False`` and saves even that.

    Invariants:

    * a block is *live* (returned by :meth:`alloc`, not yet freed) iff its
      state byte is set; the null block 0, when reserved, is never handed out
      and can never be freed;
    * the manager holds a page iff the page holds at least one live block;
      every block of a held page is live or in that page's free list;
    * ``free blocks in held pages`` equals the sum of those free lists, and a
      held page with ``k > 0`` free blocks is in bucket ``k.bit_length()``;
    * :meth:`available_size` is what :meth:`alloc` will grant right now when
      no other thread or process changes anything in between;
    * while the null block is *parked* (:meth:`park_null_block`: its page given
      back so that an instance held at zero holds nothing), no page is held and
      :meth:`alloc` grants nothing but ``[]``, until :meth:`unpark_null_block`
      has block 0 on page 0 again.
    """

    def __init__(
        self, pages: PageAllocator, *, reserve_null_block: bool = True, thread_safe: bool = True
    ) -> None:
        g = pages.mapper.geometry
        self.thread_safe = thread_safe
        if not thread_safe:
            # One engine thread calls alloc/free (vLLM's and SGLang's schedulers
            # do): skip the lock, which costs as much as the work for small
            # requests. The pool thread never touches this object's state.
            self.alloc = self._alloc_nolock  # type: ignore[method-assign]
            self.free = self._free_nolock  # type: ignore[method-assign]
        self._pages = pages
        self._budget = pages.budget
        self.blocks_per_page = bpp = g.blocks_per_page
        self.num_blocks = g.num_blocks
        self.page_bytes = pages.page_bytes
        self._lock = threading.Lock()
        self._state = bytearray(self.num_blocks)
        self._free: list[list[int] | None] = [None] * g.num_pages
        # Held pages with free blocks are filed by class: k free blocks is
        # class k.bit_length() (1, 2-3, 4-7, ...), so placement is fullest class
        # first and a free seldom moves a page between buckets.
        self._full_class = bpp.bit_length()
        self._class = [k.bit_length() for k in range(bpp + 1)]  # free count -> class
        self._class_of = [0] * g.num_pages  # 0: not filed (full, or not held)
        self._buckets: list[dict[int, None]] = [{} for _ in range(self._full_class + 1)]
        self._lo = self._full_class  # no non-empty bucket below this
        self._free_in_held = 0
        self._closed = False
        self._limit_pages = g.num_pages
        self._resize_pages = g.num_pages
        self.null_block: int | None = None
        self.null_parked = False
        #: Pages the last refused :meth:`alloc` lacked beyond the idle ones (the
        #: control layer's call for memory on a busy device: ``short_bytes``).
        self.last_miss_pages = 0
        if reserve_null_block:
            got = pages.take(1)
            if got is None:
                raise CapacityError(
                    "kvcached could not map the first page (for the null block): a page "
                    f"needs {self.page_bytes} bytes, the physical budget has "
                    f"{self._budget.headroom()} bytes of headroom and the cap allows "
                    f"{pages.cap_pages} pages; free device memory or raise "
                    "KVCACHED_GPU_UTILIZATION (a driver failure is logged above)"
                )
            assert got == [0], f"the first page of a fresh allocator must be page 0, got {got}"
            self._adopt(got)
            taken = self._alloc_nolock(1)  # the adopted page's first block
            assert taken == [0], f"the null block must be block 0, got {taken}"
            self._state[0] = _NULL
            self.null_block = 0

    # -- hot path ---------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """``n`` block ids, or ``None`` when they cannot be had now (a
        scheduling miss; nothing changed). ``alloc(0)`` is ``[]``."""
        lock = self._lock  # acquire/release: half the cost of `with` here
        lock.acquire()
        try:
            return self._alloc_nolock(n)
        finally:
            lock.release()

    def _alloc_nolock(self, n: int) -> list[int] | None:
        """:meth:`alloc` with the lock held (or none needed). Maps pages when
        held pages lack free blocks, then places: fullest class of page
        first, whole pages while the fullest holds no more than what is left,
        then part of the next. Most calls (a decode step, a short prefill)
        end at the first page."""
        if n.__class__ is not int:
            n = self._count_arg(n)
        if n <= 0:
            if n == 0:
                return []
            raise ConfigError("n", n, "a number of blocks >= 0")
        if n > self._free_in_held:
            if self.null_parked:
                return None  # no block before block 0 is back (unpark_null_block)
            bpp = self.blocks_per_page
            want = (n - self._free_in_held + bpp - 1) // bpp
            pages = self._pages.take(want)
            if pages is None:
                self.last_miss_pages = want - self._pages.n_idle
                return None
            self._adopt(pages)
        buckets, lists, state = self._buckets, self._free, self._state
        k = self._lo
        out = None
        left = n
        while True:
            bucket = buckets[k]
            while not bucket:
                k += 1
                bucket = buckets[k]
            # popitem, not next(iter()): a dict's first live entry can sit
            # behind many deleted ones, its last cannot.
            p = bucket.popitem()[0]  # any page of the fullest class
            lst = lists[p]
            m = len(lst) - left  # blocks it keeps free
            if m > 0:
                break
            self._class_of[p] = 0  # the page goes whole
            if out is None:  # its list becomes the result; the page gets a new one
                out = lst
                lists[p] = []
            else:
                out += lst
                lst.clear()
            left = -m
            if not left:
                self._lo = k
                self._free_in_held -= n
                for b in out:
                    state[b] = _LIVE
                return out
        c = self._class[m]  # part of page p: it moves down to the class of m
        buckets[c][p] = None
        if c != k:
            self._class_of[p] = c
            k = c
        self._lo = k
        self._free_in_held -= n
        if out is None:
            if left == 1:
                b = lst.pop()
                state[b] = _LIVE
                return [b]
            out = lst[-left:]
        else:
            out += lst[-left:]
        del lst[-left:]
        for b in out:
            state[b] = _LIVE
        return out

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back. Raises :class:`BlockError`, changing nothing, if
        any id is out of range, not live (never allocated, or freed already,
        including twice in this call) or the null block."""
        lock = self._lock
        lock.acquire()
        try:
            self._free_nolock(block_ids)
        finally:
            lock.release()

    def _free_nolock(self, block_ids: list[int]) -> None:
        if self._closed:
            return  # torn down: nothing is handed out again, so nothing to file
        ids = block_ids if block_ids.__class__ is list else list(block_ids)
        state = self._state
        bpp = self.blocks_per_page
        nb = self.num_blocks
        n = len(ids)
        if n == 1:
            b = ids[0]
            if b.__class__ is not int or not 0 <= b < nb or state[b] != 1:
                raise self._free_error(ids, 0)
            state[b] = 0
            p = b // bpp
            self._free[p].append(b)
            if self._refile(p, 1):
                self._pages.give_back([p])
            return
        if not n:
            return
        # Check and clear every id first, noting where the page changes (an
        # alloc's ids come as one run per page); the page lists are touched
        # only once every id is good, a run at a time. The current page's
        # bounds check the range too, so an id costs four tests; a page change
        # (or a bad id) takes the full check.
        runs = None
        start = 0
        p = ids[0]
        if p.__class__ is int and 0 <= p < nb:  # the first id's page: the loop's bounds
            p //= bpp
            lo = p * bpp
            hi = lo + bpp
        else:  # the first id takes the full check (and fails it)
            lo = hi = 0
        it = iter(ids)
        for b in it:
            if b.__class__ is not int or b >= hi or b < lo or state[b] != 1:
                at = n - it.__length_hint__() - 1
                if b.__class__ is not int or not 0 <= b < nb or state[b] != 1:
                    for q in ids[:at]:
                        state[q] = 1  # undo: nothing else was changed yet
                    raise self._free_error(ids, at)
                if at:  # a new page: the ids before it were one run
                    if runs is None:
                        runs = []
                    runs.append((p, start, at))
                p = b // bpp
                lo = p * bpp
                hi = lo + bpp
                start = at
            state[b] = 0
        if runs is None:  # one page
            self._free[p].extend(ids)
            if self._refile(p, n):
                self._pages.give_back([p])
            return
        runs.append((p, start, n))
        touched: dict[int, int] = {}
        for p, lo, hi in runs:
            self._free[p].extend(ids[lo:hi])
            touched[p] = touched.get(p, 0) + hi - lo
        refile = self._refile
        emptied = [p for p, done in touched.items() if refile(p, done)]
        if emptied:
            self._pages.give_back(emptied)

    def _refile(self, p: int, done: int) -> bool:
        """File held page ``p`` under the class of its free count after
        ``done`` of its blocks came back (a negative ``done``: were handed
        out). ``True`` when every block of it is free: unfiled and no longer
        counted as held then, for the caller to give back."""
        k = len(self._free[p])
        empty = k == self.blocks_per_page
        c = 0 if empty else self._class[k]
        old = self._class_of[p]
        if c != old:
            if old:
                del self._buckets[old][p]
            if c:
                self._buckets[c][p] = None
                if c < self._lo:
                    self._lo = c
            self._class_of[p] = c
        self._free_in_held += done - k if empty else done
        return empty

    def claim(self, block: int) -> bool:
        """Hand out the free block ``block`` itself (an engine that picks
        blocks by id: vLLM's ``touch`` of a free block). Its page is taken or
        mapped if the manager does not hold it; ``False`` when that cannot be
        done now (nothing changed). Raises :class:`BlockError` if ``block`` is
        not free (live, the null block) and :class:`ConfigError` if it is out
        of range."""
        if (
            isinstance(block, bool)
            or not isinstance(block, int)
            or not 0 <= block < self.num_blocks
        ):
            raise ConfigError("block", block, f"a block id in [0, {self.num_blocks})")
        lock = self._lock
        lock.acquire()
        try:
            if self._state[block] != 0:
                raise BlockError(
                    f"claim(): block {block} is not free (it is live or the null "
                    "block); nothing was changed"
                )
            bpp = self.blocks_per_page
            p = block // bpp
            lst = self._free[p]
            if lst is None or len(lst) == bpp:  # the page is not held: take it first
                if not self._pages.take_page(p):
                    return False
                self._adopt([p])
                lst = self._free[p]
            lst.remove(block)
            self._refile(p, -1)
            self._state[block] = _LIVE
            return True
        finally:
            lock.release()

    def available_size(self) -> int:
        """Blocks :meth:`alloc` can grant now: free blocks in held pages, plus
        whole idle pages, plus the pages the cap and the budget still allow.
        O(1), no lock (a snapshot; exact when nothing changes concurrently)."""
        pa = self._pages
        unmapped = pa.n_unmapped
        grow = pa.cap_pages - pa.num_pages + unmapped
        if grow > unmapped:
            grow = unmapped
        room = self._budget.headroom() // self.page_bytes
        if room < grow:
            grow = room
        if grow < 0:
            grow = 0
        return self._free_in_held + (pa.n_idle + grow) * self.blocks_per_page

    def ready_size(self) -> int:
        """Blocks :meth:`alloc` can grant now without mapping a page: free
        blocks in held pages plus whole idle (already mapped) pages."""
        return self._free_in_held + self._pages.n_idle * self.blocks_per_page

    # -- lock-held helpers ---------------------------------------------------------------------
    def _adopt(self, pages: list[int]) -> None:
        bpp = self.blocks_per_page
        c = self._full_class
        bucket = self._buckets[c]
        for p in pages:
            lst = self._free[p]
            if lst is None:
                first = p * bpp
                lst = self._free[p] = list(range(first + bpp - 1, first - 1, -1))
            assert len(lst) == bpp, f"page {p} came back with {len(lst)} of {bpp} blocks free"
            bucket[p] = None
            self._class_of[p] = c
        if pages and c < self._lo:
            self._lo = c
        self._free_in_held += len(pages) * bpp

    # -- errors ----------------------------------------------------------------------------------
    @staticmethod
    def _count_arg(n: object) -> int:
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise ConfigError("n", n, "a whole number of blocks")
        return n.__index__()  # numpy and torch integer scalars

    def _free_error(self, ids: list[int], at: int) -> BlockError:
        b = ids[at]
        where = f"free(): id #{at} ({b!r})"
        if b.__class__ is not int:
            return BlockError(f"{where} is not an int block id")
        if not 0 <= b < self.num_blocks:
            return BlockError(f"{where} is out of range [0, {self.num_blocks})")
        if self._state[b] == _NULL:
            return BlockError(f"{where} is the reserved null block; it is never freed")
        if b in ids[:at]:
            return BlockError(f"{where} appears twice in this call")
        return BlockError(f"{where} is not allocated (never handed out, or freed already)")

    # -- control ----------------------------------------------------------------------------------
    def set_limit(self, nbytes: int | None) -> None:
        """Cap mapped memory at ``nbytes`` (``None``: back to the startup
        size). Lowering never takes a page that holds live blocks: growth
        stops, idle pages are released now and used ones as they empty."""
        if nbytes is None:
            pages = self._pages.num_pages
        elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError("nbytes", nbytes, "a byte count >= 0, or None for the startup size")
        else:
            pages = min(self._pages.num_pages, nbytes // self.page_bytes)
        self._limit_pages = pages
        self._pages.set_cap(min(self._limit_pages, self._resize_pages))

    @property
    def limit_pages(self) -> int:
        """The pages :meth:`set_limit` allows now (the startup size without a limit)."""
        return self._limit_pages

    def resize(self, num_blocks: int | None) -> None:
        """Cap the cache at the pages ``num_blocks`` blocks need (``None``:
        the startup size); same lazy shrink as :meth:`set_limit`."""
        if num_blocks is None:
            pages = self._pages.num_pages
        elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(
                "num_blocks", num_blocks, "a block count >= 0, or None for the startup size"
            )
        else:
            bpp = self.blocks_per_page
            pages = min(self._pages.num_pages, (num_blocks + bpp - 1) // bpp)
        self._resize_pages = pages
        self._pages.set_cap(min(self._limit_pages, self._resize_pages))

    def trim(self) -> int:
        """Unmap every idle page that can go (see :meth:`PageAllocator.trim`);
        returns pages released."""
        return self._pages.trim()

    def park_null_block(self) -> bool:
        """Give back page 0, the null block's, when no other block lives on it,
        so that nothing stays mapped (an instance put to sleep at zero). The
        caller guarantees that nothing reads block 0 until
        :meth:`unpark_null_block` (an idle engine runs no step). False, and
        nothing changed, when there is no null block, it is parked already, or
        page 0 holds other live blocks."""
        with self._lock:
            if self.null_block is None or self.null_parked or self._closed:
                return False
            bpp = self.blocks_per_page
            lst = self._free[0]
            if lst is None or len(lst) != bpp - 1:
                return False
            c = self._class_of[0]
            if c:
                del self._buckets[c][0]
                self._class_of[0] = 0
            self._free_in_held -= bpp - 1
            lst.append(0)  # last: alloc hands it out first when the page comes back
            self._state[0] = 0
            self.null_parked = True
        self._pages.give_back([0])
        return True

    def unpark_null_block(self) -> bool:
        """Map page 0 again and make block 0 the null block, as at start. False
        when the page cannot be had now (the cap or the budget: retry later; the
        block manager grants nothing meanwhile)."""
        with self._lock:
            if not self.null_parked:
                return True
            got = self._pages.take(1)
            if got is None:
                return False
            if got != [0]:  # page 0 still held elsewhere (e.g. in flight): try again later
                self._pages.give_back(got)
                return False
            self._adopt(got)
            taken = self._alloc_nolock(1)  # the adopted page's first block
            assert taken == [0], f"the null block must be block 0 again, got {taken}"
            self._state[0] = _NULL
            self.null_parked = False
            return True

    def close(self) -> None:
        """Stop handing out blocks (the cache is being torn down): every later
        ``alloc`` is a miss and ``free`` does nothing. Idempotent."""
        with self._lock:
            self._closed = True
            self._free_in_held = 0
            for bucket in self._buckets:
                bucket.clear()
            self._class_of = [0] * len(self._class_of)
            self._lo = self._full_class

    def page_of(self, block: int) -> int:
        """The page that holds ``block`` (in every layer and buffer)."""
        return block // self.blocks_per_page

    def is_live(self, block: int) -> bool:
        return self._state[block] == _LIVE

    def usage(self) -> MemoryUsage:
        with self._lock:
            c = self._pages.counts()
            # every used page is held here: its blocks are live or free
            live = c["used"] * self.blocks_per_page - self._free_in_held
            live -= self.null_block is not None and not self.null_parked
            available = self.available_size()
        mapped = c["idle"] + c["used"] + c["busy"] + c["quarantined"]
        return MemoryUsage(
            blocks_used=live,
            blocks_available=available,
            blocks_total=self.num_blocks - (self.null_block is not None),
            blocks_per_page=self.blocks_per_page,
            pages_used=c["used"],
            pages_reserved=c["idle"],
            pages_quarantined=c["quarantined"],
            pages_mapped=mapped,
            pages_total=self._pages.num_pages,
            page_bytes=self.page_bytes,
            bytes_mapped=mapped * self.page_bytes,
            limit_bytes=c["cap"] * self.page_bytes,
        )

    def check(self) -> None:
        """Verify every invariant against a full recount (tests, debugging;
        O(blocks)). Raises ``AssertionError`` naming the broken one."""
        with self._lock:
            bpp = self.blocks_per_page
            state = self._state
            pa = self._pages
            free_total = 0
            held = 0
            for p in range(pa.num_pages):
                blocks = state[p * bpp : (p + 1) * bpp]
                n_live = bpp - blocks.count(0)
                ps = pa.state_of(p)
                if n_live:
                    assert ps == 2, f"page {p} holds {n_live} live blocks but is in state {ps}"
                    held += 1
                    lst = self._free[p]
                    assert sorted(lst) == [p * bpp + i for i in range(bpp) if not blocks[i]], (
                        f"page {p}: free list does not match its free blocks"
                    )
                    k = len(lst)
                    free_total += k
                    c = k.bit_length()
                    assert self._class_of[p] == c and (c == 0 or p in self._buckets[c]), (
                        f"page {p} with {k} free blocks is filed under {self._class_of[p]}"
                    )
                else:
                    assert ps != 2, f"page {p} is held but holds no live block"
            assert free_total == self._free_in_held, (
                f"free blocks in held pages {self._free_in_held} != recount {free_total}"
            )
            assert all(not b for b in self._buckets[: self._lo]), "a bucket below _lo is in use"
            assert sum(len(b) for b in self._buckets) == sum(
                1 for p in range(pa.num_pages) if self._class_of[p]
            ), "bucket membership drifted"
            assert pa.counts() == pa.recount(), f"page counters {pa.counts()} != {pa.recount()}"
            assert pa.n_used == held, f"allocator has {pa.n_used} used pages, manager holds {held}"
            live = sum(1 for s in state if s == _LIVE)
            used = (
                pa.n_used * bpp
                - self._free_in_held
                - (self.null_block is not None and not self.null_parked)
            )
            assert used == live, f"blocks_used {used} differs from a recount {live}"
