"""kvcached's block pool accepts every call vLLM's own ``BlockPool`` accepts,
with the same observable results: both pools are driven by the same call
sequences (hypothesis) and compared after every call.

Block *ids* differ (kvcached packs blocks into pages; vLLM pops its free
queue), so blocks are paired by the order they were handed out: the i-th block
either pool handed out is one *handle*. Compared per handle: ``ref_cnt``,
``block_hash``, ``is_block_writable``; per call: what ``get_cached_block``
finds (as handles), ``reset_prefix_cache``'s verdict, ``take_events``, the
``on_reuse`` callbacks of ``unpin_blocks``, and the capacity verdict
``n <= get_num_free_blocks()`` once kvcached has reserved ``n`` (as vLLM's
``allocate_slots`` wrapper does). ``get_usage`` differs on purpose (see
docs/vllm-integration.md). Memory is ample here: with it, kvcached evicts the
same cached blocks, in the same LRU order, as vLLM.
"""

from __future__ import annotations

import os

import pytest

from tests.engines import require_engine_version

require_engine_version("vllm")
_env = dict(os.environ)
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvcached.errors import KVCachedError
    from kvcached.integrations.vllm.block_pool import KvcachedBlockPool
    from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
    from kvcached.units import MIB
    from tests.budgets import ExactBudget
finally:
    os.environ.clear()
    os.environ.update(_env)

BLOCK = 32
PAGES, PER_PAGE = 8, 8
NUM_BLOCKS = PAGES * PER_PAGE

_hasher = None


def _request(rid: str, tokens: list[int]) -> Request:
    global _hasher
    if _hasher is None:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _hasher = get_request_block_hasher(BLOCK, fn)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=_hasher)


def _kvcached_pool(budget_pages: int = PAGES) -> KvcachedBlockPool:
    g = planner_geometry(PAGES, PER_PAGE, 2 * MIB, 2 * MIB)
    planner = StepPlanner(g, ExactBudget(budget_pages * g.page_bytes))
    return KvcachedBlockPool(planner, NUM_BLOCKS, True, BLOCK, enable_kv_cache_events=True)


class Pair:
    """The same calls on vLLM's pool and kvcached's; blocks paired as handles."""

    def __init__(self) -> None:
        self.native = BlockPool(NUM_BLOCKS, True, BLOCK, enable_kv_cache_events=True)
        self.ours = _kvcached_pool()
        self.handles: list[tuple] = []  # (native block, our block)
        self.of_native: dict[int, int] = {}
        self.of_ours: dict[int, int] = {}
        self.reused: dict[str, list[int]] = {"native": [], "ours": []}
        self.held: list[list[int]] = []  # handles each "request" holds, in order

    def handle(self, native_block, our_block) -> int:
        """The handle of a pair of blocks, new if neither was seen before."""
        h = self.of_native.get(native_block.block_id)
        if h is not None:
            assert self.of_ours.get(our_block.block_id) == h, "the pools disagree on a block"
            return h
        assert our_block.block_id not in self.of_ours, "a kvcached block paired twice"
        h = len(self.handles)
        self.handles.append((native_block, our_block))
        self.of_native[native_block.block_id] = h
        self.of_ours[our_block.block_id] = h
        return h

    def forget(self, h: int) -> None:
        n, o = self.handles[h]
        del self.of_native[n.block_id], self.of_ours[o.block_id]

    def alloc(self, n: int) -> list[int] | None:
        self.ours.reserve(n)  # what the allocate_slots wrapper does before vLLM's check
        fits = n <= self.native.get_num_free_blocks()
        assert (n <= self.ours.get_num_free_blocks()) == fits, "capacity verdicts differ"
        if not fits:
            for pool in (self.native, self.ours):
                with pytest.raises(ValueError, match="Cannot get"):
                    pool.get_new_blocks(n)
            return None
        got_n, got_o = self.native.get_new_blocks(n), self.ours.get_new_blocks(n)
        out = []
        for a, b in zip(got_n, got_o, strict=True):
            # A block handed out anew starts a new handle; whatever handle its
            # id had before (a block freed or evicted earlier) is stale.
            old_n, old_o = self.of_native.get(a.block_id), self.of_ours.get(b.block_id)
            for old in {old_n, old_o} - {None}:
                self.forget(old)
            out.append(self.handle(a, b))
        return out

    def hits(self, request: Request) -> list[int]:
        found = []
        for block_hash in request.block_hashes:
            a = self.native.get_cached_block(block_hash, [0])
            b = self.ours.get_cached_block(block_hash, [0])
            assert (a is None) == (b is None), "a prefix hit in one pool only"
            if a is None:
                break
            found.append(self.handle(a[0], b[0]))
        return found

    def compare(self) -> None:
        for h, (a, b) in enumerate(self.handles):
            if self.of_native.get(a.block_id) != h:
                continue  # a stale handle: its blocks were handed out anew
            assert (a.ref_cnt, a.block_hash) == (b.ref_cnt, b.block_hash), f"handle {h}"
            assert self.native.is_block_writable(a) == self.ours.is_block_writable(b)
        assert len(self.native.cached_block_hash_to_block) == len(
            self.ours.cached_block_hash_to_block
        )
        assert self.native.take_events() == self.ours.take_events()
        assert self.reused["native"] == self.reused["ours"]
        self.ours.planner.blocks.check()

    def blocks(self, handles: list[int]) -> tuple[list, list]:
        return [self.handles[h][0] for h in handles], [self.handles[h][1] for h in handles]


