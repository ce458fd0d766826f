"""The engine core's step, kvcached against native vLLM, part by part.

Serving runs (``vllm_gpu.py``) see kvcached's cost in TTFT and TPOT but not
where in the step it is. This runs vLLM's engine in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``LLM`` class) and times each step's
parts as the engine core calls them: the scheduler's ``schedule`` and
``update_from_output``, the executor's ``execute_model`` and ``sample_tokens``.
The same fixed batches (``--concurrency`` requests added at once,
``--max-tokens`` greedy tokens each, prompts of ``--min-prompt``..
``--max-prompt`` token ids) run in fresh processes, native and kvcached in
turn (``--pairs`` pairs, the order alternating), so a drift of the machine hits
both alike.

Per process: the median and mean step and each part's mean in microseconds.
The result: per pair, kvcached's median step over native's, and each part's
difference; over the pairs their medians (``step_ratio``, ``part_delta_us``).
The vLLM CPU build with the tiny Llama (the default) is a step of ~2 ms, mostly
Python, as an eager 8B step on an H100 is (14 ms, CPU-bound), so the
scheduler's share is plain to see on this machine:

    python benchmarks/vllm_step.py                       # vLLM CPU, tiny Llama
    python benchmarks/vllm_step.py --device gpu --model llama-3.1-8b --eager

``--device gpu`` makes ``--model`` with the gpu-vllm bundle's ``make_model.py``
(``tests/gpu/vllm_e2e``'s models) unless ``--model-dir`` names a folder.
Writes ``benchmarks/results/vllm-step-<device>.json`` (``--out``) with its
provenance block.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _provenance
from kvharness.cpus import parse_cpu_list, pinned_argv

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("schedule", "execute_model", "sample_tokens", "update_from_output")
CONFIGS = ("native", "kvcached")
LOAD = ("concurrency", "max_tokens", "min_prompt", "max_prompt", "rounds", "eager", "cpus")


# -- one engine, in a child process ----------------------------------------------------------
def _timed(obj: Any, name: str, totals: dict[str, float]) -> None:  # noqa: ANN401
    if not hasattr(obj, name):
        return
    inner = getattr(obj, name)
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += clock() - t

    setattr(obj, name, timed)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM(...)`` arguments of this run's model and device."""
    # disable_log_stats=False: the scheduler's stats each step, as a server makes them
    common: dict[str, Any] = {"model": args.model_dir, "seed": 0, "max_num_seqs": args.concurrency,
                              "enforce_eager": args.eager, "disable_log_stats": False}  # fmt: skip
    if args.device == "cpu":
        return {**common, "load_format": "dummy", "skip_tokenizer_init": True, "block_size": 32,
                "max_model_len": 1024}  # fmt: skip
    from kvharness.gpu_models import MODELS

    return {**common, "skip_tokenizer_init": True, "gpu_memory_utilization": args.native_util,
            "max_model_len": MODELS[args.model]["max_model_len"]}  # fmt: skip


def batches(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """The warm-up batch and ``--rounds`` batches of token-id prompts, seeded."""
    rng = random.Random(args.seed)
    return [
        [
            [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.concurrency)
        ]
        for _ in range(args.rounds + 1)
    ]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's steps over the batches (this process: ENABLE_KVCACHED set)."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(args))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the in-process client's EngineCore
    vocab = int(engine.model_config.get_vocab_size())
    totals = dict.fromkeys(PARTS, 0.0)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    warm, *rounds = batches(args, min(vocab, 30000))
    llm.generate([{"prompt_token_ids": p} for p in warm], sampling, use_tqdm=False)
    for name in ("schedule", "update_from_output"):
        _timed(core.scheduler, name, totals)
    for name in ("execute_model", "sample_tokens"):
        _timed(core.model_executor, name, totals)
    steps: list[float] = []
    clock = time.perf_counter
    profile = cProfile.Profile() if args.profile else None
    for k, batch in enumerate(rounds):
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{k}-{i}", {"prompt_token_ids": prompt}, sampling)
        if profile is not None:
            profile.enable()
        while engine.has_unfinished_requests():
            t = clock()
            engine.step()
            steps.append(clock() - t)
        if profile is not None:
            profile.disable()
    n = len(steps)
    out = {
        "steps": n,
        "median_step_us": statistics.median(steps) * 1e6,
        "mean_step_us": statistics.fmean(steps) * 1e6,
        "parts_us": {k: v / n * 1e6 for k, v in totals.items()},
        "kvcached_active": _kvcached_active(),
    }
    if profile is not None:
        out["profile"] = profile_table(pstats.Stats(profile), n)
    return out


#: whose functions a profile keeps: kvcached's and the engine core's (scheduler,
#: KV cache manager, block pool, worker)
PROFILED = ("/kvcached/", "/vllm/v1/core/", "/vllm/v1/worker/", "/vllm/v1/engine/core")


def profile_table(stats: pstats.Stats, steps: int) -> dict[str, list[float]]:
    """Per function of :data:`PROFILED`: calls, own and cumulative microseconds
    a step (cProfile's, so each call counts its profiling too), keyed
    ``folder/file:function``; functions under 1 us a step cumulative left out."""
    table = {}
    for (path, _line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(part in path for part in PROFILED) and cum / steps >= 1e-6:
            where = Path(path)
            key = f"{where.parent.name}/{where.name}:{name}"
            table[key] = [round(calls / steps, 2), round(own / steps * 1e6, 1),
                          round(cum / steps * 1e6, 1)]  # fmt: skip
    return table


def profile_delta(pair: dict[str, dict[str, Any]], top: int = 30) -> list[list[Any]]:
    """kvcached's profile less native's, the ``top`` functions by cumulative
    difference: ``[function, calls a step (native, kvcached), cumulative us
    a step (native, kvcached)]``; a function only kvcached runs has native 0."""
    mine, theirs = pair["kvcached"].get("profile", {}), pair["native"].get("profile", {})
    rows = []
    for key in set(mine) | set(theirs):
        k, n = mine.get(key, [0, 0, 0]), theirs.get(key, [0, 0, 0])
        rows.append([key, [n[0], k[0]], [n[2], k[2]]])
    rows.sort(key=lambda r: abs(r[2][1] - r[2][0]), reverse=True)
    return rows[:top]


def _kvcached_active() -> bool:
    try:
        from kvcached.integrations.vllm.state import STATE
    except ImportError:
        return False
    return bool(STATE.active)


# -- the pairs, in this process -------------------------------------------------------------------
def run_child(args: argparse.Namespace, config: str, argv: list[str]) -> dict[str, Any]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "ENABLE_KVCACHED": "true" if config == "kvcached" else "false",
           "KVCACHED_IPC_NAME": f"vllm-step-{os.getpid()}"}  # fmt: skip
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, __file__, *argv, "--child", "--model-dir", args.model_dir]
    if args.cpu_list:
        cmd = pinned_argv(cmd, args.cpu_list)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"steps"')]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-25:])
        raise RuntimeError(f"{config} engine failed (exit {done.returncode}):\n{tail}")
    got = json.loads(lines[-1])
    if got["kvcached_active"] != (config == "kvcached"):
        raise RuntimeError(f"{config} engine: kvcached active is {got['kvcached_active']}")
    return got


