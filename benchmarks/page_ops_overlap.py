"""What running page ops beside a vLLM step takes off its path, on the CPU.

A vLLM worker applies a step's page ops before the step's first kernel; with
overlap, those the step does not use run in the executor's thread beside it.
This drives the worker's own code (``worker.apply_step_ops``, what vLLM's
``execute_model`` runs first, over a ``PageExecutor``) through ``--steps`` steps, a step being ``--step-ms`` of
small torch ops on one thread (an eager step's kernel launches: Python that
releases the GIL at every op). Every ``--every``-th step carries one page op,
alternately the map of a new page (a reserve refill) and the unmap of the
oldest (a release), as the H100 serving run's ~16 page maps a second do. Each
round runs the same steps four ways, in a rotated order: every op before the
step (``sync``, the baseline), the ops beside it (``sync=0``) as the executor
runs them, each step waiting for those beside the step before it (``overlap``:
the switch interval shortened while they run,
``executor.OVERLAP_SWITCH_INTERVAL_S``; vLLM's order from #34 until 3636916),
the same with the process' own 5 ms interval (``overlap_long``: the executor
before that change), and with the planner's wait rule of 3636916
(``wait_rule``, vLLM's order now): a step waits for the ops beside earlier
steps only ``planner.BESIDE_STEPS_MAX`` steps after them, as where no step
takes a page they map (these steps use none: a bound, for steps that rarely do).

The host backend maps memfds in microseconds; a GPU's per-handle calls cost
tens (``../shared/DESIGN.md``, H200 p50): ``--driver-delays h200`` adds those
latencies through the fault driver's ``delay_s`` (a sleep, which releases the
GIL as a driver call does), ``none`` measures the host alone. A page has
``--lanes`` handles (32: an 8B model's per-layer layout, 2 MiB each).

    python benchmarks/page_ops_overlap.py   # -> benchmarks/results/page-ops-overlap.json

What this cannot say: whether a GPU driver lets kernel launches proceed while
another thread maps, which only a GPU run shows (``map_beside_kernels.py``: it
does). Every op before its step, the baseline here, is no longer a setting (#34).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import _provenance
from kvcached.driver.faulty import FaultyDriver
from kvcached.driver.host import HostDriver
from kvcached.integrations.vllm import executor as executor_module
from kvcached.integrations.vllm import worker
from kvcached.integrations.vllm.executor import PageExecutor
from kvcached.integrations.vllm.planner import BESIDE_STEPS_MAX
from kvcached.memory.planned import MAP, UNMAP
from kvcached.memory.ranges import PageLanes
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parent.parent

#: Per-call latency of the H200's VMM calls, 2 MiB handles, p50 (DESIGN.md).
H200_DELAYS_S = {
    "create": 14e-6,
    "map": 2.5e-6,
    "set_access": 30e-6,
    "unmap": 20e-6,
    "release": 11e-6,
}
HOST_DEVICE = 47  # a host device of this benchmark alone
KEEP_MAPPED = 4  # pages mapped beside page 0 before the oldest is released


def step_work(ops_per_step: int, t: torch.Tensor) -> None:
    for _ in range(ops_per_step):
        t.add_(1)


def calibrate(step_ms: float, t: torch.Tensor) -> int:
    """Torch ops that take about ``step_ms`` on this thread."""
    n = 1000
    start = time.perf_counter()
    step_work(n, t)
    per_op = (time.perf_counter() - start) / n
    return max(1, int(step_ms / 1e3 / per_op))


def schedule(steps: int, every: int, num_pages: int) -> list[list[tuple[str, int, int]]]:
    """Each step's ops: every ``every``-th step maps the next page or, once
    :data:`KEEP_MAPPED` are mapped, unmaps the oldest (alternately)."""
    out: list[list[tuple[str, int, int]]] = []
    mapped: list[int] = []
    next_page = 1
    for k in range(steps):
        if k % every or k == 0:
            out.append([])
            continue
        if len(mapped) >= KEEP_MAPPED and (k // every) % 2 == 0:
            out.append([(UNMAP, mapped.pop(0), 1)])
        else:
            out.append([(MAP, next_page, 1)])
            mapped.append(next_page)
            next_page = next_page % (num_pages - 1) + 1
            while next_page in mapped:
                next_page = next_page % (num_pages - 1) + 1
    for page in mapped:  # leave the executor as found
        out.append([(UNMAP, page, 1)])
    return out


#: mode -> (ops beside the step, the executor's switch interval while they run,
#: whether a step waits for the ops beside earlier steps only as the planner asks)
MODES = {
    "sync": (False, None, False),
    "overlap": (True, executor_module.OVERLAP_SWITCH_INTERVAL_S, False),
    "overlap_long": (True, None, False),
    "wait_rule": (True, executor_module.OVERLAP_SWITCH_INTERVAL_S, True),
}


def run_steps(
    plan: list[list[tuple[str, int, int]]], mode: str, ops_per_step: int, t: torch.Tensor
) -> dict[str, float]:
    overlap, executor_module.OVERLAP_SWITCH_INTERVAL_S, wait_rule = MODES[mode]
    apply_s = 0.0
    op_steps = 0
    beside_since: int | None = None  # the first step with ops beside it not yet waited for
    start = time.perf_counter()
    for k, ops in enumerate(plan):
        # What the engine core attaches to a step: with overlap, none of these
        # ops is used by its own step (the planner's split puts them all after).
        output = SimpleNamespace(kvcached_ops=ops, kvcached_sync=0 if overlap else len(ops))
        if wait_rule:
            # StepPlanner.step_waits where no step takes a page an op beside maps
            # (these steps use none): a wait only BESIDE_STEPS_MAX steps on.
            output.kvcached_wait = beside_since is not None and k - beside_since >= BESIDE_STEPS_MAX
            if output.kvcached_wait:
                beside_since = None
            if ops and beside_since is None:
                beside_since = k
        op_steps += bool(ops)
        t0 = time.perf_counter()
        worker.apply_step_ops(output)
        apply_s += time.perf_counter() - t0
        step_work(ops_per_step, t)
    worker._apply_ops([])
    wall = time.perf_counter() - start
    return {
        "step_ms": 1e3 * wall / len(plan),
        # applying, and with overlap finishing, counted at whichever step waited
        "main_thread_ms_per_page_op": 1e3 * apply_s / max(1, op_steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--every", type=int, default=4, help="a step with a page op every N")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--lanes", type=int, default=32, help="handles of 2 MiB per page")
    parser.add_argument("--driver-delays", choices=("h200", "none"), default="h200")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/page-ops-overlap.json"))
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "every", "lanes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    block = _provenance.start(argv)

    torch.set_num_threads(1)
    t = torch.zeros(16)
    ops_per_step = calibrate(args.step_ms, t)
    lane = 2 * MIB
    num_pages = KEEP_MAPPED + 4
    lanes = PageLanes(
        size=args.lanes * num_pages * lane,
        lanes=tuple((i * num_pages * lane, lane) for i in range(args.lanes)),
        num_pages=num_pages,
        blocks_per_page=1,
        granularity=lane,
    )
    host = HostDriver(HOST_DEVICE, capacity=(KEEP_MAPPED + 2) * args.lanes * lane)
    delays = H200_DELAYS_S if args.driver_delays == "h200" else {}
    driver = FaultyDriver(host, delay_s=delays)
    executor = PageExecutor(driver, lanes, calibrate=False)
    worker.WORKER.executor, worker.WORKER.world_size = executor, 1
    plan = schedule(args.steps, args.every, num_pages)
    rounds: list[dict[str, Any]] = []
    modes = list(MODES)
    interval = executor_module.OVERLAP_SWITCH_INTERVAL_S
    try:
        for k in range(args.rounds):
            order = modes[k % len(modes) :] + modes[: k % len(modes)]
            r: dict[str, Any] = {m: run_steps(plan, m, ops_per_step, t) for m in order}
            r["step_time_ratio"] = r["overlap"]["step_ms"] / r["sync"]["step_ms"]
            r["long_interval_ratio"] = r["overlap_long"]["step_ms"] / r["sync"]["step_ms"]
            r["wait_rule_ratio"] = r["wait_rule"]["step_ms"] / r["sync"]["step_ms"]
            rounds.append(r)
            print(
                f"round {k}: step time overlap/sync {r['step_time_ratio']:.4f}, with the "
                f"5 ms interval {r['long_interval_ratio']:.4f}, with the wait rule "
                f"{r['wait_rule_ratio']:.4f}",
                flush=True,
            )
    finally:
        executor_module.OVERLAP_SWITCH_INTERVAL_S = interval
        worker.WORKER.executor = None
        executor.close()
        host.close()

    ratios = [r["step_time_ratio"] for r in rounds]
    long_ratios = [r["long_interval_ratio"] for r in rounds]
    rule_ratios = [r["wait_rule_ratio"] for r in rounds]

    def median(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    result = {
        "benchmark": "page_ops_overlap",
        "baseline": "every page op applied before its step (the order before #34)",
        "candidate": "page ops beside the step (sync=0, vLLM's order since #34), the "
        f"switch interval {interval} s while they run",
        "step_time_ratio": statistics.median(ratios),
        "step_time_ratio_range": [min(ratios), max(ratios)],
        "long_interval_ratio": statistics.median(long_ratios),
        "long_interval_ratio_range": [min(long_ratios), max(long_ratios)],
        "wait_rule_ratio": statistics.median(rule_ratios),
        "wait_rule_ratio_range": [min(rule_ratios), max(rule_ratios)],
        "step_ms": {m: median(m, "step_ms") for m in modes},
        "main_thread_ms_per_page_op": {m: median(m, "main_thread_ms_per_page_op") for m in modes},
        "settings": {**vars(args), "ops_per_step": ops_per_step, "driver_delays_s": delays},
        "rounds": rounds,
    }
    _provenance.write_result(args.out, result, block)
    print(
        f"step time overlap/sync {result['step_time_ratio']:.4f} "
        f"({min(ratios):.4f}-{max(ratios):.4f}), with the 5 ms interval "
        f"{result['long_interval_ratio']:.4f}, with the wait rule "
        f"{result['wait_rule_ratio']:.4f}; main thread per page op "
        f"{result['main_thread_ms_per_page_op']['sync']:.3f} ms -> "
        f"{result['main_thread_ms_per_page_op']['overlap']:.3f} ms "
        f"({result['main_thread_ms_per_page_op']['overlap_long']:.3f} ms with 5 ms)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
