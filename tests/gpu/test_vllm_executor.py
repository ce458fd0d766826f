"""The vLLM worker's side of kvcached on a real GPU, without vLLM.

vLLM cannot be installed on the GPU machine, so this test builds what its
``allocate_kv_cache`` replacement builds: one virtual buffer of the size vLLM
asks for (a :class:`PageExecutor` over :class:`PageLanes` planned by the
integration's own geometry), viewed exactly as ``create_kv_cache_views`` views
it (a 5-D ``[L, B, H, N, C]`` byte array with vLLM's strides, one layer
selected, then ``.view(dtype)``), for a layer-outermost (LBHNC, vLLM's
default) and a block-outermost (BLHNC) layout. Pages are mapped by page ops,
as the engine core sends them; K/V are written through the views by CUDA
kernels, gathered back through block tables, and read by torch's SDPA
(flash / memory-efficient kernels on the H200): the same result as over the
dense K/V. Pages then go away and come back with the other requests intact.

Run on the GPU machine:

    python3 -m pytest -q -m gpu tests/gpu/test_vllm_executor.py
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvcached.integrations.vllm.executor import PageExecutor
from kvcached.integrations.vllm.geometry import TensorShape, lanes_of
from kvcached.memory.planned import MAP, UNMAP
from tests.gpu.cuda_marks import requires_cuda_driver

pytestmark = [pytest.mark.gpu, requires_cuda_driver]

MIB = 1 << 20
LAYERS, KV_HEADS, Q_HEADS, TOKENS, HEAD_DIM = 4, 8, 32, 16, 128
DTYPE = torch.bfloat16
CELL = 2 * HEAD_DIM * 2  # K and V side by side, bf16: vLLM's C axis in bytes
PAGE = KV_HEADS * TOKENS * CELL  # one layer's bytes of one block (64 KiB)
NUM_BLOCKS = 2048


def shape_of(layout: str) -> TensorShape:
    """vLLM's strides for one KVCacheTensor of every layer (compute_layout_strides)."""
    inner = (TOKENS * CELL, CELL, 1)  # H, N, C
    if layout == "LBHNC":
        return TensorShape(
            0, (LAYERS, NUM_BLOCKS, KV_HEADS, TOKENS, CELL), (NUM_BLOCKS * PAGE, PAGE, *inner), PAGE
        )
    if layout == "BLHNC":
        return TensorShape(
            0, (LAYERS, NUM_BLOCKS, KV_HEADS, TOKENS, CELL), (PAGE, LAYERS * PAGE, *inner), PAGE
        )
    raise ValueError(layout)


def vllm_views(buf: torch.Tensor, t: TensorShape) -> list[torch.Tensor]:
    """What create_kv_cache_views returns: per layer, ``[B, H, N, C]`` of DTYPE."""
    view5 = torch.as_strided(
        buf, size=t.shape, stride=t.strides, storage_offset=buf.storage_offset() + t.offset
    )
    return [view5[layer].view(DTYPE) for layer in range(t.shape[0])]


@pytest.fixture(scope="module")
def cuda():
    from kvcached.driver import make_driver

    return make_driver("cuda", torch.cuda.current_device())


