"""A kvcached instance in a process of its own, driven line by line over stdin.

Usage: ``python tests/control/instance_child.py HOST_INDEX CAPACITY_BYTES [ENGINE]``
(``HOST_INDEX`` ``cuda`` puts the cache on CUDA device 0 instead, for the GPU test)
with ``KVCACHED_LEDGER_DIR`` (and optionally ``KVCACHED_IPC_NAME``) set. It opens
a KV cache with :func:`kvcached.control.instance.open_kv_cache` on the host
backend, prints one JSON line when ready, then answers each command with one
JSON line: ``alloc N`` (blocks, kept), ``free N`` (the last N kept), ``usage``,
``quit``.

One physical handle per page (``max_handle_bytes=0``): a coalesced extent is
released only when all its pages are idle, which would make the exact byte
counts the kvctl tests check depend on placement.
"""

from __future__ import annotations

import json
import sys

import torch

from kvcached.config import get_config
from kvcached.control.instance import close_kv_cache, current_instance, open_kv_cache
from kvcached.driver.host import HostDriver
from kvcached.memory.spec import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_heads=4, head_dim=64, dtype=torch.float16)


def usage(cache) -> dict:
    u = cache.usage().as_dict()
    u["ledger_charged"] = cache.budget.instance_charged()
    return u


def main() -> int:
    capacity = int(sys.argv[2])
    engine = sys.argv[3] if len(sys.argv) > 3 else "test"
    if sys.argv[1] == "cuda":
        from kvcached.driver import get_driver

        driver = get_driver(0, "cuda")
    else:
        driver = HostDriver(index=int(sys.argv[1]), capacity=capacity)
    cache = open_kv_cache(
        SPEC,
        engine=engine,
        engine_version="1.0",
        driver=driver,
        capacity_bytes=capacity,
        min_reserved=2,
        max_reserved=4,
        max_handle_bytes=0,
        config=get_config(),
    )
    held: list[int] = []
    print(
        json.dumps(
            {
                "ready": True,
                "name": current_instance().name,
                "page_bytes": cache.geometry.page_bytes,
                "blocks_per_page": cache.blocks_per_page,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "alloc":
            ids = cache.alloc(int(args[0]))
            if ids is None:
                cache.control_source.misses += 1
            else:
                held.extend(ids)
            answer = {"ok": ids is not None, "held": len(held)}
        elif cmd == "free":
            n = int(args[0])
            cache.free(held[len(held) - n :])
            del held[len(held) - n :]
            answer = {"ok": True, "held": len(held)}
        elif cmd == "usage":
            answer = usage(cache)
        elif cmd == "quit":
            break
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(answer), flush=True)
    cache.free(held)
    close_kv_cache(cache)
    current_instance().close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
