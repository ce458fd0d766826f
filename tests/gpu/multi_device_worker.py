"""One kvcached process on one device, for the multi-device tests.

Two modes, each run as a process of its own (``python tests/gpu/multi_device_worker.py``):

``serve BACKEND INDEX CAPACITY``
    Opens a KV cache on device ``INDEX`` of ``BACKEND`` (``cuda`` or ``host``)
    through :func:`kvcached.control.instance.open_kv_cache`, so that it is
    charged to that device's ledger in ``KVCACHED_LEDGER_DIR``, prints one JSON
    line when ready, then answers each stdin command with one JSON line:
    ``info`` (bus id, ledger path, the torch device, free and total memory),
    ``grow N`` (N more blocks, each written with a pattern of its id),
    ``check`` (every held block still holds its pattern), ``shrink`` (free every
    held block, unmap every idle page, flush the refunds), ``quit``.

``tp BACKEND INDEX_BASE RANK WORLD DIST_BACKEND INIT_METHOD LIMITED_RANK LIMIT_BYTES ROUNDS OUT``
    One rank of a tensor-parallel group (``torch.distributed`` over ``nccl``
    or ``gloo``): each rank opens a KV cache on its own device (``INDEX_BASE``
    plus its rank; 0 on ``cuda``, a host index no other test uses on ``host``), the instance's
    limit is set on ``LIMITED_RANK``'s device only (``LIMIT_BYTES``, in that
    device's ledger), and every rank admits batches through the integrations'
    own :class:`~kvcached.integrations.sglang.tp_agreement.RoundAgreement`
    over :class:`~kvcached.integrations.sglang.tp_agreement.GroupReducer`.
    Rank 0 writes a JSON report to ``OUT``: what each rank admitted per round,
    what each rank could have admitted alone, and the limited rank's peak charge.

Memory on the ``cuda`` backend is read with ``cuMemGetInfo`` on the device's
own context (the driver's ``mem_info``); the ``host`` backend counts every
process' memory of one host device, as a GPU would.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import torch

SPEC_ARGS = dict(num_layers=2, block_size=16, num_heads=4, head_dim=64)
#: Each TP rank's cache: 64 pages of 8 MiB (2 MiB per layer and buffer).
TP_CAPACITY = 512 << 20


def _spec() -> Any:
    from kvcached.memory.spec import KVCacheSpec

    return KVCacheSpec(dtype=torch.float16, **SPEC_ARGS)


def _driver(backend: str, index: int, capacity: int) -> Any:
    if backend == "cuda":
        from kvcached.driver import get_driver

        torch.cuda.set_device(index)
        return get_driver(index, "cuda")
    from kvcached.driver.host import HostDriver

    return HostDriver(index=index, capacity=capacity)


def _open(backend: str, index: int, capacity: int) -> Any:
    from kvcached.config import get_config
    from kvcached.control.instance import open_kv_cache

    driver = _driver(backend, index, capacity)
    return open_kv_cache(
        _spec(),
        engine="test",
        engine_version="1.0",
        driver=driver,
        capacity_bytes=capacity,
        min_reserved=0,
        max_reserved=0,
        background=False,
        max_handle_bytes=0,
        config=get_config(),
    )


def _pattern(block: int, layer: int) -> float:
    """A value that identifies a block and layer exactly in float16."""
    return float((block * 7 + layer * 3) % 2000 - 1000)


def _write(cache: Any, ids: list[int]) -> None:
    index = torch.tensor(ids, dtype=torch.long, device=cache.driver.torch_device)
    for layer in range(cache.spec.num_layers):
        view = cache.tensors.flash_attn_view(layer)  # (2, blocks, bs, heads, dim)
        values = torch.tensor(
            [_pattern(b, layer) for b in ids], dtype=view.dtype, device=view.device
        )
        view[:, index] = values.view(1, -1, 1, 1, 1)
    cache.driver.synchronize()


def _bad_blocks(cache: Any, ids: list[int]) -> int:
    bad = 0
    index = torch.tensor(ids, dtype=torch.long, device=cache.driver.torch_device)
    for layer in range(cache.spec.num_layers):
        view = cache.tensors.flash_attn_view(layer)
        want = torch.tensor(
            [_pattern(b, layer) for b in ids], dtype=view.dtype, device=view.device
        ).view(1, -1, 1, 1, 1)
        got = view[:, index]
        bad += int((got != want).flatten(2).any(dim=2).any(dim=0).sum())
    return bad


def _info(cache: Any) -> dict[str, Any]:
    info = cache.driver.info()
    free, total = cache.driver.mem_info()
    return {
        "bus_id": info.pci_bus_id,
        "index": info.index,
        "ledger": cache.budget.ledger_path,
        "torch_device": str(cache.driver.torch_device),
        "view_device": str(cache.tensors.flash_attn_view(0).device),
        "free": free,
        "total": total,
        "charged": cache.budget.instance_charged(),
        "page_bytes": cache.geometry.page_bytes,
        "blocks_per_page": cache.blocks_per_page,
    }


def serve(backend: str, index: int, capacity: int) -> int:
    from kvcached.control.instance import close_kv_cache, current_instance

    cache = _open(backend, index, capacity)
    held: list[int] = []
    print(json.dumps({"ready": True, "name": current_instance().name, **_info(cache)}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "info":
            answer = _info(cache)
        elif cmd == "grow":
            ids = cache.alloc(int(args[0]))
            if ids is not None:
                _write(cache, ids)
                held.extend(ids)
            answer = {"ok": ids is not None, "held": len(held), **_info(cache)}
        elif cmd == "check":
            answer = {"held": len(held), "bad": _bad_blocks(cache, held) if held else 0}
        elif cmd == "shrink":
            cache.free(held)
            held.clear()
            cache.trim()
            cache.budget.flush()
            answer = {"held": 0, "bytes_mapped": cache.usage().bytes_mapped, **_info(cache)}
        elif cmd == "quit":
            break
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(answer), flush=True)
    cache.free(held)
    close_kv_cache(cache)
    current_instance().close()
    return 0


def _set_limit_here(cache: Any, limit: int) -> None:
    """The instance's limit on this device only (its ledger), then wait until
    this pool's headroom reflects it."""
    from kvcached.control.instance import current_instance
    from kvcached.ledger.ledger import Ledger

    ledger = Ledger.open_existing(cache.budget.ledger_path)
    try:
        name = current_instance().name
        inst = ledger.snapshot().instance(name)
        assert inst is not None, f"instance {name} not in {cache.budget.ledger_path}"
        ledger.set_limit(name, limit, inst.revision + 1)
    finally:
        ledger.close()
    deadline = time.monotonic() + 30
    limit_blocks = limit // cache.geometry.page_bytes * cache.blocks_per_page
    while cache.available_size() > limit_blocks and time.monotonic() < deadline:
        time.sleep(0.05)


