"""SGLang's own pools and allocators on CPU tensors: the behaviour kvcached's
elastic classes must reproduce (same indices contract, same accounting, same
``None`` on exhaustion), pinned against the installed SGLang.

Skips without SGLang; fails instead under ``KVCACHED_REQUIRE_ENGINES=sglang``.
The allocator tests also run on CUDA (``-m gpu``, the H200 machine), where the
paged allocator takes SGLang's Triton kernels instead of the torch fallbacks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.engines import require_engine

require_engine("sglang", "sglang.srt.mem_cache.memory_pool")

import torch  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)

from tests.integration.sglang.allocator_model import Driver, Op  # noqa: E402
from tests.integration.sglang.native_paged import paged_reference  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 2, 8, 2

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]


def mha_pool(size: int, page_size: int, device: str = "cpu") -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device=device,
        enable_memory_saver=False,
    )


def token_allocator(
    size: int, need_sort: bool = False, device: str = "cpu"
) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(
        size,
        dtype=torch.float16,
        device=device,
        kvcache=mha_pool(size, 1, device),
        need_sort=need_sort,
    )


def paged_allocator(
    size: int, page_size: int, need_sort: bool = False, device: str = "cpu"
) -> PagedTokenToKVPoolAllocator:
    return paged_reference(
        size,
        page_size=page_size,
        dtype=torch.float16,
        device=device,
        kvcache=mha_pool(size, page_size, device),
        need_sort=need_sort,
    )


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


# -- pools -----------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_mha_pool_buffers_have_one_padding_page(page_size: int) -> None:
    pool = mha_pool(64, page_size)
    assert len(pool.k_buffer) == len(pool.v_buffer) == LAYERS
    for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
        # size + page_size rows: slot 0's page absorbs padded-token writes.
        assert k.shape == v.shape == (64 + page_size, HEADS, HEAD_DIM)
        assert k.dtype == torch.float16 and k.device.type == "cpu"
    assert pool.get_kv_size_bytes() == (LAYERS * (64 + page_size) * HEADS * HEAD_DIM * 2,) * 2


@pytest.mark.parametrize("device", DEVICES)
def test_mha_set_kv_buffer_round_trips_per_layer(device: str) -> None:
    pool = mha_pool(64, 1, device)
    loc = torch.tensor([5, 17, 63], device=device)
    for layer in range(LAYERS):
        k = torch.randn(3, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
        v = torch.randn(3, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
        pool.set_kv_buffer(_Layer(layer), loc, k, v)
        assert torch.equal(pool.get_key_buffer(layer)[loc], k)
        assert torch.equal(pool.get_value_buffer(layer)[loc], v)
    # Other slots untouched (zeros), other layers not aliased.
    assert not pool.get_key_buffer(0)[6].any()
    assert not torch.equal(pool.get_key_buffer(0)[loc], pool.get_key_buffer(1)[loc])


def test_mla_pool_has_one_buffer_per_layer() -> None:
    pool = MLATokenToKVPool(
        64,
        page_size=1,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(65, 1, 24)] * LAYERS


def test_req_to_token_pool_alloc_free() -> None:
    pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    assert pool.available_size() == 4
    if not hasattr(pool, "alloc_rows"):  # 0.5.17: rows are allocated per request
        reqs = [SimpleNamespace(req_pool_idx=None) for _ in range(3)]
        rows = pool.alloc(reqs)
        assert rows is not None and len(set(rows)) == 3
        more = [SimpleNamespace(req_pool_idx=None) for _ in range(2)]
        assert pool.alloc(more) is None  # running out is None, not an exception
        for r in reqs:
            pool.free(r)
        assert pool.available_size() == 4
        return
    rows = pool.alloc_rows(3)
    assert rows is not None and len(set(rows)) == 3
    assert pool.alloc_rows(2) is None  # running out is None, not an exception
    pool.free_rows(rows)
    assert pool.available_size() == 4


# -- token allocator (page size 1) ------------------------------------------------


def test_token_allocator_alloc_free_and_exhaustion() -> None:
    alloc = token_allocator(16)
    assert alloc.available_size() == 16
    a = alloc.alloc(10)
    assert sorted(a.tolist()) == list(range(1, 11))  # slot 0 is the padding slot
    assert alloc.alloc(7) is None
    assert alloc.available_size() == 6
    b = alloc.alloc(6)
    assert alloc.available_size() == 0 and alloc.alloc(1) is None
    alloc.free(a)
    assert alloc.available_size() == 10
    alloc.free(b)
    alloc.clear()
    assert alloc.available_size() == 16


def test_token_allocator_free_group_defers_frees() -> None:
    alloc = token_allocator(16)
    a, b = alloc.alloc(4), alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(a)
    alloc.free(b)
    assert alloc.available_size() == 8  # nothing returned inside the group
    alloc.free_group_end()
    assert alloc.available_size() == 16


def test_token_allocator_need_sort_stages_frees() -> None:
    alloc = token_allocator(8, need_sort=True)
    a = alloc.alloc(8)
    alloc.free(a[:4])
    # Staged in release_pages, still counted as available, merged on demand.
    assert alloc.available_size() == 4 and len(alloc.release_pages) == 4
    again = alloc.alloc(4)
    assert sorted(again.tolist()) == sorted(a[:4].tolist())


# -- paged allocator -------------------------------------------------------------


def test_paged_alloc_hands_out_whole_pages() -> None:
    alloc = paged_allocator(32, 4)
    assert alloc.available_size() == 32
    out = alloc.alloc(8)
    pages = sorted({t // 4 for t in out.tolist()})
    assert len(pages) == 2 and 0 not in pages  # page 0 is the padding page
    assert alloc.available_size() == 24


def test_paged_alloc_extend_and_decode_stay_page_aligned() -> None:
    alloc = paged_allocator(32, 4)
    prefix = torch.tensor([0, 0])
    seq = torch.tensor([5, 3])
    last = torch.tensor([-1, -1])
    out = alloc.alloc_extend(prefix, prefix.clone(), seq, seq.clone(), last, 8)
    assert out is not None and out.numel() == 8
    r0, r1 = out[:5].tolist(), out[5:].tolist()
    assert [t % 4 for t in r0] == [0, 1, 2, 3, 0] and [t % 4 for t in r1] == [0, 1, 2]
    assert alloc.available_size() == 32 - 3 * 4
    # Decode: r0 (len 5 -> 6) stays in its page, r1 (len 3 -> 4) too.
    dec = alloc.alloc_decode(
        torch.tensor([6, 4]), torch.tensor([6, 4]), torch.tensor([r0[-1], r1[-1]])
    )
    assert dec.tolist() == [r0[-1] + 1, r1[-1] + 1]
    assert alloc.available_size() == 32 - 3 * 4


def test_paged_exhaustion_is_none() -> None:
    alloc = paged_allocator(8, 4)
    prefix = torch.tensor([0])
    seq = torch.tensor([9])
    assert (
        alloc.alloc_extend(prefix, prefix.clone(), seq, seq.clone(), torch.tensor([-1]), 9) is None
    )
    assert alloc.available_size() == 8  # a miss takes nothing
    full = alloc.alloc(8)
    assert full is not None
    assert (
        alloc.alloc_decode(torch.tensor([5]), torch.tensor([5]), torch.tensor([full[3].item()]))
        is None
    )


# -- randomized reference sequences ------------------------------------------------

ops = st.lists(
    st.builds(
        Op,
        kind=st.sampled_from(
            ["new", "new", "extend", "decode", "decode", "finish", "group_free", "clear"]
        ),
        a=st.integers(0, 40),
        b=st.integers(0, 3),
    ),
    max_size=40,
)
_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("device", DEVICES)
@_settings
@given(ops=ops, need_sort=st.booleans())
def test_token_allocator_matches_model(device: str, ops: list[Op], need_sort: bool) -> None:
    Driver(token_allocator(48, need_sort=need_sort, device=device)).run(ops)


@pytest.mark.parametrize("device", DEVICES)
@_settings
@given(ops=ops, page_size=st.sampled_from([2, 4, 16]), need_sort=st.booleans())
# Found by hypothesis: the last page ends at size + page_size - 1, past `size`.
@example(ops=[Op("new", 16), Op("new", 17)], page_size=16, need_sort=False)
def test_paged_allocator_matches_model(
    device: str, ops: list[Op], page_size: int, need_sort: bool
) -> None:
    Driver(paged_allocator(64, page_size, need_sort=need_sort, device=device)).run(ops)


def test_driver_detects_a_wrong_available_size() -> None:
    """The model is not vacuous: an allocator that misreports fails it."""

    class Lying(TokenToKVPoolAllocator):
        def available_size(self) -> int:
            return super().available_size() + 1

    alloc = Lying(16, dtype=torch.float16, device="cpu", kvcache=mha_pool(16, 1), need_sort=False)
    with pytest.raises(AssertionError, match="available_size"):
        Driver(alloc).run([Op("new", 3)])
