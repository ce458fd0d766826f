"""Helpers for the memory-layer tests: small caches, an exact budget, data patterns."""

from __future__ import annotations

import random

import torch

from kvcached.memory import KVCache, KVCacheSpec
from kvcached.units import KIB, MIB
from tests.budgets import ExactBudget  # the memory tests import it from here too

# The host device index these tests use. The host backend counts every
# process' memfds of a device against its capacity (as a GPU would); other test
# suites running at the same time use device 0, so this one stays apart.
HOST_INDEX = 23

# One 2 MiB page per buffer span; 4 blocks of 512 KiB per page.
SMALL_BLOCK = 512 * KIB


def small_spec(layers: int = 1, buffers: int = 1) -> KVCacheSpec:
    return KVCacheSpec.of_bytes(layers, SMALL_BLOCK, kv_buffers=buffers)


def make_cache(
    driver,
    spec: KVCacheSpec,
    *,
    pages: int = 8,
    budget_pages: int | None = None,
    budget_type: type[ExactBudget] = ExactBudget,
    **kw,
) -> tuple[KVCache, ExactBudget]:
    from kvcached.memory import KVLayout, plan_pages

    layout = kw.pop("layout", KVLayout.PER_LAYER)
    g = plan_pages(
        spec,
        layout=layout,
        granularity=driver.granularity,
        page_size=kw.pop("page_size", 2 * MIB),
        num_blocks=1,
    )
    budget = budget_type((budget_pages if budget_pages is not None else pages) * g.page_bytes)
    kw.setdefault("background", False)
    kw.setdefault("min_reserved", 0)
    kw.setdefault("max_reserved", 0)
    cache = KVCache(
        spec,
        driver=driver,
        budget=budget,
        layout=layout,
        num_blocks=pages * g.blocks_per_page,
        page_size=2 * MIB,
        **kw,
    )
    return cache, budget


def pattern(block: int, layer: int, buffer: int) -> int:
    return (block * 7 + layer * 3 + buffer) % 251 + 1


def write_pattern(cache: KVCache, blocks: list[int], *, full: bool = False) -> None:
    t = cache.tensors
    for layer in range(cache.geometry.num_layers):
        for buf in range(cache.geometry.num_buffers):
            raw = t.raw_buffer(layer, buf)
            for b in blocks:
                row = raw[b] if full else raw[b, :64]
                row.fill_(pattern(b, layer, buf))
                if not full:
                    raw[b, -64:].fill_(pattern(b, layer, buf))


def check_pattern(cache: KVCache, blocks: list[int], *, full: bool = False) -> None:
    """Every block in ``blocks`` still holds its pattern in every layer and
    buffer (``full``: every byte; else its first and last 64 bytes)."""
    if not blocks:
        return
    t = cache.tensors
    for layer in range(cache.geometry.num_layers):
        for buf in range(cache.geometry.num_buffers):
            raw = t.raw_buffer(layer, buf)
            ids = torch.tensor(blocks, dtype=torch.long, device=raw.device)
            want = torch.tensor(
                [pattern(b, layer, buf) for b in blocks], dtype=torch.uint8, device=raw.device
            )
            parts = [raw[ids]] if full else [raw[ids, :64], raw[ids, -64:]]
            for got in parts:
                bad = (got != want[:, None]).any(dim=1)
                if bad.any():
                    lost = [blocks[i] for i in bad.nonzero().flatten().tolist()]
                    raise AssertionError(
                        f"layer {layer} buffer {buf}: blocks {lost} lost their data"
                    )


def run_integrity(
    cache: KVCache, *, steps: int, seed: int, full_every: int = 10, max_alloc: int = 12
) -> int:
    """A random sequence of allocs, frees, trims, resizes and limits; every
    live block keeps its pattern (written through the layer views) through
    all of it. Returns the most blocks that were live at once."""
    rng = random.Random(seed)
    live: list[int] = []
    peak = 0
    page_bytes = cache.geometry.page_bytes
    pages = cache.geometry.num_pages
    for step in range(steps):
        op = rng.random()
        if op < 0.45:
            got = cache.alloc(rng.randint(1, max_alloc))
            if got is not None:
                write_pattern(cache, got, full=True)
                live.extend(got)
        elif op < 0.8 and live:
            rng.shuffle(live)
            k = rng.randint(1, len(live))
            cache.free(live[:k])
            del live[:k]
        elif op < 0.87:
            cache.trim()
        elif op < 0.94:
            cache.set_limit(None if rng.random() < 0.3 else rng.randint(1, pages) * page_bytes)
        else:
            cache.resize(None if rng.random() < 0.3 else rng.randint(1, cache.num_blocks))
        peak = max(peak, len(live))
        check_pattern(cache, live, full=step % full_every == 0)
    check_pattern(cache, live, full=True)
    cache.blocks.check()
    cache.free(live)
    return peak
