"""BlockManager.free: ids from several pages in any order, and a bad id
anywhere in the list (first, inside a page's run, at a page change, last)
raises and changes nothing, with and without the lock."""

from __future__ import annotations

import pytest

from kvcached.errors import BlockError
from tests.memory.kvmem_helpers import make_cache, small_spec


@pytest.fixture(params=[False, True], ids=["unlocked", "locked"])
def cache(host, request):
    kv, _ = make_cache(host, small_spec(), pages=8, thread_safe=request.param)
    yield kv
    kv.close()


def _snapshot(kv):
    bm = kv.blocks
    return (
        [bm.is_live(b) for b in range(kv.num_blocks)],
        kv.available_size(),
        kv.usage().as_dict(),
        [list(lst) if lst is not None else None for lst in bm._free],
    )


def test_interleaved_pages_free_and_come_back(cache):
    ids = cache.alloc(cache.available_size())
    assert ids is not None and len(ids) == 8 * 4 - 1
    bpp = cache.blocks_per_page
    by_page = sorted(ids, key=lambda b: (b % bpp, b // bpp))  # a0 b0 c0 ... a1 b1 ...
    cache.free(by_page[:12])
    cache.blocks.check()
    assert not any(cache.blocks.is_live(b) for b in by_page[:12])
    cache.free(list(reversed(by_page[12:])))
    cache.blocks.check()
    assert cache.usage().blocks_used == 0
    again = cache.alloc(len(ids))
    assert sorted(again) == sorted(ids)
    cache.blocks.check()


@pytest.mark.parametrize("where", range(7))
@pytest.mark.parametrize(
    "bad",
    ["float", "bool", "negative", "past_end", "null", "freed", "dup_same_page", "dup_other_page"],
)
def test_a_bad_id_anywhere_changes_nothing(cache, where, bad):
    ids = cache.alloc(3 + 4 + 4)  # the rest of page 0, then pages 1 and 2
    assert ids is not None
    spare = cache.alloc(1)
    cache.free(spare)
    bpp = cache.blocks_per_page
    pages = sorted({b // bpp for b in ids})
    assert len(pages) == 3
    # three runs of one page each: [page 0 | page 1 | page 2]
    good = sorted(ids, key=lambda b: b // bpp)
    value = {
        "float": float(good[1]),
        "bool": True,
        "negative": -1,
        "past_end": cache.num_blocks,
        "null": 0,
        "freed": spare[0],
        "dup_same_page": good[min(where, len(good) - 1)] if where else good[0],
        "dup_other_page": good[-1],
    }[bad]
    pos = [0, 1, 3, 4, 7, 8, len(good)][where]  # first, inside, at page changes, last
    if bad.startswith("dup") and pos <= good.index(value):
        pos = good.index(value) + 1  # the second copy must come after the first
    call = good[:pos] + [value] + good[pos:]
    before = _snapshot(cache)
    with pytest.raises(BlockError):
        cache.free(call)
    assert _snapshot(cache) == before
    cache.blocks.check()
    cache.free(good)  # and the good ids still free normally
    cache.blocks.check()
    assert cache.usage().blocks_used == 0


def test_empty_and_tuple_frees(cache):
    before = _snapshot(cache)
    cache.free([])
    assert _snapshot(cache) == before
    ids = cache.alloc(6)
    cache.free(tuple(ids))
    cache.blocks.check()
    assert cache.usage().blocks_used == 0
