"""GPU tests of the memory core on the ``cuda`` backend (the H200 machine).

* data integrity: the same random alloc/free/trim/limit sequence as the CPU
  test, with patterns written and read by CUDA kernels through the views;
* attention: ``scaled_dot_product_attention`` over K/V gathered from kvcached
  blocks equals the same call over a dense copy, for both layouts and the
  FlashAttention / FlashInfer views.

Run: ``python -m pytest tests/memory/test_gpu.py -m gpu -v``
"""

from __future__ import annotations

import pytest
import torch

from kvcached.memory import DriverFreeBudget, KVCache, KVCacheSpec, KVLayout
from kvcached.units import KIB, MIB
from tests.gpu.cuda_marks import requires_torch_gpu
from tests.memory.kvmem_helpers import ExactBudget, check_pattern, run_integrity, write_pattern

pytestmark = [pytest.mark.gpu, requires_torch_gpu]

LAYOUTS = [KVLayout.PER_LAYER, KVLayout.CONTIGUOUS]


@pytest.fixture(scope="module")
def cuda():
    from kvcached.driver import make_driver

    driver = make_driver("cuda", torch.cuda.current_device())
    yield driver


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "page-handles"])
def test_integrity_on_gpu(cuda, layout, coalesce):
    spec = KVCacheSpec.of_bytes(num_layers=4, block_bytes=64 * KIB, kv_buffers=2)
    budget = ExactBudget(64 * 16 * MIB)
    with KVCache(
        spec,
        driver=cuda,
        budget=budget,
        layout=layout,
        num_blocks=64 * 32,
        page_size=2 * MIB,
        background=True,
        min_reserved=2,
        max_reserved=4,
        max_handle_bytes=64 * MIB if coalesce else 0,
    ) as kv:
        assert kv.tensors.raw_buffer(0).is_cuda
        peak = run_integrity(kv, steps=300, seed=7, max_alloc=80)
        assert peak > kv.blocks_per_page
    assert budget.used == 0


@pytest.mark.parametrize("layers", [1, 3], ids=["one-handle", "per-layer-6"])
def test_runs_of_pages_keep_their_data_on_gpu(cuda, layers):
    """A take of 32 pages is one run (one cuMemSetAccess per range over 32
    mappings made one by one); giving back 16 of them in the middle unmaps
    them with one cuMemUnmap per range; CUDA kernels read every kept block
    intact, and the pages grow back as a run."""
    spec = KVCacheSpec.of_bytes(num_layers=layers, block_bytes=64 * KIB, kv_buffers=2)
    budget = ExactBudget(64 * 2 * layers * 2 * MIB)
    with KVCache(
        spec,
        driver=cuda,
        budget=budget,
        layout=KVLayout.PER_LAYER,
        num_blocks=64 * 32,
        page_size=2 * MIB,
        background=False,
        min_reserved=0,
        max_reserved=0,
        max_handle_bytes=0,
    ) as kv:
        bpp = kv.blocks_per_page
        ids = kv.alloc(32 * bpp - 1)  # pages 0-31 full (page 0 holds the null block)
        assert ids is not None
        write_pattern(kv, ids, full=True)
        torch.cuda.synchronize()
        check_pattern(kv, ids, full=True)
        pages = sorted({kv.page_of(b) for b in ids})
        middle = [b for b in ids if kv.page_of(b) in pages[8:24]]
        kept = [b for b in ids if kv.page_of(b) not in pages[8:24]]
        kv.free(middle)
        assert kv.usage().pages_used == 16
        check_pattern(kv, kept, full=True)
        again = kv.alloc(16 * bpp)
        assert again is not None and sorted({kv.page_of(b) for b in again}) == pages[8:24]
        write_pattern(kv, again, full=True)
        torch.cuda.synchronize()
        check_pattern(kv, kept + again, full=True)
        kv.free(kept + again)
    assert budget.used == 0