class Request:
    """A sequence whose blocks lie, shuffled, on pages of its own."""

    def __init__(self, rng: random.Random, length: int, pages: list[int], bpp: int) -> None:
        self.length = length
        n = -(-length // TOKENS)
        self.pages = pages[: -(-n // bpp)]
        del pages[: len(self.pages)]
        blocks = [b for p in self.pages for b in range(p * bpp, (p + 1) * bpp)]
        rng.shuffle(blocks)
        self.table = blocks[:n]
        self.k = [
            torch.randn(length, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        self.v = [
            torch.randn(length, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        self.q = torch.randn(1, Q_HEADS, 8, HEAD_DIM, device="cuda", dtype=DTYPE)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.length, device="cuda")
        table = torch.tensor(self.table, device="cuda")
        return table[pos // TOKENS], pos % TOKENS

    def write(self, views: list[torch.Tensor]) -> None:
        blocks, offsets = self.slots()
        for layer, view in enumerate(views):
            view[blocks, :, offsets] = torch.cat([self.k[layer], self.v[layer]], dim=-1)

    def gather(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``(1, KV_HEADS, length, HEAD_DIM)``, read through the block table."""
        table = torch.tensor(self.table, device="cuda")
        kv = view[table].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, 2 * HEAD_DIM)
        kv = kv[:, : self.length]
        return kv[None, ..., :HEAD_DIM], kv[None, ..., HEAD_DIM:]

    def check(self, views: list[torch.Tensor]) -> None:
        for layer, view in enumerate(views):
            k, v = self.gather(view)
            dense_k = self.k[layer].transpose(0, 1)[None]
            dense_v = self.v[layer].transpose(0, 1)[None]
            assert torch.equal(k, dense_k) and torch.equal(v, dense_v), layer
            got = F.scaled_dot_product_attention(
                self.q, k.contiguous(), v.contiguous(), enable_gqa=True
            )
            want = F.scaled_dot_product_attention(self.q, dense_k, dense_v, enable_gqa=True)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_vllm_views_over_pages_mapped_by_ops(cuda, layout) -> None:
    t = shape_of(layout)
    size = LAYERS * NUM_BLOCKS * PAGE
    lanes = lanes_of([t], size, NUM_BLOCKS, 2 * MIB)
    executor = PageExecutor(cuda, lanes, calibrate=False)
    try:
        buf = executor.buffer()
        assert buf.is_cuda and buf.numel() == size and buf.data_ptr() == executor.tensors.va
        views = vllm_views(buf, t)
        assert views[0].shape == (NUM_BLOCKS, KV_HEADS, TOKENS, 2 * HEAD_DIM)
        rng = random.Random(3)
        bpp = lanes.blocks_per_page
        free_pages = list(range(1, lanes.num_pages))  # page 0 holds the null block
        rng.shuffle(free_pages)
        requests = [Request(rng, n, free_pages, bpp) for n in (300, 777, 1500, 40)]
        pages = sorted(p for r in requests for p in r.pages)
        before = cuda.mem_info()[0]
        assert executor.apply([(MAP, p, 1) for p in pages])  # as the engine core sends them
        used = before - cuda.mem_info()[0]
        # Other processes on the GPU move free memory too: only a loose check.
        assert used >= len(pages) * lanes.page_bytes // 2, (used, len(pages))
        for r in requests:
            r.write(views)
        torch.cuda.synchronize()
        for r in requests:
            r.check(views)
        # The second request ends: its pages are unmapped; the others keep theirs.
        gone = sorted(requests[1].pages)
        assert gone and executor.apply([(UNMAP, p, 1) for p in gone])
        assert executor.mapped_pages == 1 + len(pages) - len(gone)
        for r in requests[:1] + requests[2:]:
            r.check(views)
        # A new request on those pages again.
        assert executor.apply([(MAP, p, 1) for p in gone])
        fresh = Request(rng, min(500, len(gone) * bpp * TOKENS), list(gone), bpp)
        fresh.write(views)
        torch.cuda.synchronize()
        for r in [fresh, *requests[:1], *requests[2:]]:
            r.check(views)
    finally:
        executor.close()
    assert executor.mapped_pages == 0


def _lanes_lbhnc():
    return lanes_of([shape_of("LBHNC")], LAYERS * NUM_BLOCKS * PAGE, NUM_BLOCKS, 2 * MIB)


def _three_requests_written(executor: PageExecutor, seed: int) -> tuple:
    """Three requests' pages mapped and written through vLLM's views: the views,
    the rng, blocks per page, the pages still free, the requests, their pages."""
    lanes = executor.lanes
    views = vllm_views(executor.buffer(), shape_of("LBHNC"))
    rng = random.Random(seed)
    bpp = lanes.blocks_per_page
    free_pages = list(range(1, lanes.num_pages))
    rng.shuffle(free_pages)
    requests = [Request(rng, n, free_pages, bpp) for n in (600, 900, 300)]
    held = sorted(p for r in requests for p in r.pages)
    assert executor.apply([(MAP, p, 1) for p in held])
    for r in requests:
        r.write(views)
    torch.cuda.synchronize()
    return views, rng, bpp, free_pages, requests, held


def _live_intact_then_fresh(views: object, live: list[Request], fresh: Request) -> None:
    """The live requests read back intact; a new one written on the freshly
    mapped pages reads back too, and the live ones still do."""
    for r in live:
        r.check(views)
    fresh.write(views)
    torch.cuda.synchronize()
    for r in [fresh, *live]:
        r.check(views)


def test_ops_overlapped_with_kernels_keep_live_pages(cuda) -> None:
    """Page ops beside the step on the real driver: while the step's
    thread launches kernels that write live pages, the executor's own thread
    (a thread with no CUDA context of its own) maps a refill and unmaps a
    finished request's pages, device sync included. The live requests read
    back intact, the refilled pages take a new request, and the counts agree."""
    executor = PageExecutor(cuda, _lanes_lbhnc(), calibrate=False)
    try:
        views, rng, bpp, free_pages, requests, held = _three_requests_written(executor, 5)
        refill = sorted(free_pages[:16])
        gone = sorted(requests[1].pages)
        live = [requests[0], requests[2]]
        executor.overlap([(MAP, p, 1) for p in refill] + [(UNMAP, p, 1) for p in gone])
        assert executor.overlapping and executor.overlapped_maps
        for _ in range(20):  # the step: kernels over live pages, beside the ops
            for r in live:
                r.write(views)
        assert executor.finish() is True
        assert not executor.overlapping
        torch.cuda.synchronize()
        assert executor.mapped_pages == 1 + len(held) - len(gone) + len(refill)
        assert executor.maps == len(held) + len(refill) and executor.unmaps == len(gone)
        _live_intact_then_fresh(
            views, live, Request(rng, len(refill) * bpp * TOKENS, list(refill), bpp)
        )
    finally:
        executor.close()
    assert executor.mapped_pages == 0


def test_ops_beside_several_steps_queue_in_order(cuda) -> None:
    """Ops beside one step may still run beside the next ones (the planner's
    ``kvcached_wait``): three steps' batches queue in the executor's thread
    while the step's thread keeps writing live pages without waiting; the last
    batch unmaps half of the first one's refill, so queue order decides what
    is mapped. Live requests read back intact and the counts agree."""
    executor = PageExecutor(cuda, _lanes_lbhnc(), calibrate=False)
    try:
        views, rng, bpp, free_pages, requests, held = _three_requests_written(executor, 7)
        first, second = sorted(free_pages[:8]), sorted(free_pages[8:16])
        gone = sorted(requests[1].pages)
        live = [requests[0], requests[2]]
        batches = [
            [(MAP, p, 1) for p in first],
            [(UNMAP, p, 1) for p in gone],
            [(MAP, p, 1) for p in second] + [(UNMAP, p, 1) for p in first[:4]],
        ]
        for ops in batches:  # one batch a step, no step waits
            executor.overlap(ops)
            for _ in range(5):
                for r in live:
                    r.write(views)
        assert executor.overlapping
        assert executor.finish() is True and not executor.overlapping
        torch.cuda.synchronize()
        mapped = 1 + len(held) - len(gone) + len(first) + len(second) - 4
        assert executor.mapped_pages == mapped
        _live_intact_then_fresh(views, live, Request(rng, 4 * bpp * TOKENS, first[4:], bpp))
    finally:
        executor.close()
    assert executor.mapped_pages == 0
