"""Page geometry and the attention views of the virtual KV tensors."""

from __future__ import annotations

import pytest
import torch

from kvcached.errors import ConfigError, MappingError
from kvcached.memory import (
    KVCache,
    KVCacheSpec,
    KVLayout,
    VirtualKVTensors,
    plan_pages,
    resolve_layout,
)
from kvcached.units import MIB
from tests.memory.kvmem_helpers import ExactBudget

G = 2 * MIB
LAYOUTS = [KVLayout.PER_LAYER, KVLayout.CONTIGUOUS]


def _plan(spec, **kw):
    kw.setdefault("layout", KVLayout.PER_LAYER)
    kw.setdefault("num_blocks", 1)
    return plan_pages(spec, granularity=G, page_size=kw.pop("page_size", G), **kw)


def test_blocks_tile_the_page_when_they_can():
    spec = KVCacheSpec(num_layers=4, block_size=16, num_heads=2, head_dim=64, dtype=torch.float16)
    g = _plan(spec)
    assert spec.buffer_block_bytes == (4096, 4096)
    assert g.blocks_per_page == 512 and g.page_strides == (G, G)
    assert g.page_bytes == 4 * 2 * G
    assert g.handles_per_page == 8
    assert g.page_of(511) == 0 and g.page_of(512) == 1
    assert list(g.blocks_of(2))[:2] == [1024, 1025]


def test_page_grows_to_the_smallest_tiling_span():
    # head_dim 80: 5120-byte blocks tile no 2 MiB page; 2048 blocks tile 10 MiB.
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=2, head_dim=80, dtype=torch.float16)
    g = _plan(spec)
    assert g.blocks_per_page == 2048
    assert g.page_strides == (10 * MIB, 10 * MIB)
    assert all(s % G == 0 for s in g.page_strides)


def test_k_and_v_of_different_head_dims_share_block_ids():
    spec = KVCacheSpec(
        num_layers=2, block_size=16, num_heads=8, head_dim=192, dtype=torch.bfloat16, v_head_dim=128
    )
    g = _plan(spec)
    assert spec.buffer_block_bytes == (49152, 32768)
    assert all(s % G == 0 for s in g.page_strides)
    assert g.page_strides[0] * 2 == g.page_strides[1] * 3


def test_larger_page_size_holds_more_blocks():
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=2, head_dim=64, dtype=torch.float16)
    assert _plan(spec, page_size=8 * MIB).blocks_per_page == 2048


def test_capacity_in_bytes_or_blocks():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_heads=2, head_dim=64, dtype=torch.float16)
    g = _plan(spec, num_blocks=None, capacity_bytes=100 * MIB)
    assert g.num_pages == 100 * MIB // g.page_bytes
    g = _plan(spec, num_blocks=1000)
    assert g.num_blocks >= 1000 and g.num_pages == 2


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(num_blocks=10, capacity_bytes=10), "num_blocks/capacity_bytes"),
        (dict(num_blocks=None, capacity_bytes=MIB), "capacity_bytes"),
        (dict(page_size=3 * MIB), "page_size"),
    ],
)
def test_plan_rejects_bad_input_by_name(kw, name):
    spec = KVCacheSpec(num_layers=2, block_size=16, num_heads=2, head_dim=64, dtype=torch.float16)
    with pytest.raises(ConfigError) as err:
        _plan(spec, **kw)
    assert err.value.variable == name


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(kv_buffers=3), "kv_buffers"),
        (dict(v_head_dim=64, kv_buffers=1), "v_head_dim"),
        (dict(dtype="fp16"), "dtype"),
        (dict(block_size=True), "block_size"),
    ],
)
def test_spec_rejects_bad_input_by_name(kw, name):
    args = dict(num_layers=2, block_size=16, num_heads=2, head_dim=64, dtype=torch.float16)
    args.update(kw)
    with pytest.raises(ConfigError) as err:
        KVCacheSpec(**args)
    assert err.value.variable == name


def test_auto_layout_is_per_layer_until_measured():
    assert resolve_layout(None) is KVLayout.PER_LAYER
    assert resolve_layout(True) is KVLayout.CONTIGUOUS
    assert resolve_layout(False) is KVLayout.PER_LAYER


@pytest.fixture(params=LAYOUTS, ids=lambda x: x.value)
def cache(request, host):
    spec = KVCacheSpec(num_layers=3, block_size=4, num_heads=2, head_dim=8, dtype=torch.float32)
    kv = KVCache(
        spec,
        driver=host,
        budget=ExactBudget(256 * MIB),
        layout=request.param,
        num_blocks=3 * 8192,
        page_size=G,
        background=False,
        min_reserved=0,
        max_reserved=0,
    )
    yield kv
    kv.close()


def test_views_alias_one_memory(cache):
    t, s = cache.tensors, cache.spec
    ids = cache.alloc(3)
    b = ids[0]
    for layer in range(s.num_layers):
        fa = t.flash_attn_view(layer)
        assert fa.shape == (2, cache.num_blocks, 4, 2, 8)
        fa[0, b] = torch.arange(64, dtype=torch.float32).view(4, 2, 8) + layer
        fa[1, b] = -torch.arange(64, dtype=torch.float32).view(4, 2, 8) - layer
    for layer in range(s.num_layers):
        k, v = t.key_view(layer)[b], t.value_view(layer)[b]
        assert torch.equal(k.flatten(), torch.arange(64, dtype=torch.float32) + layer)
        assert torch.equal(v.flatten(), -torch.arange(64, dtype=torch.float32) - layer)
        fi = t.flashinfer_view(layer)
        assert fi.shape == (cache.num_blocks, 2, 4, 2, 8)
        assert torch.equal(fi[b, 0], k) and torch.equal(fi[b, 1], v)
        raw = t.raw_buffer(layer, 1)
        assert torch.equal(raw[b], v.contiguous().view(torch.uint8).flatten())
    # other blocks, layers' neighbours are untouched
    for other in ids[1:]:
        assert not t.key_view(0)[other].any()