def test_driver_free_budget_on_gpu(cuda):
    free, total = cuda.mem_info()
    budget = DriverFreeBudget(cuda)
    assert 0 < budget.headroom() <= free
    spec = KVCacheSpec(num_layers=2, block_size=16, num_heads=8, head_dim=128, dtype=torch.bfloat16)
    with KVCache(
        spec,
        driver=cuda,
        budget=budget,
        num_blocks=4096,
        background=False,
        min_reserved=0,
        max_reserved=0,
    ) as kv:
        ids = kv.alloc(2000)
        assert ids is not None
        write_pattern(kv, ids)
        torch.cuda.synchronize()
        check_pattern(kv, ids)
        used = kv.usage().bytes_mapped
        assert used >= 2000 * spec.block_bytes
        kv.free(ids)
        kv.trim()
        assert kv.usage().pages_reserved == 0
    budget.close()


def _write_dense(
    kv: KVCache, table: torch.Tensor, lens: list[int], k: torch.Tensor, v: torch.Tensor, layer: int
) -> None:
    """Scatter dense K/V ``(B, H, T, D)`` into the cache through the FA view."""
    fa = kv.tensors.flash_attn_view(layer)
    bs = kv.spec.block_size
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=table.device)
        blocks = table[b, pos // bs]
        slots = pos % bs
        fa[0, blocks, slots] = k[b, :, :n].transpose(0, 1)
        fa[1, blocks, slots] = v[b, :, :n].transpose(0, 1)


def _gather(view: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
    """``(num_blocks, bs, H, D)`` view + block row -> ``(1, H, n, D)``."""
    x = view[row]  # (nblk, bs, H, D)
    # contiguous, like the dense side, so SDPA picks the same kernel for both
    return x.reshape(-1, *x.shape[2:])[:n].transpose(0, 1).unsqueeze(0).contiguous()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_sdpa_over_kvcached_blocks_equals_dense(cuda, layout):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers, hkv, hq, d, bs = 3, 4, 16, 128, 16
    spec = KVCacheSpec(
        num_layers=layers, block_size=bs, num_heads=hkv, head_dim=d, dtype=torch.bfloat16
    )
    lens = [100, 37, 513, 16, 1024]
    with KVCache(
        spec,
        driver=cuda,
        layout=layout,
        num_blocks=2048,
        background=False,
        min_reserved=0,
        max_reserved=0,
    ) as kv:
        nblk = [-(-n // bs) for n in lens]
        ids = kv.alloc(sum(nblk))
        assert ids is not None
        perm = torch.randperm(len(ids)).tolist()  # scattered, as after churn
        ids = [ids[i] for i in perm]
        table = torch.zeros(len(lens), max(nblk), dtype=torch.long)
        at = 0
        for b, m in enumerate(nblk):
            table[b, :m] = torch.tensor(ids[at : at + m])
            at += m
        table = table.to(dev)
        T = max(lens)
        for layer in range(layers):
            k = torch.randn(len(lens), hkv, T, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(len(lens), hq, 1, d, device=dev, dtype=torch.bfloat16)
            _write_dense(kv, table, lens, k, v, layer)
            key, value = kv.tensors.key_view(layer), kv.tensors.value_view(layer)
            fi = kv.tensors.flashinfer_view(layer)
            for b, n in enumerate(lens):
                row = table[b, : nblk[b]]
                kg, vg = _gather(key, row, n), _gather(value, row, n)
                assert torch.equal(kg[0], k[b, :, :n])
                assert torch.equal(_gather(fi[:, 1], row, n)[0], v[b, :, :n])
                paged = torch.nn.functional.scaled_dot_product_attention(
                    q[b : b + 1], kg, vg, enable_gqa=True
                )
                dense = torch.nn.functional.scaled_dot_product_attention(
                    q[b : b + 1],
                    k[b : b + 1, :, :n].contiguous(),
                    v[b : b + 1, :, :n].contiguous(),
                    enable_gqa=True,
                )
                torch.testing.assert_close(paged, dense, rtol=0, atol=0)
        kv.free(ids)
