"""SGLang's allocator state over kvcached's block manager, without SGLang.

SGLang's allocators hand out KV slots by page (SGLang's ``page_size`` slots;
one slot when ``page_size == 1``). :class:`SlotAllocator` is what the elastic
allocator classes (``allocators.py``) keep instead of SGLang's free-page
tensors: one SGLang page is one kvcached block of ``block_tokens`` tokens
(see ``elastic_kv.py``; kvcached's own *page* is the mapping unit, many
blocks), so this class counts blocks where SGLang counts pages. The
block manager picks which block (best fit into partly used kvcached pages, so
live and cached tokens pack into few pages and idle memory returns as whole
pages), and pages are mapped on demand under the ledger's budget.

Three counts decide what an allocation gets:

* the *logical* capacity, SGLang's ``size // page_size`` pages, which the
  scheduler sized everything else by;
* the *physical* forecast, the block manager's ``available_size()``: free
  blocks in mapped pages plus what the cap and the ledger still allow;
* under tensor parallelism, the round's agreed count
  (:class:`~kvcached.integrations.sglang.tp_agreement.RoundAgreement`): the
  smallest rank's forecast at the start of the round, plus the round's own
  frees, minus its own allocations.

Invariants:

* a block SGLang holds is live in the block manager and marked here;
  ``n_live <= capacity``;
* *stashed* blocks (:meth:`reserve`) are live in the block manager but not
  yet SGLang's; they are handed out before any new block and given back when
  the outermost round ends, so a reservation made at admission cannot be
  taken by another process before the allocation that follows it;
* :meth:`available_tokens` is what :meth:`alloc_blocks` grants now (no other
  thread or process changing anything), and inside a distributed round the
  same number on every rank;
* running out is ``None`` / ``False``, never an exception.

Not thread-safe, like SGLang's allocators: the scheduler thread calls it.
The control thread only calls :meth:`request_eviction` (an int store) and the
page pool's own thread-safe trim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvcached.errors import ConfigError
from kvcached.integrations.sglang.elastic_kv import ElasticKV
from kvcached.integrations.sglang.tp_agreement import Reducer, RoundAgreement


class SlotAllocator:
    """See the module docstring. ``capacity`` is in SGLang pages (blocks)."""

    def __init__(self, kv: ElasticKV, capacity: int) -> None:
        usable = kv.cache.num_blocks - 1  # block 0 is the padding page
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, int)
            or not 0 <= capacity <= usable
        ):
            raise ConfigError(
                "capacity", capacity, f"a block count in [0, {usable}] (the pool's usable blocks)"
            )
        self.kv = kv
        self.blocks = kv.blocks
        self.block_tokens = kv.shape.block_tokens
        self.capacity = capacity
        self._live = bytearray(kv.cache.num_blocks)
        self.n_live = 0
        self._stash: list[int] = []
        self._evict_wanted = 0
        self.evictor: Callable[[int], int] | None = None
        self.agreement = RoundAgreement(
            self.local_available_tokens, None, local_request=lambda: self._evict_wanted
        )
        self.misses = 0  # allocations and reservations that returned None / False
        self.local_failures = 0  # of which this rank's block manager said no
        self.evicted_tokens = 0
        self.prefix_cached_tokens = 0  # the tree's evictable tokens at the last round
        self.prefill_guard = False  # set by the scheduler group around admission
        self.bound_scheduler = False

    # -- counts ------------------------------------------------------------------------------
    def local_available_tokens(self) -> int:
        """min(logical free, physical forecast incl. the stash), in tokens."""
        logical = self.capacity - self.n_live
        physical = self.blocks.available_size() + len(self._stash)
        return (logical if logical < physical else physical) * self.block_tokens

    def available_tokens(self) -> int:
        """What the scheduler may allocate now (the agreed count in a TP round)."""
        return self.agreement.available()

    @property
    def stashed(self) -> int:
        return len(self._stash)

    def blocks_for_extend(self, prefix_lens: Iterable[int], seq_lens: Iterable[int]) -> int:
        """New blocks (SGLang pages) an extend from ``prefix_lens`` to
        ``seq_lens`` takes (a request's last partial one is continued, not
        replaced)."""
        ps = self.block_tokens
        return sum(-(-s // ps) + (-p // ps) for p, s in zip(prefix_lens, seq_lens, strict=True))

    # -- allocation ------------------------------------------------------------------------------
    def alloc_blocks(self, n: int) -> list[int] | None:
        """``n`` block ids (SGLang's page ids; slot ids when its ``page_size``
        is 1), or ``None``."""
        if n <= 0:
            if n == 0:
                return []
            raise ConfigError("n", n, "a number of blocks >= 0")
        if n > self.capacity - self.n_live or n * self.block_tokens > self.agreement.available():
            self.misses += 1
            return None  # the same verdict on every rank: no collective needed
        stash = self._stash
        take = n if n <= len(stash) else len(stash)
        rest = n - take
        got = self.blocks.alloc(rest) if rest else []
        if got is None:
            self.local_failures += 1
        if not self.agreement.agree(got is not None):
            if got:
                self.blocks.free(got)  # another rank missed: undo ours, as every rank does
            self.misses += 1
            return None
        if take:
            ids = stash[len(stash) - take :]
            del stash[len(stash) - take :]
            ids += got
        else:
            ids = got
        live = self._live
        for b in ids:
            live[b] = 1
        self.n_live += n
        self.agreement.note_alloc(n * self.block_tokens)
        return ids

    def free_blocks(self, ids: Sequence[int]) -> None:
        """Give blocks (SGLang pages) back. An id SGLang does not hold raises
        :class:`~kvcached.errors.BlockError` (from the block manager's check
        or here) and changes nothing."""
        ids = ids if ids.__class__ is list else list(ids)
        if not ids:
            return
        live = self._live
        for b in ids:
            if not (0 <= b < len(live)) or not live[b]:
                from kvcached.errors import BlockError

                raise BlockError(
                    f"free: page {b} is not held by SGLang (never allocated, "
                    "freed already, or the padding page)"
                )
        self.blocks.free(ids)
        for b in ids:
            live[b] = 0
        self.n_live -= len(ids)
        self.agreement.note_free(len(ids) * self.block_tokens)

    def reserve(self, blocks: int) -> bool:
        """Hold ``blocks`` mapped blocks for the allocations that follow in
        this round (never more than the logical capacity leaves). ``False``
        when they cannot be had (on every rank, under TP): nothing is held."""
        want = min(blocks, self.capacity - self.n_live)
        short = want - len(self._stash)
        if short <= 0:
            return True
        got = self.blocks.alloc(short)
        if got is None:
            self.local_failures += 1
        if not self.agreement.agree(got is not None):
            if got:
                self.blocks.free(got)
            self.release_stash()
            self.misses += 1
            return False
        self._stash += got
        return True

    def release_stash(self) -> None:
        """Give unused reserved blocks back to the block manager."""
        if self._stash:
            stash, self._stash = self._stash, []
            self.blocks.free(stash)

    def live_blocks(self) -> list[int]:
        live = self._live
        return [b for b in range(len(live)) if live[b]]

    def clear(self) -> int:
        """Free everything SGLang holds and unmap every idle page (flush_cache,
        resize). Returns kvcached pages released."""
        self.release_stash()
        held = self.live_blocks()
        if held:
            self.blocks.free(held)
        self._live = bytearray(len(self._live))
        self.n_live = 0
        return self.blocks.trim()

    def resize(self, capacity: int) -> None:
        """SGLang resized its pool: clear, then hold at most ``capacity`` blocks
        (clamped to what the virtual tensors hold)."""
        self.clear()
        self.capacity = max(0, min(int(capacity), self.kv.cache.num_blocks - 1))

    # -- rounds (scheduler thread) ---------------------------------------------------------------
    def attach(self, reducer: Reducer | None) -> None:
        """Agree with the other ranks through ``reducer`` from the next round."""
        self.agreement.attach(reducer)

    def begin_round(self) -> None:
        """Open a scheduling round; the outermost one agrees the budget and
        runs the prefix-cache eviction the control thread asked for (the
        agreed, largest request of any rank, so every rank evicts the same)."""
        outermost = not self.agreement.in_round
        self.agreement.begin_round()
        if outermost and self.agreement.request > 0:
            wanted = self.agreement.request
            self._evict_wanted = 0
            if self.evictor is not None:
                self.evicted_tokens += self.evictor(wanted)
            self.kv.blocks.trim()

    def end_round(self) -> None:
        self.agreement.end_round()
        if not self.agreement.in_round:
            self.release_stash()

    # -- the padding page, parked while held at zero ---------------------------------------
    def park_padding(self) -> bool:
        """Give back block 0's page (SGLang's padding page, kvcached's null
        block) while the instance's limit is below one page and SGLang holds
        no block: an idle instance held at zero (``kvcached serve``'s ``kv``
        sleep) then holds nothing. The caller guarantees that no forward is in
        flight or runs before :meth:`unpark_padding` (the scheduler is fully
        idle). True when it was parked now."""
        blocks = self.blocks
        if blocks.null_parked or self.n_live or self._stash or blocks.limit_pages >= 1:
            return False
        if not blocks.park_null_block():
            return False
        blocks.trim()
        return True

    def unpark_padding(self) -> bool:
        """Map the padding page again once the limit allows a page (the
        scheduler thread, at a round's start, before any forward). True when
        it is mapped; False while the limit or the budget holds it back (the
        block manager then grants nothing, so nothing is scheduled)."""
        blocks = self.blocks
        if not blocks.null_parked:
            return True
        if blocks.limit_pages < 1:
            return False
        return blocks.unpark_null_block()

    def request_eviction(self, tokens: int) -> None:
        """Ask the scheduler thread to evict ``tokens`` of unreferenced prefix
        cache at its next round (any thread; the largest pending request wins)."""
        if tokens > self._evict_wanted:
            self._evict_wanted = int(tokens)
