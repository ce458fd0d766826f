"""Do page ops in one thread slow the GPU work another thread launches?

kvcached's vLLM worker runs a step's refill maps and release unmaps in a thread
beside the step. ``driver_gil.py`` showed the
binding releases the GIL inside each call; what it cannot show is whether the
driver itself holds the step back while it maps: a lock that kernel launches
also need, or page-table work that stalls kernels already running. On the H100
kvcached's TTFT cost under CUDA graphs sits in the round where its cache grows
(``results/h100/page-path-graphs-pinned``), with every page op beside its step,
so this measures the step's side of an overlapped op directly.

A "step" is ``--kernels`` small kernels (a matmul and an add of
``--dim`` x ``--dim`` each), then a synchronize, timed on the CPU's clock, in
three shapes:

* ``launch``: each kernel launched from Python (an eager step, or the pieces a
  piecewise-graph prefill launches between its graphs);
* ``graph``: the same kernels captured once and replayed as one CUDA graph (a
  decode step under full graphs);
* ``gpu``: one long chain enqueued at once and timed with CUDA events, the
  GPU's own time with no launches left to wait for (page-table stalls only).

Each shape runs alone and with a page thread beside it that grows and releases
pages of ``--handles`` handles (create, map, set_access per handle; one unmap
and a release per handle: an 8B page of kvcached's per-layer layout), as
``driver_gil.py``'s page loop does, at the switch interval the worker sets
while overlapped ops run. Read-outs per shape: the median step time with pages
beside over alone (``step_ratio``) and the extra step time per page the thread
completed meanwhile (``us_per_page``), rounds rotating the order.

    python benchmarks/map_beside_kernels.py --out $OUT/map-beside-kernels.json

``--device cpu --backend host`` runs the same on this machine's CPU (a check of
the script, not of any driver).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import _provenance
from driver_gil import _PageLoop
from kvcached.driver import make_driver
from kvcached.integrations.vllm.executor import OVERLAP_SWITCH_INTERVAL_S

SHAPES = ("launch", "graph", "gpu")


def _step_fn(shape: str, device: str, dim: int, kernels: int) -> Callable[[], float]:
    """A function that runs one step and returns its time in seconds."""
    a = torch.randn(dim, dim, device=device, dtype=torch.float32)
    b = torch.randn(dim, dim, device=device, dtype=torch.float32)
    out = torch.empty_like(a)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def body() -> None:
        for _ in range(kernels):
            torch.matmul(a, b, out=out)
            out.add_(a)

    if shape == "launch" or device != "cuda":  # on the CPU every shape is a launch loop
        return _timed_cpu(body, sync)
    if shape == "graph":
        body()
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        sync()
        return _timed_cpu(graph.replay, sync)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def gpu_step() -> float:
        start.record()
        for _ in range(4):
            body()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return gpu_step


def _timed_cpu(run: Callable[[], None], sync: Callable[[], None]) -> Callable[[], float]:
    def step() -> float:
        t0 = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - t0

    return step


def _phase(step: Callable[[], float], loop: _PageLoop | None, seconds: float) -> dict[str, Any]:
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,)) if loop is not None else None
    pages0 = loop.pages if loop is not None else 0
    if thread is not None:
        thread.start()
    times: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        times.append(step())
    wall = time.perf_counter() - t0
    stop.set()
    if thread is not None:
        thread.join()
    return {
        "steps": len(times),
        "median_step_us": 1e6 * statistics.median(times),
        "mean_step_us": 1e6 * statistics.fmean(times),
        "pages": (loop.pages - pages0) if loop is not None else 0,
        "wall_s": wall,
    }


def measure(step: Callable[[], float], loop: _PageLoop, seconds: float, rounds: int) -> dict:
    for _ in range(20):
        step()
    per: dict[str, list[dict]] = {"alone": [], "beside": []}
    for r in range(rounds):
        order = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
        for name in order:
            per[name].append(_phase(step, loop if name == "beside" else None, seconds))
    ratios, extra = [], []
    for alone, beside in zip(per["alone"], per["beside"], strict=True):
        ratios.append(beside["mean_step_us"] / alone["mean_step_us"])
        added_us = (beside["mean_step_us"] - alone["mean_step_us"]) * beside["steps"]
        extra.append(added_us / max(1, beside["pages"]))
    med = statistics.median
    return {
        "step_ratio": med(ratios),
        "step_ratio_range": [min(ratios), max(ratios)],
        "us_per_page": med(extra),
        "us_per_page_range": [min(extra), max(extra)],
        "median_step_us_alone": med(p["median_step_us"] for p in per["alone"]),
        "median_step_us_beside": med(p["median_step_us"] for p in per["beside"]),
        "pages_per_s_beside": med(p["pages"] / p["wall_s"] for p in per["beside"]),
        "rounds": per,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "hip", "host"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--handles", type=int, default=32, help="handles per page (8B: 32 layers)")
    ap.add_argument("--kernels", type=int, default=100, help="matmul+add pairs per step")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=1.0, help="per phase")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu --backend host)")
    prov = _provenance.start()
    driver = make_driver(args.backend)
    loop = _PageLoop(driver, args.handles)
    previous = sys.getswitchinterval()
    interval = OVERLAP_SWITCH_INTERVAL_S or previous
    sys.setswitchinterval(interval)
    try:
        shapes = {
            s: measure(
                _step_fn(s, args.device, args.dim, args.kernels), loop, args.seconds, args.rounds
            )
            for s in args.shapes
        }
    finally:
        sys.setswitchinterval(previous)
        loop.close()
    result = {
        "device": driver.info().name,
        "torch_device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "backend": args.backend,
        "handles_per_page": args.handles,
        "handle_bytes": driver.granularity,
        "switch_interval_s": interval,
        "kernels_per_step": args.kernels,
        "dim": args.dim,
        "shapes": shapes,
    }
    _provenance.write_result(args.out, result, prov)
    for name, r in shapes.items():
        print(
            f"{name}: step {r['median_step_us_alone']:.0f} us alone, "
            f"{r['median_step_us_beside']:.0f} beside pages; ratio {r['step_ratio']:.3f} "
            f"({r['step_ratio_range'][0]:.3f}-{r['step_ratio_range'][1]:.3f}), "
            f"{r['us_per_page']:.0f} us a page ({r['pages_per_s_beside']:.0f} pages/s)"
        )
    driver.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
