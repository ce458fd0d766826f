"""Run the GPU test plan's model cases: ``python -m tests.gpu.vllm_e2e --out DIR [--models ...]``.

Per model the three servers (kvcached contiguous, kvcached per-layer, native)
start together on the one GPU and run the same phases; each check is a bool
in ``DIR/summary.json`` (``{"cases": {CASE: {CHECK: bool}}}`` with commit,
command, device and vLLM version); every request and log finding goes to
``DIR/details.json``, the server logs to ``DIR/logs.tar.gz``.

Comparisons with native: greedy tokens must be equal, and each generated
token's top-5 logprobs within ``LOGPROB_TOL`` of native's. The kvcached and
native servers run the same kernels on the same bytes, so in one mode (eager,
or CUDA graphs) sequential outputs are expected bit-equal; the tolerance only
absorbs bf16 reduction-order differences should the attention kernel's split
depend on where memory lies, and is far below the gap between a right and a
wrong KV entry (random-weight logits move by >0.5 when a KV block is wrong).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.kvharness.gpu_models import MODELS, make_model
from benchmarks.kvharness.gpu_server import Server, log_findings
from tests.gpu.e2e_cases import (
    drive_each,
    ok_replies,
    run_phases,
    start_kvcached_first,
    without_top,
)
from tests.gpu.e2e_run import provenance, run_groups

LOGPROB_TOL = 0.05
READY_S = 600.0
#: 1/1000 of the capacity: more than one kvcached page on every model here
#: (qwen2.5-0.5b's page is 4,096 tokens of 11.4 M), far less than native's 25.21 vs 0.89 GiB.
PAGES_TOLERANCE = 1000

#: --runner: which of vLLM 0.26's model runners every server uses. "auto" is
#: vLLM's choice (V2 for dense generate models, V1 for MoE and hybrid ones).
RUNNERS: dict[str, dict[str, str]] = {
    "auto": {},
    "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"},
}

KINDS = {
    "kvcached-contiguous": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
    "kvcached-per-layer": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
    "native": {"ENABLE_KVCACHED": "false"},
}


def compare(ours: list[dict], native: list[dict]) -> tuple[bool, float, bool]:
    """(tokens equal, largest top-5 logprob gap over shared tokens, top-5 sets equal)."""
    equal, worst, sets = True, 0.0, True
    for a, b in zip(ours, native, strict=True):
        if a.get("tokens") != b.get("tokens"):
            equal = False
        for ta, tb in zip(a.get("top") or [], b.get("top") or [], strict=False):
            if set(ta) != set(tb):
                sets = False
            for tok in set(ta) & set(tb):
                worst = max(worst, abs(ta[tok] - tb[tok]))
    return equal, worst, sets


def model_cases(name: str, args: argparse.Namespace, details: dict) -> dict[str, dict]:
    spec = MODELS[name]
    t = time.time()
    path = make_model(name, Path(args.models_dir) / name, args.make_model)
    details.setdefault("make_model_s", {})[name] = round(time.time() - t, 1)
    kinds = [k for k in KINDS if k in args.kinds]
    servers: dict[str, Server] = {}
    for i, kind in enumerate(kinds):
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "KVCACHED_LOG_LEVEL": "info",
            "KVCACHED_IPC_NAME": f"e2e-{name}-{kind}",
            **KINDS[kind],
            **RUNNERS[args.runner],
        }
        extra = [
            "--max-model-len",
            str(spec["max_model_len"]),
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            *spec.get("args", []),
        ]
        if not args.graphs:
            extra.append("--enforce-eager")
        if kind == "native":
            extra += ["--gpu-memory-utilization", str(args.native_util)]
        servers[kind] = Server(
            f"{name}-{kind}",
            args.port + i,
            str(path),
            extra,
            env,
            Path(args.logs) / f"{name}-{kind}.log",
        )
    ready = start_kvcached_first(servers, READY_S)
    results = drive_each(servers, ready, lambda s: {"phases": run_phases(s, spec["tokenizer"])})
    checks: dict[str, dict] = {}
    native = results.get("native", {}).get("phases")
    for kind, r in results.items():
        c: dict[str, Any] = {"server_ready": r["ready_s"] is not None}
        ph = r.get("phases") or {}
        replies = [x for k, v in ph.items() if isinstance(v, list) for x in v]
        c["every_request_200_with_tokens"] = ok_replies(replies)
        c["alive_after_load"] = bool(r.get("alive_after_load"))
        c["clean_exit_within_90s"] = r["exit_s"] is not None
        found = log_findings(servers[kind].log, kind != "native")
        c["no_traceback_cuda_error_or_patch_failure"] = (
            found["no_traceback_or_cuda_error"] and not found["bad"]
        )
        key = "kvcached_active" if kind != "native" else "no_kvcached_line"
        c[key] = found[key]
        c["no_gpu_process_left"] = not r["gpu_process_left"]
        if args.runner != "auto":
            c["runner_as_asked"] = runner_as_asked(servers[kind].log, args.runner, kind)
        if kind != "native" and native and ph:
            seq_eq, seq_gap, seq_sets = compare(ph["gen_seq"], native["gen_seq"])
            apc_eq, apc_gap, apc_sets = True, 0.0, True
            for i in range(3):
                e, g, st = compare(ph[f"apc_{i}"], native[f"apc_{i}"])
                apc_eq, apc_gap, apc_sets = apc_eq and e, max(apc_gap, g), apc_sets and st
            c["gen_seq_tokens_equal_native"] = seq_eq
            c["apc_tokens_equal_native"] = apc_eq
            c["top5_logprobs_within_tol"] = (
                max(seq_gap, apc_gap) <= LOGPROB_TOL and seq_sets and apc_sets
            )
            cached = [[x.get("cached_tokens") for x in ph[f"apc_{i}"]] for i in range(3)]
            ncached = [[x.get("cached_tokens") for x in native[f"apc_{i}"]] for i in range(3)]
            c["cached_tokens_equal_native"] = cached == ncached and any(
                (v or 0) > 0 for row in cached for v in row
            )
            r["max_logprob_gap"] = max(seq_gap, apc_gap)
            r["cached_tokens"] = cached
        checks[f"{name}/{kind}"] = c
        details.setdefault("servers", {})[f"{name}/{kind}"] = {
            "ready_s": r["ready_s"],
            "exit_s": r["exit_s"],
            "log": found,
            "max_logprob_gap": r.get("max_logprob_gap"),
            "cached_tokens": r.get("cached_tokens"),
            "phases": without_top(ph),
        }
    co = [k for k in ("kvcached-contiguous", "kvcached-per-layer") if k in servers]
    if len(co) == 2:
        # Both started at the same moment: each must get the capacity it gets alone
        # (natively the second counts the first's memory as its own overhead).
        tokens = [kv_cache_tokens(servers[k].log) for k in co]
        details.setdefault("co_started", {})[name] = dict(zip(co, tokens, strict=True))
        checks[f"{name}/co-started"] = {
            "both_sized": all(t is not None for t in tokens),
            # Capacity is total x KVCACHED_GPU_UTILIZATION less the process' own
            # peak, rounded to pages; CUDA-graph capture moves that peak by a few
            # MiB, so "equal" is within one page of the larger's pages.
            "kv_capacity_equal": None not in tokens
            and abs(tokens[0] - tokens[1]) <= max(tokens) // PAGES_TOLERANCE,
        }
    return checks


def runner_as_asked(log: Path, runner: str, kind: str) -> bool:
    """vLLM says "Using V2 Model Runner" for V2 only; kvcached names the
    runner whose KV allocation it served."""
    text = log.read_text(errors="replace") if log.exists() else ""
    v2 = "Using V2 Model Runner" in text
    served = kind == "native" or f"{runner.upper()} runner's KV allocation patched" in text
    return v2 == (runner == "v2") and served


def kv_cache_tokens(log: Path) -> int | None:
    """vLLM's own "GPU KV cache size: N tokens" line."""
    for line in log.read_text(errors="replace").splitlines():
        if "GPU KV cache size:" in line:
            return int(line.rsplit(":", 1)[1].split()[0].replace(",", ""))
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m tests.gpu.vllm_e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--out", required=True, help="folder for summary.json, details.json, logs.tar.gz"
    )
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(MODELS))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (no --enforce-eager)")
    ap.add_argument(
        "--runner",
        default="auto",
        choices=list(RUNNERS),
        help="vLLM's model runner on every server (VLLM_USE_V2_MODEL_RUNNER); "
        "v1/v2 add the check runner_as_asked",
    )
    ap.add_argument(
        "--native-util",
        type=float,
        default=0.25,
        help="the native server's --gpu-memory-utilization (it shares the GPU)",
    )
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--models-dir", default="/tmp/e2e-models")
    ap.add_argument(
        "--make-model",
        default=".gpu/vllm/make_model.py",
        help="the gpu-vllm bundle's make_model.py",
    )
    ap.add_argument("--logs", default="/tmp/e2e-logs")
    ap.add_argument("--label", default="", help="appended to each case name (e.g. graphs)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        **provenance(argv, "tests.gpu.vllm_e2e"),
        "logprob_tol": LOGPROB_TOL,
        "cases": {},
    }
    details: dict[str, Any] = {"provenance": summary["provenance"]}
    groups = [(name, lambda name=name: model_cases(name, args, details)) for name in args.models]
    suffix = f"/{args.label}" if args.label else ""
    return run_groups(groups, "model", out, summary, details, args.logs, suffix=suffix)


if __name__ == "__main__":
    raise SystemExit(main())
