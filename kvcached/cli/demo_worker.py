"""One instance of ``kvcached demo``: a process with a real KV cache.

Started by :mod:`kvcached.cli.demo` as ``python -m kvcached.cli.demo_worker
CONFIG_JSON`` with the demo's environment (host backend, the demo's ledger
directory, its instance name). Protocol, one JSON line each way:

1. it opens the cache with :func:`~kvcached.control.instance.open_kv_cache`
   (charged to the device's ledger, published for ``kvctl``) and prints
   ``{"ready": ..., "page_bytes", "blocks_per_page", "num_blocks"}``;
2. it reads the plan ``{"t0", "tick_s", "ticks", "trace"}`` from stdin;
3. it serves the trace tick by tick, paced on the shared clock from ``t0``,
   every block through the real block manager;
4. it prints ``{"done": ..., "misses", "delayed", ...}``, closes the cache and exits.

It dies with its parent (``PR_SET_PDEATHSIG``) so a killed demo leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import sys
import time

DEMO_SPEC_ARGS = {"num_layers": 1, "block_size": 16, "num_heads": 8, "head_dim": 128}


def _die_with_parent() -> None:
    # Linux only: elsewhere there is no prctl and the demo's own teardown must do.
    with contextlib.suppress(OSError, AttributeError):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _say(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(argv[0])
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from kvcached.cli.demo_load import Request, Served
    from kvcached.config import get_config
    from kvcached.control.instance import close_kv_cache, current_instance, open_kv_cache
    from kvcached.driver.host import HostDriver
    from kvcached.memory.spec import KVCacheSpec

    spec = KVCacheSpec(dtype=torch.float16, **DEMO_SPEC_ARGS)
    driver = HostDriver(index=config["index"], capacity=config["capacity"])
    # Every instance reserves address space for the whole budget: any of them
    # may grow into all of it while the others are quiet.
    cache = open_kv_cache(
        spec,
        engine="kvcached-demo",
        driver=driver,
        capacity_bytes=config["capacity"],
        layout=True,
        config=get_config(),
    )
    instance = current_instance()
    try:
        _say(
            {
                "ready": True,
                "name": instance.name,
                "page_bytes": cache.geometry.page_bytes,
                "blocks_per_page": cache.blocks_per_page,
                "num_blocks": cache.num_blocks,
            }
        )
        line = sys.stdin.readline()
        if not line:
            return 0  # the demo went away before it started
        plan = json.loads(line)
        trace = [Request(*r) for r in plan["trace"]]
        served = Served(trace, cache.alloc, cache.free)
        source = cache.control_source
        t0, tick_s = plan["t0"], plan["tick_s"]
        peak_mapped = 0
        for tick in range(plan["ticks"]):
            delay = t0 + tick * tick_s - time.time()
            if delay > 0:
                time.sleep(delay)
            served.step(tick)
            source.misses = served.misses  # published in the snapshot
            peak_mapped = max(peak_mapped, cache.usage().bytes_mapped)
        served.finish()
        _say(
            {
                "done": True,
                "name": instance.name,
                "requests": served.requests,
                "admitted": served.admitted,
                "finished": served.finished,
                "delayed": served.delayed,
                "misses": served.misses,
                "preempted": served.preempted,
                "peak_blocks": served.peak_blocks,
                "peak_mapped_bytes": peak_mapped,
            }
        )
        return 0
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the demo reports
        return 130
    finally:
        close_kv_cache(cache)
        instance.close()


if __name__ == "__main__":
    sys.exit(main())
