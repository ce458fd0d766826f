"""Data integrity: every live block keeps what was written through the layer
views while other blocks come and go and pages are mapped, trimmed, capped."""

from __future__ import annotations

import pytest

from kvcached.memory import KVCacheSpec, KVLayout
from kvcached.units import KIB, MIB
from tests.memory.kvmem_helpers import make_cache, run_integrity


@pytest.mark.parametrize(
    "layout, coalesce, seed",
    [
        # Seconds apiece (page by page handles; the contiguous layout's bigger pages): CI runs
        # them, the developer loop keeps the per-layer coalesced case.
        pytest.param(KVLayout.PER_LAYER, False, 1, marks=pytest.mark.slow),
        (KVLayout.PER_LAYER, True, 2),
        pytest.param(KVLayout.CONTIGUOUS, True, 3, marks=pytest.mark.slow),
    ],
    ids=["per_layer-page_handles", "per_layer-coalesced", "contiguous-coalesced"],
)
def test_live_blocks_keep_their_data(host, layout, coalesce, seed):
    # Every newly mapped host page is faulted in on first write: keep the
    # cache small (2 layers x K/V of 2 MiB pages) so the test stays quick.
    spec = KVCacheSpec.of_bytes(num_layers=2, block_bytes=64 * KIB, kv_buffers=2)
    cache, budget = make_cache(
        host,
        spec,
        pages=5,
        layout=layout,
        min_reserved=1,
        max_reserved=2,
        max_handle_bytes=64 * MIB if coalesce else 0,
    )
    peak = run_integrity(cache, steps=80, seed=seed)
    assert peak > cache.blocks_per_page, "the sequence never spanned two pages"
    cache.close()
    assert budget.used == 0 and host.own_bytes() == 0
