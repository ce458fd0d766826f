"""Helpers for the memory-layer tests: small caches, an exact budget, data patterns."""

from __future__ import annotations

import threading

import torch

from kvcached.memory import KVCache, KVCacheSpec
from kvcached.units import KIB, MIB


class ExactBudget:
    """A PhysicalBudget with a fixed capacity and exact accounting, so tests can
    assert that every grant is matched by a refund after a confirmed release."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.grants = 0
        self.denials = 0
        self.flushes = 0
        self.closed = False
        self._lock = threading.Lock()

    def grant(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.capacity:
                self.denials += 1
                return False
            self.used += nbytes
            self.grants += 1
            return True

    def refund(self, nbytes: int) -> None:
        with self._lock:
            assert 0 < nbytes <= self.used, f"refund of {nbytes} with {self.used} charged"
            self.used -= nbytes

    def headroom(self) -> int:
        return self.capacity - self.used

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


# One 2 MiB page per buffer span; 4 blocks of 512 KiB per page.
SMALL_BLOCK = 512 * KIB


def small_spec(layers: int = 1, buffers: int = 1) -> KVCacheSpec:
    return KVCacheSpec.of_bytes(layers, SMALL_BLOCK, kv_buffers=buffers)


def make_cache(driver, spec: KVCacheSpec, *, pages: int = 8, budget_pages: int | None = None,
               **kw) -> tuple[KVCache, ExactBudget]:
    from kvcached.memory import KVLayout, plan_pages

    layout = kw.pop("layout", KVLayout.PER_LAYER)
    g = plan_pages(spec, layout=layout, granularity=driver.granularity,
                   page_size=kw.pop("page_size", 2 * MIB), num_blocks=1)
    budget = ExactBudget((budget_pages if budget_pages is not None else pages) * g.page_bytes)
    kw.setdefault("background", False)
    kw.setdefault("min_reserved", 0)
    kw.setdefault("max_reserved", 0)
    cache = KVCache(spec, driver=driver, budget=budget, layout=layout,
                    num_blocks=pages * g.blocks_per_page, page_size=2 * MIB, **kw)
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
    if not blocks:
        return
    t = cache.tensors
    ids = torch.tensor(blocks, dtype=torch.long)
    for layer in range(cache.geometry.num_layers):
        for buf in range(cache.geometry.num_buffers):
            raw = t.raw_buffer(layer, buf)
            want = torch.tensor([pattern(b, layer, buf) for b in blocks], dtype=torch.uint8)
            parts = [raw[ids]] if full else [raw[ids, :64], raw[ids, -64:]]
            for got in parts:
                bad = (got != want[:, None]).any(dim=1)
                assert not bad.any(), (
                    f"layer {layer} buffer {buf}: blocks "
                    f"{[blocks[i] for i in bad.nonzero().flatten().tolist()]} lost their data")