def tp(
    backend: str,
    index_base: int,
    rank: int,
    world: int,
    dist_backend: str,
    init_method: str,
    limited_rank: int,
    limit: int,
    rounds: int,
    out: str,
) -> int:
    import torch.distributed as dist

    from kvcached.control.instance import close_kv_cache, current_instance
    from kvcached.integrations.sglang.tp_agreement import GroupReducer, RoundAgreement

    cache = _open(backend, index_base + rank, TP_CAPACITY)
    dist.init_process_group(dist_backend, init_method=init_method, rank=rank, world_size=world)
    device = cache.driver.torch_device if dist_backend == "nccl" else torch.device("cpu")
    dist.barrier()
    if rank == limited_rank:
        _set_limit_here(cache, limit)
    dist.barrier()
    agreement = RoundAgreement(
        cache.available_size, GroupReducer([dist.group.WORLD], device=device)
    )
    rng = random.Random(1234)  # the same on every rank: the same requests
    held: list[list[int]] = []
    admitted_per_round: list[list[int]] = []
    alone_per_round: list[int] = []
    peak_charged = 0
    bpp = cache.blocks_per_page
    for _ in range(rounds):
        sizes = [rng.randint(1, 3 * bpp) for _ in range(rng.randint(1, 8))]
        alone_per_round.append(cache.available_size())
        admitted: list[int] = []
        with agreement.round():
            for n in sizes:
                if agreement.available() < n:
                    continue
                ids = cache.alloc(n)
                if not agreement.agree(ids is not None):
                    if ids is not None:
                        cache.free(ids)
                    continue
                assert ids is not None
                agreement.note_alloc(n)
                held.append(ids)
                admitted.append(n)
            for _ in range(rng.randint(0, len(held))):
                ids = held.pop(rng.randrange(len(held)))
                cache.free(ids)
                agreement.note_free(len(ids))
        admitted_per_round.append(admitted)
        peak_charged = max(peak_charged, cache.budget.instance_charged())
    report = {
        "rank": rank,
        "bus_id": cache.driver.info().pci_bus_id,
        "ledger": cache.budget.ledger_path,
        "admitted": admitted_per_round,
        "alone": alone_per_round,
        "peak_charged": peak_charged,
        "page_bytes": cache.geometry.page_bytes,
        "agreement": vars(agreement.stats),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    for ids in held:
        cache.free(ids)
    dist.barrier()
    dist.destroy_process_group()
    close_kv_cache(cache)
    current_instance().close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "dist_backend": dist_backend,
                    "limited_rank": limited_rank,
                    "limit_bytes": limit,
                    "ranks": gathered,
                },
                f,
                indent=1,
            )
    return 0


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "serve":
        return serve(argv[1], int(argv[2]), int(argv[3]))
    if mode == "tp":
        (backend, base, rank, world, dist_backend, init_method, limited, limit, rounds, out) = argv[
            1:
        ]
        return tp(
            backend,
            int(base),
            int(rank),
            int(world),
            dist_backend,
            init_method,
            int(limited),
            int(limit),
            int(rounds),
            out,
        )
    raise SystemExit(f"mode={mode!r}: must be serve or tp")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