def test_block_addresses_match_views(cache):
    t = cache.tensors
    for layer in (0, 2):
        for buf in (0, 1):
            view = t.key_view(layer) if buf == 0 else t.value_view(layer)
            for b in (0, 1, 4095, cache.num_blocks - 1):
                assert view[b].data_ptr() == t.block_address(layer, buf, b)


def test_a_page_maps_exactly_its_blocks_bytes(cache):
    t, g = cache.tensors, cache.geometry
    p = 1
    ranges = t.extent_ranges(p, 1)
    assert len(ranges) == g.handles_per_page
    assert sum(size for _, size in ranges) == g.page_bytes
    for b in (g.blocks_of(p)[0], g.blocks_of(p)[-1]):
        for layer in range(g.num_layers):
            for buf in range(g.num_buffers):
                a = t.block_address(layer, buf, b)
                end = a + g.buffer_block_bytes[buf]
                assert any(va <= a and end <= va + size for va, size in ranges)
    outside = t.block_address(0, 0, g.blocks_of(p)[-1] + 1)
    assert not any(va <= outside < va + size for va, size in ranges)


def test_unmapped_blocks_read_zero_and_layer_bytes(cache):
    t = cache.tensors
    last = cache.num_blocks - 1
    assert not t.key_view(1)[last].any()
    if cache.geometry.layout is KVLayout.PER_LAYER:
        assert t.layer_bytes(1).numel() == t.reservations[1][1]
        with pytest.raises(ConfigError):
            t.whole_bytes()
    else:
        assert t.whole_bytes().numel() == t.reservations[0][1]
        with pytest.raises(ConfigError):
            t.layer_bytes(0)


def test_mla_and_hybrid_state_views(host):
    spec = KVCacheSpec(
        num_layers=2, block_size=16, num_heads=1, head_dim=576, dtype=torch.bfloat16, kv_buffers=1
    )
    with KVCache(
        spec,
        driver=host,
        budget=ExactBudget(64 * MIB),
        num_blocks=512,
        background=False,
        min_reserved=0,
        max_reserved=0,
    ) as kv:
        mla = kv.tensors.mla_view(1)
        assert mla.shape == (kv.num_blocks, 16, 576)
        b = kv.alloc(1)[0]
        mla[b] = 1.5
        # the same bytes as a hybrid model's per-block state, viewed another way
        state = kv.tensors.block_view(1, 0, torch.float32, (16, 288))
        assert state.shape == (kv.num_blocks, 16, 288)
        assert torch.equal(state[b].view(torch.bfloat16), mla[b])
        with pytest.raises(ConfigError):
            kv.tensors.block_view(1, 0, torch.float32, (16, 287))
        with pytest.raises(ConfigError):
            kv.tensors.flash_attn_view(0)


def test_raw_byte_spec_for_integrations(host):
    spec = KVCacheSpec.of_bytes(num_layers=2, block_bytes=8192)
    with KVCache(
        spec,
        driver=host,
        budget=ExactBudget(64 * MIB),
        num_blocks=1024,
        layout=KVLayout.CONTIGUOUS,
        background=False,
        min_reserved=0,
        max_reserved=0,
    ) as kv:
        raw = kv.tensors.raw_buffer(1)
        assert raw.dtype == torch.uint8 and raw.shape == (kv.num_blocks, 8192)
        assert raw.stride() == (2 * 8192, 1)  # block-major: both layers per block
        assert kv.page_of(256) == 1 and kv.blocks_per_page == 256


def test_views_refuse_after_close(host):
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=1, head_dim=64, dtype=torch.float16)
    kv = KVCache(
        spec,
        driver=host,
        budget=ExactBudget(16 * MIB),
        num_blocks=64,
        background=False,
        min_reserved=0,
        max_reserved=0,
    )
    live = kv.alloc(2)
    kv.close()
    assert kv.alloc(1) is None, "a closed cache handed out a block of unmapped memory"
    kv.free(live)
    assert kv.alloc(1) is None
    kv.close()  # idempotent
    assert kv.closed
    with pytest.raises(MappingError):
        kv.tensors.key_view(0)
    assert host.own_bytes() == 0


def test_reservation_failure_is_undone(host):
    from kvcached.driver.faulty import FaultyDriver

    spec = KVCacheSpec(num_layers=3, block_size=16, num_heads=1, head_dim=64, dtype=torch.float16)
    faulty = FaultyDriver(host, fail_nth={"reserve": 3})
    g = plan_pages(spec, layout=KVLayout.PER_LAYER, granularity=G, page_size=G, num_blocks=64)
    with pytest.raises(Exception, match="injected"):
        VirtualKVTensors(faulty, spec, g)
    assert faulty.calls["free_reservation"] == 2
