"""GPU: the SGLang integration's data path on the cuda backend.

Two parts, one command (``pytest -m gpu tests/gpu/test_sglang_elastic_gpu.py``):

* the kvcached side alone (needs no SGLang): an :class:`ElasticKV` on the
  CUDA driver with a ledger, the slot allocator mapping pages on demand, K/V
  written and read through SGLang-shaped views by CUDA kernels across several
  kvcached pages, attention (torch SDPA) over gathered slots equal to the same
  attention over a plain tensor, and ``clear`` giving the pages back;
* with SGLang importable (its wheel on ``PYTHONPATH``; skipped otherwise):
  SGLang's real pool and allocator classes made elastic, SGLang's Triton
  allocator kernels laying out ``alloc_extend`` / ``alloc_decode`` over pages
  kvcached handed out, and ``set_kv_buffer`` / ``get_key_buffer`` round trips.

Never in CI.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace as NS

import pytest

from tests.gpu.cuda_marks import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

# 2048 bytes per token and buffer (8 heads x 128 dims, fp16): 1024 tokens per 2 MiB page.
HEADS, HEAD_DIM, LAYERS = 8, 128, 4


@pytest.fixture
def env(tmp_path, monkeypatch):
    from kvcached import config

    monkeypatch.setenv("KVCACHED_DRIVER", "cuda")
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_IPC_NAME", "sglang-gpu")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    config.reload_config()
    yield
    config.reload_config()


def _kv(page_size: int, size: int):
    import torch

    from kvcached.integrations.sglang.elastic_kv import KVShape, build_elastic_kv
    from kvcached.integrations.sglang.slots import SlotAllocator

    kv = build_elastic_kv(
        KVShape(
            layers=LAYERS,
            block_tokens=page_size,
            size=size,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.float16,
        ),
        device="cuda:0",
        name="kv-gpu",
    )
    assert kv is not None, "the cuda driver must serve cuda:0"
    return kv, SlotAllocator(kv, size // page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_written_by_cuda_kernels_reads_back_across_pages(env, page_size):
    import torch

    kv, slots = _kv(page_size, 64 * 1024)
    try:
        k_buf, v_buf = kv.mha_buffers()
        assert k_buf[0].device.type == "cuda" and k_buf[0].shape == (kv.rows, HEADS, HEAD_DIM)
        n_pages = 5000 // page_size
        pages = slots.alloc_blocks(n_pages)  # about five kvcached pages, mapped now
        assert pages is not None and kv.cache.usage().pages_used >= 5
        page_t = torch.tensor(pages, device="cuda")
        loc = (page_t[:, None] * page_size + torch.arange(page_size, device="cuda")).reshape(-1)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for layer in range(LAYERS):
            k = torch.randn(
                len(loc), HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen
            )
            v = torch.randn(
                len(loc), HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen
            )
            k_buf[layer][loc] = k  # index_put: a CUDA kernel writing into mapped pages
            v_buf[layer][loc] = v
            torch.cuda.synchronize()
            assert torch.equal(k_buf[layer][loc], k) and torch.equal(v_buf[layer][loc], v)
            # Attention over the gathered slots equals attention over plain tensors.
            q = torch.randn(
                1, HEADS, 4, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen
            )
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            )
            got = torch.nn.functional.scaled_dot_product_attention(
                q, k_buf[layer][loc].transpose(0, 1)[None], v_buf[layer][loc].transpose(0, 1)[None]
            )
            assert torch.equal(got, ref)
        slots.free_blocks(pages)
        mapped = kv.cache.usage().pages_mapped
        released = slots.clear()  # returns the pages it unmapped
        torch.cuda.synchronize()
        assert kv.cache.usage().pages_mapped == 1  # only the padding page
        assert released == mapped - 1, (released, mapped)
    finally:
        kv.close()


def test_held_at_zero_the_padding_page_is_unmapped_and_comes_back(env):
    """The padding page (block 0's) parked under a limit below one page: the
    CUDA driver's mappings drop to none; lifted, it is mapped again, padded
    writes to block 0 and a request's K/V land, and nothing else moved."""
    import torch

    kv, slots = _kv(16, 64 * 1024)
    try:
        k_buf, _ = kv.mha_buffers()
        kv.cache.set_limit(1)
        kv.cache.trim()
        assert slots.park_padding() and kv.cache.usage().bytes_mapped == 0
        assert slots.alloc_blocks(1) is None  # nothing is granted while it is parked
        kv.cache.set_limit(None)
        assert slots.unpark_padding() and not slots.blocks.null_parked
        k_buf[0][:16].fill_(1.0)  # SGLang's padded tokens write block 0
        (page,) = slots.alloc_blocks(1)
        assert page != 0
        rows = torch.arange(page * 16, page * 16 + 16, device="cuda")
        k_buf[0][rows] = 2.0
        torch.cuda.synchronize()
        assert float(k_buf[0][:16].float().mean()) == 1.0
        assert float(k_buf[0][rows].float().mean()) == 2.0
        slots.free_blocks([page])
    finally:
        kv.close()


def test_ledger_bounds_what_the_allocator_reports(env):
    kv, slots = _kv(16, 64 * 1024)
    try:
        room = slots.available_tokens()
        assert 0 < room <= 64 * 1024
        from kvcached.config import get_config
        from kvcached.ledger import open_pool_budget

        other = open_pool_budget(kv.driver, "other-engine", calibrate=False, config=get_config())
        grab = kv.budget.headroom() // (64 << 20) * (64 << 20)
        assert grab > 0 and other.grant(grab)
        kv.budget.headroom()  # refreshed by our next grant; the ledger decides anyway
        assert slots.alloc_blocks(slots.capacity) is None  # a miss, not a CUDA OOM
        other.refund(grab)
        other.close()
    finally:
        kv.close()


sglang_missing = importlib.util.find_spec("sglang") is None


@pytest.mark.skipif(
    sglang_missing,
    reason="SGLang is not installed here; on a GPU machine without a registry, install the wheels that tests/integration/sglang/gpu_wheelhouse.sh collects (benchmarks/results/h200/README.md, run 3)",
)
def test_sglang_classes_on_cuda_with_triton_kernels(env):
    import torch

    from kvcached.integrations.sglang import pools

    pool = pools.ElasticMHATokenToKVPool(
        size=8192,
        page_size=16,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=2,
        device="cuda",
        enable_memory_saver=False,
    )
    try:
        assert pool.kvcached is not None
        alloc = pools.paged_allocator(
            8192, page_size=16, dtype=torch.float16, device="cuda", kvcache=pool, need_sort=False
        )
        assert type(alloc) is pools.ElasticPagedTokenToKVPoolAllocator
        prefix = torch.tensor([0, 0, 0], device="cuda")
        seq = torch.tensor([17, 3, 40], device="cuda")
        last = torch.tensor([-1, -1, -1], device="cuda")
        out = alloc.alloc_extend(prefix, prefix.cpu(), seq, seq.cpu(), last, 60)
        assert out is not None and out.numel() == 60
        rows = out.tolist()
        assert len(set(rows)) == 60
        assert [r % 16 for r in rows[:17]] == [*range(16), 0]  # page-aligned per request
        k = torch.randn(60, HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
        v = torch.randn(60, HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
        pool.set_kv_buffer(NS(layer_id=1), out, k, v)
        torch.cuda.synchronize()
        assert torch.equal(pool.get_key_buffer(1)[out], k)
        assert torch.equal(pool.get_value_buffer(1)[out], v)
        ends = torch.tensor([rows[16], rows[19], rows[59]], device="cuda")
        dec = alloc.alloc_decode(
            torch.tensor([18, 4, 41], device="cuda"), torch.tensor([18, 4, 41]), ends
        )
        assert dec.tolist() == [rows[16] + 1, rows[19] + 1, rows[59] + 1]
        alloc.free(torch.cat([out, dec]))
        assert alloc.available_size() == 8192
        alloc.clear()
        assert pool.kvcached.cache.usage().pages_mapped == 1
    finally:
        pool.kvcached.close()
