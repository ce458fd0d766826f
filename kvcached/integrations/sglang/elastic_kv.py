"""kvcached memory under one SGLang KV pool, without importing SGLang.

SGLang addresses KV by *slot* (one token of every layer): its pools hold, per
layer, a K and a V buffer of ``size + page_size`` rows (row 0's page is the
padding page that absorbs writes of padded tokens), and its allocators hand
out slots one at a time (``page_size == 1``) or one page of ``page_size``
slots at a time. Here one SGLang page is one kvcached *block*
(``KVCacheSpec.block_size = page_size``), so

* slot ``s`` is token ``s % page_size`` of block ``s // page_size``, and block
  ``b`` lies in kvcached page ``b // blocks_per_page`` in every layer and in
  both K and V: mapping one kvcached page backs a fixed run of slots;
* block 0 is kvcached's null block and SGLang's padding page at once (mapped
  at start, never handed out);
* the per-layer layout (``KVLayout.PER_LAYER``) keeps SGLang's row addressing:
  K of layer ``l`` is one range of uniformly strided rows, and V follows it at
  a fixed offset, exactly like SGLang's fused ``(2, rows, H, D)`` buffer.

:class:`ElasticKV` owns the kvcached side of one pool (virtual tensors, page
pool, block manager, ledger account, control registration) and gives the
buffers as SGLang shapes them. :class:`~kvcached.integrations.sglang.slots.SlotAllocator`
is the allocator state SGLang's allocator classes wrap. Both are usable (and
tested, also on the GPU) without SGLang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvcached.errors import ConfigError
from kvcached.log import get_logger
from kvcached.memory.budget import PhysicalBudget
from kvcached.memory.cache import KVCache
from kvcached.memory.spec import KVCacheSpec, KVLayout

log = get_logger("integrations.sglang")


@dataclass(frozen=True)
class KVShape:
    """One SGLang token-to-KV pool as kvcached sees it.

    ``size`` is SGLang's token capacity (usable slots ``1 .. size``, rows
    ``size + page_size``), ``block_tokens`` SGLang's ``page_size`` (tokens per
    SGLang page; one SGLang page is one kvcached block),
    ``dtype`` the *store* dtype (``uint8`` for fp8 caches). ``kv_buffers`` is
    2 for MHA (``v_head_dim`` where V differs from K) and 1 for MLA (one
    ``(rows, 1, head_dim)`` buffer per layer, ``heads == 1``).
    """

    layers: int
    block_tokens: int
    size: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int | None = None
    kv_buffers: int = 2

    def __post_init__(self) -> None:
        for name in ("layers", "block_tokens", "size", "heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "a whole number >= 1")

    @property
    def blocks(self) -> int:
        """Blocks (SGLang pages) the pool's rows span, the padding block 0 included."""
        return -(-(self.size + self.block_tokens) // self.block_tokens)

    def spec(self) -> KVCacheSpec:
        v_head_dim = self.v_head_dim if self.v_head_dim not in (None, self.head_dim) else None
        return KVCacheSpec(
            num_layers=self.layers,
            block_size=self.block_tokens,
            num_heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            kv_buffers=self.kv_buffers,
            v_head_dim=v_head_dim if self.kv_buffers == 2 else None,
        )


class Registration(Protocol):
    """What joining the instance returns for one pool (the control layer's
    :class:`~kvcached.integrations.sglang.control.SGLangPoolSource`)."""

    def leave(self) -> None:
        """Leave the instance; the pool is closing."""
        ...


#: Joins a new pool to this process' instance. The factory that builds the
#: pool passes it in, so this module does not import the control layer, which
#: knows this one.
Register = Callable[["ElasticKV"], Registration]


class ElasticKV:
    """The kvcached side of one SGLang pool.

    ``driver`` defaults to the process' driver of the pool's device;
    ``budget`` to a fresh account on that device's ledger under this process'
    instance (:func:`kvcached.ledger.open_pool_budget`: pools of one rank
    share the ledger, one account each). With ``register`` the pool joins the
    instance (snapshots for ``kvctl``, limits): it is called once the pool is
    built, and what it returns is :attr:`source` (in production a
    :class:`~kvcached.integrations.sglang.control.SGLangPoolSource`, passed in
    by :func:`kvcached.integrations.sglang.pools.build_joined`). ``config`` is the
    settings the driver, the ledger and the cache are given (default: the
    process' ``KVCACHED_*`` variables, :func:`kvcached.config.get_config`).

    :attr:`rows` is every slot row the virtual tensors hold: at least
    ``size + page_size``, rounded up to whole kvcached pages; SGLang's pool
    takes ``rows - page_size`` as its ``size`` so that any block the block
    manager hands out is a valid row (the allocator keeps SGLang's own
    capacity as its logical limit).

    :meth:`close` (idempotent) leaves the instance, unmaps everything, gives
    back the address space and retires the ledger account.
    """

    def __init__(
        self,
        shape: KVShape,
        *,
        name: str = "kv",
        driver: Any = None,
        budget: PhysicalBudget | None = None,
        engine_version: str = "",
        register: Register | None = None,
        config: Any = None,
        **cache_kwargs: Any,
    ) -> None:
        from kvcached.config import get_config
        from kvcached.driver import get_driver

        config = get_config() if config is None else config
        self.shape = shape
        self.name = name
        self.driver = driver if driver is not None else get_driver(config=config)
        owned_budget = None
        if budget is None:
            from kvcached.control.instance import get_instance
            from kvcached.ledger import open_pool_budget

            instance = get_instance(
                "sglang", engine_version, ipc_name=config.ipc_name, yield_idle=config.yield_idle
            )
            budget = owned_budget = open_pool_budget(self.driver, instance.name, config=config)
        try:
            cache_kwargs.setdefault("layout", KVLayout.PER_LAYER)
            self.cache = KVCache(
                shape.spec(),
                config=config,
                driver=self.driver,
                budget=budget,
                num_blocks=shape.blocks,
                **cache_kwargs,
            )
        except BaseException:
            if owned_budget is not None:
                owned_budget.close()
            raise
        if self.cache.geometry.layout is not KVLayout.PER_LAYER:
            self.cache.close()
            if owned_budget is not None:
                owned_budget.close()
            raise ConfigError(
                "layout",
                cache_kwargs["layout"],
                "per_layer: SGLang indexes a layer's K and V as uniformly "
                "strided token rows, which the contiguous layout is not",
            )
        self.budget = budget
        self._owned_budget = owned_budget
        self.blocks = self.cache.blocks
        self.rows = self.cache.num_blocks * shape.block_tokens
        self.source: Any = None
        self.ipc_name: str | None = config.ipc_name  # names the instance it registers with
        self._lock = threading.Lock()
        self._closed = False
        if register is not None:
            self.source = register(self)

    # -- buffers as SGLang shapes them --------------------------------------------------
    def mha_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V of shape ``(rows, heads, head_dim)`` (V:
        ``v_head_dim``). With equal head dims each layer's K and V are the two
        halves of one ``(2, rows, H, D)`` view, as SGLang's fused buffer."""
        s = self.shape
        if s.kv_buffers != 2:
            raise ConfigError("kv_buffers", s.kv_buffers, "2 (K and V) for MHA buffers")
        t = self.cache.tensors
        k_list, v_list = [], []
        for layer in range(s.layers):
            if s.v_head_dim in (None, s.head_dim):
                fused = t.flash_attn_view(layer).view(2, self.rows, s.heads, s.head_dim)
                k_list.append(fused[0])
                v_list.append(fused[1])
            else:
                k_list.append(t.key_view(layer).view(self.rows, s.heads, s.head_dim))
                v_list.append(t.value_view(layer).view(self.rows, s.heads, s.v_head_dim))
        return k_list, v_list

    def mla_buffers(self) -> list[torch.Tensor]:
        """Per layer MLA's single buffer of shape ``(rows, 1, kv_cache_dim)``."""
        s = self.shape
        if s.kv_buffers != 1:
            raise ConfigError("kv_buffers", s.kv_buffers, "1 for MLA buffers")
        t = self.cache.tensors
        return [
            t.mla_view(layer).view(self.rows, 1, s.heads * s.head_dim) for layer in range(s.layers)
        ]

    # -- lifetime --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Leave the instance, unmap, give back VA, retire the account. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.source is not None:
            self.source.leave()
        self.cache.close()
        if self._owned_budget is not None:
            self._owned_budget.close()

    def __repr__(self) -> str:
        s = self.shape
        return (
            f"<ElasticKV {self.name} layers={s.layers} block_tokens={s.block_tokens} "
            f"rows={self.rows} {self.cache!r}>"
        )


def build_elastic_kv(
    shape: KVShape,
    *,
    device: Any,
    name: str,
    engine_version: str = "",
    register: Register | None = None,
) -> ElasticKV | None:
    """An :class:`ElasticKV` for a pool on ``device`` (joined to the instance
    by ``register``), or ``None`` (logged) when kvcached's driver does not
    serve that device, so the pool stays native."""
    from kvcached.config import get_config
    from kvcached.driver import get_driver

    dev = torch.device(device)
    index = dev.index
    if dev.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    driver = get_driver(index or 0, config=get_config())
    if driver.torch_device.type != dev.type:
        log.warning(
            "SGLang pool %s is on %s but kvcached's %s driver serves %s; the pool stays native",
            name,
            dev,
            driver.info().backend,
            driver.torch_device,
        )
        return None
    return ElasticKV(
        shape, name=name, driver=driver, engine_version=engine_version, register=register
    )
