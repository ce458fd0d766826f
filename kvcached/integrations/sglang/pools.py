"""Elastic SGLang pools and allocators (imports SGLang: loaded by the patch only).

* :class:`ElasticMHATokenToKVPool` / :class:`ElasticMLATokenToKVPool`
  subclass SGLang's pools and override only buffer creation: K/V (MLA: the
  latent buffer) become views of kvcached virtual tensors
  (:class:`~kvcached.integrations.sglang.elastic_kv.ElasticKV`); everything
  that reads the buffers afterwards (descriptors, data pointers, the attention
  backends) runs unchanged. A configuration kvcached does not cover
  (quantized recipes, HND / vectorized layouts, custom memory pools, SGLang's
  own post-capture VMM backing, a device the driver does not serve) keeps
  SGLang's own buffers, and then the allocator stays native too.
* :class:`ElasticTokenToKVPoolAllocator` / :class:`ElasticPagedTokenToKVPoolAllocator`
  subclass SGLang's allocators; their state is a
  :class:`~kvcached.integrations.sglang.slots.SlotAllocator` instead of free-page
  tensors. ``alloc`` / ``alloc_extend`` / ``alloc_decode`` take page ids from
  the block manager (mapped on demand) and lay slots out with SGLang's own
  kernels; ``free`` returns them; ``available_size()`` is the physical
  forecast clamped to the ledger (the agreed count in a TP round);
  ``check_decode_capacity`` reserves the next decode step's pages, so the
  decode allocation after it cannot fail.
* :func:`token_allocator` / :func:`paged_allocator` replace the two
  allocator names in SGLang's pool configurator: elastic over an elastic pool,
  SGLang's own class otherwise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from sglang.srt.mem_cache.allocator import base as _base
from sglang.srt.mem_cache.allocator import paged as _paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from kvcached.integrations.sglang.control import register_pool
from kvcached.integrations.sglang.elastic_kv import ElasticKV, KVShape, build_elastic_kv
from kvcached.integrations.sglang.slots import SlotAllocator
from kvcached.integrations.sglang.state import sglang_version
from kvcached.log import get_logger

log = get_logger("integrations.sglang")
_logged: set[str] = set()


def _native_once(pool: Any, why: str) -> None:
    key = f"{type(pool).__name__}:{why}"
    if key not in _logged:
        _logged.add(key)
        log.warning("%s keeps SGLang's own KV buffers: %s", type(pool).__name__, why)


def build_joined(shape: KVShape, *, device: Any, name: str) -> ElasticKV | None:
    """An elastic pool joined to this process' instance (snapshots, limits,
    reclaim), or ``None`` where kvcached's driver does not serve ``device``.
    Builds both the pool and its registration, which it passes in."""
    version = sglang_version() or ""
    return build_elastic_kv(
        shape,
        device=device,
        name=name,
        engine_version=version,
        register=functools.partial(register_pool, engine_version=version),
    )


def _elastic_or_native(pool: Any, why: str | None) -> ElasticKV | None:
    """An elastic KV pool of ``pool._kvcached_shape()`` for SGLang's ``pool``,
    joined to this process' instance, set as ``pool.kvcached``, with ``pool.size``
    cut to its rows (every block the block manager hands out must be a row of the
    buffers); ``None``, after a one-time warning, where ``why`` rules it out or
    kvcached's driver does not serve the device: the caller then builds SGLang's
    own buffers."""
    kv = None
    if why is None:
        shape, name = pool._kvcached_shape()
        kv = build_joined(shape, device=pool.device, name=name)
        why = None if kv is not None else "device not served by kvcached's driver"
    if kv is None:
        _native_once(pool, why or "not supported")
        return None
    pool.kvcached = kv
    pool.size = kv.rows - pool.page_size
    return kv


def elastic_kv_of(kvcache: Any) -> ElasticKV | None:
    """The kvcached side of ``kvcache`` (or of its full-attention pool, for
    SGLang's hybrid linear-attention pool), or ``None`` for a native pool."""
    kv = getattr(kvcache, "kvcached", None)
    if kv is None:
        kv = getattr(getattr(kvcache, "full_kv_pool", None), "kvcached", None)
    return kv


# -- pools ----------------------------------------------------------------------------------


class ElasticMHATokenToKVPool(MHATokenToKVPool):
    """SGLang's MHA pool over kvcached virtual tensors (see the module docstring)."""

    kvcached: ElasticKV | None = None

    def _create_buffers_normal(self) -> None:
        why = None
        if self.kv_cache_layout != "nhd" or self.use_hnd:
            why = f"layout {self.kv_cache_layout!r}"
        elif self.enable_custom_mem_pool:
            why = "a custom memory pool (PD over NVLink)"
        kv = _elastic_or_native(self, why)
        if kv is None:
            super()._create_buffers_normal()
            return
        self.k_buffer, self.v_buffer = kv.mha_buffers()

    def _kvcached_shape(self) -> tuple[KVShape, str]:
        """The shape and name of kvcached's pool for these buffers."""
        shape = KVShape(
            layers=self.layer_num,
            block_tokens=self.page_size,
            size=self.size,
            heads=self.head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            dtype=self.store_dtype,
        )
        return shape, self.allocation_label or "kv"

    def get_kv_size_bytes(self) -> Any:
        # The virtual size; kvcached reports what is mapped (kvctl, snapshots).
        return super().get_kv_size_bytes()


class ElasticMLATokenToKVPool(MLATokenToKVPool):
    """SGLang's MLA pool over kvcached virtual tensors (see the module docstring)."""

    kvcached: ElasticKV | None = None

    def _create_buffers(self) -> None:
        why = None
        if self.custom_mem_pool:
            why = "a custom memory pool (PD over NVLink)"
        elif self.use_dsa:
            why = "DSA sparse attention"
        kv = _elastic_or_native(self, why)
        if kv is None:
            super()._create_buffers()
            return
        self.kv_buffer = kv.mla_buffers()

    def _kvcached_shape(self) -> tuple[KVShape, str]:
        """The shape and name of kvcached's pool for this buffer (K and V joined)."""
        shape = KVShape(
            layers=self.layer_num,
            block_tokens=self.page_size,
            size=self.size,
            heads=1,
            head_dim=self.kv_cache_dim,
            dtype=self.store_dtype,
            kv_buffers=1,
        )
        return shape, "mla"


# -- allocators -------------------------------------------------------------------------------


def _sglang_uses_triton() -> bool:
    """Whether SGLang's own paged allocator lays slots out with its Triton
    kernels here: 0.5.22 asks the platform (and has torch versions for a
    platform without Triton); 0.5.20 and 0.5.21 have no such switch and always
    launch the kernels, so the elastic allocator does too (on a CPU only
    Triton's interpreter, ``TRITON_INTERPRET=1``, runs them, for SGLang's class
    and this one alike)."""
    platform = getattr(_paged, "current_platform", None)
    if platform is None:
        return True
    return bool(platform.capabilities.supports_triton)


class _ElasticAllocator:
    """What the token and the paged elastic allocator share (a mixin over
    SGLang's BaseTokenToKVPoolAllocator)."""

    kvcached_slots: SlotAllocator
    page_size: int
    device: Any
    free_group: list | None

    def _init_slots(self, kvcache: Any, capacity_pages: int) -> None:
        # 0.5.17 marks a free group with a flag beside the list (set by its
        # base ``__init__``); 0.5.20 on with ``free_group is None``.
        self._flagged_free_group = hasattr(self, "is_not_in_free_group")
        kv = elastic_kv_of(kvcache)
        assert kv is not None, "an elastic allocator needs an elastic pool (see the factories)"
        capacity_pages = min(capacity_pages, kv.cache.num_blocks - 1)
        self.kvcached_slots = SlotAllocator(kv, capacity_pages)
        if kv.source is not None:
            kv.source.slots = self.kvcached_slots
        self._no_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return self.kvcached_slots.available_tokens()

    def _reset_free_group(self) -> None:
        """No free group open, in this release's own representation."""
        if self._flagged_free_group:
            self.is_not_in_free_group = True
            self.free_group = []
        else:
            self.free_group = None

    def _in_free_group(self) -> bool:
        if self._flagged_free_group:
            return not self.is_not_in_free_group
        return self.free_group is not None

    def merge_and_sort_free(self) -> None:
        """Nothing is staged: frees go to the block manager at once."""

    def get_all_free_pages(self) -> None:
        return None  # no page free list (SGLang's invariant checker skips its census)

    def check_decode_capacity(
        self, *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        """Evict as SGLang does, then *reserve* the step's pages: a ``True``
        here means the decode allocation that follows is served from mapped
        pages, whatever other processes do meanwhile. ``False`` (on every TP
        rank alike) makes SGLang retract, as with a full static pool."""
        evict_to_free_tokens(self, tree_cache, num_tokens)
        slots = self.kvcached_slots
        if slots.available_tokens() < num_tokens:
            return False
        return slots.reserve(-(-num_tokens // self.page_size))

    def _ids_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _host_ids(self, index: torch.Tensor) -> list[int]:
        return index.tolist()


class ElasticTokenToKVPoolAllocator(_ElasticAllocator, TokenToKVPoolAllocator):
    """SGLang's page-size-1 allocator over kvcached (see the module docstring)."""

    def __init__(
        self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        _base.BaseTokenToKVPoolAllocator.__init__(self, size, 1, dtype, device, kvcache, need_sort)
        self._init_slots(kvcache, size)
        self.clear()

    def clear(self) -> None:
        self.kvcached_slots.clear()
        self.free_pages = self._no_pages
        self.release_pages = self._no_pages
        self._reset_free_group()

    def available_size(self) -> int:
        return self.kvcached_slots.available_tokens()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        ids = self.kvcached_slots.alloc_blocks(need_size)
        return None if ids is None else self._ids_tensor(ids)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self._in_free_group():
            # 0.5.20 on copies what a group holds (the caller may reuse the
            # tensor); 0.5.17 keeps the tensor itself, as SGLang does there.
            copy = getattr(self, "_copy_for_free_group", None)
            self.free_group.append(free_index if copy is None else copy(free_index))
            return
        self.kvcached_slots.free_blocks(self._host_ids(free_index))

    def resize(self, config: Any) -> None:
        self.size = config.max_total_num_tokens
        self.kvcached_slots.resize(self.size)
        self.clear()


class ElasticPagedTokenToKVPoolAllocator(_ElasticAllocator, PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator over kvcached (see the module docstring)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool,
    ) -> None:
        _base.BaseTokenToKVPoolAllocator.__init__(
            self, size, page_size, dtype, device, kvcache, need_sort
        )
        self.num_pages = size // page_size
        self.debug_mode = _paged.get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")
        self.use_triton_kernels = _sglang_uses_triton()
        self._init_slots(kvcache, self.num_pages)
        self.clear()

    def clear(self) -> None:
        self.kvcached_slots.clear()
        self.free_pages = self._no_pages
        self._reset_free_group()
        self.free_page_ids_group = []  # 0.5.20 on
        self.free_page_reps_group = []  # 0.5.17
        self.staged_pages = []
        self.num_staged_pages = 0

    def available_size(self) -> int:
        return self.kvcached_slots.available_tokens()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if self.debug_mode:  # SGLang's own debug check, with its message
            assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        ids = self.kvcached_slots.alloc_blocks(need_size // self.page_size)
        if ids is None:
            return None
        pages = self._ids_tensor(ids)
        return (
            pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)
        ).reshape(-1)

    def _new_pages(self, num_new_pages: int) -> torch.Tensor | None:
        ids = self.kvcached_slots.alloc_blocks(num_new_pages)
        if ids is None:
            return None
        if not ids and self.use_triton_kernels:
            ids = [0]  # a valid pointer for the kernel; no lane reads it
        return self._ids_tensor(ids)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        if self.debug_mode:
            assert torch.all((last_loc + 1) % self.page_size == prefix_lens % self.page_size)
        if num_new_pages is None:
            num_new_pages = _paged.get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        free_pages = self._new_pages(int(num_new_pages))
        if free_pages is None:
            return None
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        if self.use_triton_kernels:
            bs = len(prefix_lens)
            _paged.alloc_extend_kernel[(bs,)](
                prefix_lens,
                seq_lens,
                last_loc,
                free_pages,
                out,
                _paged.next_power_of_2(bs),
                self.page_size,
            )
        else:
            _paged.alloc_extend_naive(
                prefix_lens, seq_lens, last_loc, free_pages, out, self.page_size, self.device
            )
        if self.debug_mode:
            assert len(torch.unique(out)) == len(out)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        if self.debug_mode:
            assert torch.all((last_loc + 2) % self.page_size == seq_lens % self.page_size)
        num_new_pages = int(
            _paged.get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        )
        free_pages = self._new_pages(num_new_pages)
        if free_pages is None:
            return None
        bs = len(seq_lens)
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        if self.use_triton_kernels:
            _paged.alloc_decode_kernel[(bs,)](
                seq_lens, last_loc, free_pages, out, _paged.next_power_of_2(bs), self.page_size
            )
        else:
            _paged.alloc_decode_naive(
                seq_lens, last_loc, free_pages, out, self.page_size, num_new_pages
            )
        if self.debug_mode:
            assert len(torch.unique(out)) == len(out)
        return out

    def _debug_check_no_duplicate_pages(self) -> None:
        """SGLang's debug check after a free (``SGLANG_DEBUG_MEMORY_POOL``):
        there is no free-page tensor to census here (``get_all_free_pages()``
        is ``None``, as SGLang's base allows); a page freed twice is refused by
        the block manager in any mode, so the debug check is its full
        invariant check."""
        self.kvcached_slots.kv.blocks.check()

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        ids = page_ids[0] if len(page_ids) == 1 else torch.cat(page_ids)
        self.kvcached_slots.free_blocks(self._host_ids(ids))

    def resize(self, config: Any) -> None:
        self.size = config.max_total_num_tokens
        self.num_pages = self.size // self.page_size
        self.kvcached_slots.resize(self.num_pages)
        self.clear()


def evict_to_free_tokens(allocator: Any, tree_cache: Any, num_tokens: int) -> None:
    """Evict prefix cache until ``allocator`` can serve ``num_tokens``, as this
    release's SGLang evicts: the allocator's own hook from 0.5.20 on, and
    before it (0.5.17) ``mem_cache.common.evict_from_tree_cache``, which the
    scheduler calls there (the same shortfall-only eviction)."""
    hook = getattr(allocator, "evict_to_free_tokens", None)
    if hook is not None:
        hook(tree_cache, num_tokens)
        return
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    evict_from_tree_cache(tree_cache, num_tokens)


# -- the names the configurator calls -----------------------------------------------------------


def token_allocator(*args: Any, **kwargs: Any) -> Any:
    """``TokenToKVPoolAllocator(...)`` as the configurator calls it: elastic
    over an elastic pool, SGLang's own class otherwise."""
    kvcache = kwargs.get("kvcache", args[3] if len(args) > 3 else None)
    cls = ElasticTokenToKVPoolAllocator if elastic_kv_of(kvcache) else TokenToKVPoolAllocator
    return cls(*args, **kwargs)


def paged_allocator(*args: Any, **kwargs: Any) -> Any:
    """``PagedTokenToKVPoolAllocator(...)`` likewise."""
    kvcache = kwargs.get("kvcache", args[4] if len(args) > 4 else None)
    cls = (
        ElasticPagedTokenToKVPoolAllocator
        if elastic_kv_of(kvcache)
        else PagedTokenToKVPoolAllocator
    )
    return cls(*args, **kwargs)