def _run_request(pair: Pair, rid: str, tokens: list[int]) -> None:
    """What KVCacheManager does for a new request: hits, touch, new blocks, cache."""
    req = _request(rid, tokens)
    hit = pair.hits(req)
    full = len(req.block_hashes)
    need = -(-len(tokens) // BLOCK) - len(hit)
    native_hit, our_hit = pair.blocks(hit)
    pair.native.touch(native_hit)
    pair.ours.touch(our_hit)
    new = pair.alloc(need) if need else []
    if new is None:
        pair.native.free_blocks(reversed(native_hit))
        pair.ours.free_blocks(reversed(our_hit))
        return
    handles = hit + new
    a, b = pair.blocks(handles)
    pair.native.cache_full_blocks(req, a, len(hit), full, BLOCK, 0)
    pair.ours.cache_full_blocks(req, b, len(hit), full, BLOCK, 0)
    pair.held.append(handles)


_ops = st.one_of(
    st.tuples(st.just("request"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("touch_free"), st.integers(0, NUM_BLOCKS - 1)),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.integers(0, 200)),
    st.tuples(st.just("reset"), st.none()),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ops, min_size=1, max_size=30))
def test_both_pools_answer_every_call_alike(ops) -> None:
    pair = Pair()
    for i, (op, arg) in enumerate(ops):
        if op == "request":
            # Prompts of whole blocks from three block "words": prefixes repeat.
            tokens = [t for word in arg for t in [word + 3] * BLOCK]
            _run_request(pair, f"r{i}", tokens + [7])
        elif op == "free" and pair.held:
            handles = pair.held.pop(arg % len(pair.held))
            a, b = pair.blocks(handles)
            pair.native.free_blocks(reversed(a))
            pair.ours.free_blocks(reversed(b))
        elif op == "touch_free":
            # The case: a free block with no hash, touched by id.
            a, b = pair.native.blocks[arg], pair.ours.blocks[arg]
            if a.ref_cnt or b.ref_cnt or a.block_hash or b.block_hash or a.is_null:
                continue
            if a.block_id in pair.of_native or b.block_id in pair.of_ours:
                continue  # a paired block: touching it alone would unpair it
            pair.native.touch([a])
            pair.ours.touch([b])
            pair.held.append([pair.handle(a, b)])
        elif op == "unpin" and pair.held:
            handles = pair.held.pop(arg % len(pair.held))
            a, b = pair.blocks(handles)
            pair.native.unpin_blocks(
                a, lambda blk: pair.reused["native"].append(pair.of_native.get(blk.block_id, -1))
            )
            pair.ours.unpin_blocks(
                b, lambda blk: pair.reused["ours"].append(pair.of_ours.get(blk.block_id, -1))
            )
        elif op == "evict" and pair.handles:
            # Of a block in use (a KV connector's case); an idle cached block
            # is compared in the test below, where the pools differ on purpose.
            h = arg % len(pair.handles)
            a, b = pair.handles[h]
            if pair.of_native.get(a.block_id) == h and a.ref_cnt > 0:
                pair.native.evict_blocks({a.block_id})
                pair.ours.evict_blocks({b.block_id})
        elif op == "reset":
            assert pair.native.reset_prefix_cache() == pair.ours.reset_prefix_cache()
        pair.compare()
    while pair.held:  # everything back: both pools can reset, and kvcached holds no page
        a, b = pair.blocks(pair.held.pop())
        pair.native.free_blocks(reversed(a))
        pair.ours.free_blocks(reversed(b))
    assert pair.native.reset_prefix_cache() and pair.ours.reset_prefix_cache()
    pair.compare()
    assert pair.ours.planner.live_blocks() == 0


