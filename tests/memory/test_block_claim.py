"""BlockManager.claim / PageAllocator.take_page: a free block handed out by id
(vLLM's ``touch`` of a free block), from a held page, an idle page or an
unmapped one; refused, changing nothing, when its page cannot be had."""

from __future__ import annotations

import pytest

from kvcached.errors import BlockError, ConfigError
from tests.memory.kvmem_helpers import check_pattern, make_cache, small_spec, write_pattern


def _check(kv) -> None:
    kv.blocks.check()
    pages = kv.blocks._pages
    assert pages.counts() == pages.recount()


@pytest.mark.parametrize("where", ["held", "idle", "unmapped"])
def test_claim_hands_out_that_block(host, where) -> None:
    kv, _ = make_cache(host, small_spec(), pages=8, max_reserved=4)
    try:
        bm, bpp = kv.blocks, kv.blocks_per_page
        other: list[int] = []
        if where == "held":
            other = kv.alloc(1)  # page 0 holds the null block and this one
            target = next(b for b in range(1, bpp) if b not in other)
        elif where == "idle":
            assert kv.blocks._pages.map_idle(2) == 2  # pages 1 and 2 mapped, idle
            target = 2 * bpp + 1
        else:
            target = 6 * bpp + 2
        assert bm.claim(target) and bm.is_live(target)
        _check(kv)
        write_pattern(kv, [target])  # its page is mapped and writable
        check_pattern(kv, [target])
        rest = kv.alloc(kv.available_size())
        assert rest is not None and target not in rest, "a claimed block is never handed out"
        kv.free(rest + other + [target])
        _check(kv)
        assert kv.usage().blocks_used == 0
    finally:
        kv.close()


def test_claim_refuses_what_it_cannot_have(host) -> None:
    kv, _ = make_cache(host, small_spec(), pages=8, budget_pages=1)
    try:
        bm, bpp = kv.blocks, kv.blocks_per_page
        assert not bm.claim(5 * bpp), "no budget for its page: refused"
        assert not bm.is_live(5 * bpp)
        _check(kv)
        with pytest.raises(BlockError, match="not free"):
            bm.claim(0)  # the null block
        live = kv.alloc(1)
        with pytest.raises(BlockError, match="not free"):
            bm.claim(live[0])
        with pytest.raises(ConfigError, match="block"):
            bm.claim(kv.num_blocks)
        with pytest.raises(ConfigError, match="page"):
            bm._pages.take_page(-1)
        _check(kv)
    finally:
        kv.close()