def summarize(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """kvcached against native over the pairs: the median step ratio and each
    part's difference in microseconds (median, min, max over the pairs)."""

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    def ratio(pair: dict[str, dict[str, Any]], key: str) -> float:
        return pair["kvcached"][key] / pair["native"][key]

    out: dict[str, Any] = {
        "step_ratio": spread([ratio(p, "median_step_us") for p in pairs]),
        "mean_step_ratio": spread([ratio(p, "mean_step_us") for p in pairs]),
        "part_delta_us": {},
        "native_parts_us": {},
    }
    for part in PARTS:
        mine = [p["kvcached"]["parts_us"][part] - p["native"]["parts_us"][part] for p in pairs]
        out["part_delta_us"][part] = spread(mine)
        out["native_parts_us"][part] = statistics.median(p["native"]["parts_us"][part]
                                                         for p in pairs)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--model", default="llama-3.1-8b", help="with --device gpu")
    ap.add_argument("--model-dir", help="serve this folder instead of making the model")
    ap.add_argument("--models-dir", default="/tmp/e2e-models")
    ap.add_argument("--make-model", default=".gpu/vllm/make_model.py")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (the CPU build is)")
    ap.add_argument("--native-util", type=float, default=0.5, help="with --device gpu")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="batches a process times")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="one engine process")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the timed steps (slower steps; the ratios then mean little) and "
        "write each pair's largest differences by function (profile_delta)",
    )
    ap.add_argument(
        "--cpus",
        default="",
        help="run every engine on these CPUs (e.g. 0-7): the same cores for native and "
        "kvcached, so that placement does not differ between the processes compared",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("concurrency", "max_tokens", "rounds", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error(f"--min-prompt {args.min_prompt} --max-prompt {args.max_prompt}: need "
                 "1 <= min <= max")  # fmt: skip
    try:
        args.cpu_list = parse_cpu_list(args.cpus) if args.cpus else None
    except ValueError as exc:
        ap.error(f"--cpus: {exc}")
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    block = _provenance.start(argv)
    if args.model_dir is None:
        if args.device == "cpu":
            from kvharness.vllm_model import write_tiny_llama

            args.model_dir = str(write_tiny_llama(Path(args.models_dir) / "tiny-llama", None))
            args.model = "tiny-llama"
        else:
            from kvharness.gpu_models import make_model

            args.model_dir = str(make_model(args.model, Path(args.models_dir) / args.model,
                                            args.make_model))  # fmt: skip
    out = args.out or ROOT / f"benchmarks/results/vllm-step-{args.device}.json"
    pairs: list[dict[str, dict[str, Any]]] = []
    for k in range(args.pairs):
        order = CONFIGS if k % 2 == 0 else CONFIGS[::-1]
        pair = {config: run_child(args, config, argv) for config in order}
        pairs.append(pair)
        print(json.dumps({"pair": k, "order": list(order),
                          "ratio": pair["kvcached"]["median_step_us"]
                          / pair["native"]["median_step_us"]}), flush=True)  # fmt: skip
        result = {
            "complete": len(pairs) == args.pairs,
            **summarize(pairs),
            "profile_delta": [profile_delta(p) for p in pairs] if args.profile else None,
            "pairs": pairs,
            "model": args.model,
            "device": args.device,
            "load": {name: getattr(args, name) for name in LOAD},
        }
        _provenance.write_result(out, result, block)
    print(json.dumps({k: result[k] for k in ("step_ratio", "part_delta_us")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