def test_touch_of_a_free_block_without_a_hash_is_taken_as_vllm_takes_it() -> None:
    """vLLM's pool takes ``touch`` of a free unhashed block (ref_cnt 0, not
    in the cached queue); kvcached's used to raise ``RuntimeError: remove()
    called on an invalid block``. Now the planner hands that very block out,
    mapping its page, and freeing it gives the page back."""
    ours = _kvcached_pool()
    block = ours.blocks[5 * PER_PAGE + 3]  # a page nobody has mapped yet
    ours.touch([block])
    assert block.ref_cnt == 1 and ours.planner.blocks.is_live(block.block_id)
    assert ours.planner.live_blocks() == 1
    ours.free_blocks([block])
    assert block.ref_cnt == 0 and ours.planner.live_blocks() == 0
    ours.planner.blocks.check()


def test_touch_of_a_free_block_when_no_page_can_be_mapped_says_so() -> None:
    ours = _kvcached_pool(budget_pages=1)  # the null block's page only
    with pytest.raises(KVCachedError, match="touch\\(\\): free block 43"):
        ours.touch([ours.blocks[43]])
    assert ours.blocks[43].ref_cnt == 0 and ours.planner.live_blocks() == 0


def test_evicting_an_idle_cached_block_gives_it_to_the_planner() -> None:
    """``evict_blocks`` of an idle cached block: vLLM drops its hash and leaves
    it where it was in the free queue (behind older cached blocks, which
    vLLM may then evict before reusing it); kvcached gives it to the planner,
    so it is reused before any cached block is evicted."""
    native = BlockPool(NUM_BLOCKS, True, BLOCK)
    ours = _kvcached_pool()
    for pool in (native, ours):
        req = _request("a", [5] * (2 * BLOCK) + [7])
        blocks = (
            pool.get_new_blocks(3)
            if pool is native
            else (ours.reserve(3) or ours.get_new_blocks(3))
        )
        pool.cache_full_blocks(req, blocks, 0, 2, BLOCK, 0)
        pool.free_blocks(reversed(blocks))
        free_before = pool.get_num_free_blocks()
        pool.evict_blocks({blocks[0].block_id})
        assert blocks[0].block_hash is None and blocks[0].ref_cnt == 0
        assert pool.get_cached_block(req.block_hashes[1], [0]) is not None
        if pool is ours:
            assert ours.num_idle_cached == 1 and ours.planner.blocks.ready_size() >= 1
        else:
            assert pool.get_num_free_blocks() == free_before


def test_a_missed_capacity_check_records_how_many_blocks_it_lacked() -> None:
    """The planner keeps the shortfall of the last miss: the bytes the control layer
    calls for from the device's other instances (``KVCACHED_YIELD_IDLE``)."""
    ours = _kvcached_pool(budget_pages=3)
    ours.reserve(PER_PAGE)
    assert ours.planner.misses == 0
    ours.reserve(5 * PER_PAGE)  # three pages hold 3 * PER_PAGE - 1 (the null block)
    assert ours.planner.misses == 1
    assert ours.planner.short_blocks == 5 * PER_PAGE - (3 * PER_PAGE - 1)
