"""Serving speed of a kvcached vLLM server on a GPU, as ratios against native vLLM.

Three servers of one model run side by side on the GPU, each started once and
warmed up: the baseline (native), the candidate (kvcached) and a control (a
second native server, the method's own noise). Every round sends the same
fresh open-loop request set to each server, one server at a time, in the
order A B C then C B A (a drift linear within the round hits all alike).
A request set is ``--requests`` prompts of ``--min-prompt``..``--max-prompt``
words, arriving as a seeded Poisson process at ``--rate`` requests/s, streamed,
greedy, ``--max-tokens`` output tokens each (``ignore_eos``).

Per server and round: throughput (output tokens over the wall time from the
first arrival to the last completion), p95 TTFT and p95 TPOT (per request,
(end - first token) / (tokens - 1)). The ratios are candidate over baseline
within a round; the result is their median with min and max over the rounds
(``throughput_ratio``, ``p95_ttft_ratio``, ``p95_tpot_ratio``), and the
control's under ``control``. Every round keeps each request's TTFT and TPOT, so
``pooled`` gives, for the candidate and the control, the p95 and mean over all
rounds' requests against the baseline's and the paired per-request TTFT
difference (each prompt reaches every server at the same offset). After
warm-up and every round, the candidate's page ops so far (``page_ops``: maps,
unmaps, ops overlapped with a step, from its ``kvctl`` snapshot), and
``page_ops_per_request`` over the rounds: what the driver did on the step path.
Written to ``benchmarks/results/h200/vllm-gpu.json`` (``--out``) with its
provenance block.

    python benchmarks/vllm_gpu.py --model llama-3.1-8b --device-args=--enforce-eager

Needs an interpreter that imports vLLM with kvcached installed (its entry point).
``--model`` names one of ``tests/gpu/vllm_e2e``'s models, made on the spot with
the gpu-vllm bundle's ``make_model.py`` (``--model-dir`` serves a folder
instead). ``--device-args`` passes arguments to every server.

A device call lasts at most 10 minutes: the result is written after every
round (``"complete": false`` until the last), and a round that would end past
``--deadline-s`` (counted from the start, with the servers' stop) is not begun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import _provenance
from kvharness.cpus import available, physical_cores, split_cores
from kvharness.gpu_models import MODELS, make_model
from kvharness.gpu_prompts import text, word_maker
from kvharness.gpu_server import Server

ROOT = Path(__file__).resolve().parent.parent

ROLES = ("baseline", "candidate", "control")
#: ``--start-order`` that starts every server at once.
TOGETHER = "together"
#: Seconds the three servers' stop may take (each within 90 s; usually a few).
STOP_S = 45.0
SNAPSHOT_S = 0.3  # an instance publishes its snapshot every 0.2 s (control.instance.TICK_S)


def stream(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: when each token arrived."""
    body = {
        "model": server.name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        server.url("/v1/completions"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent = time.monotonic()
    stamps: list[float] = []
    tokens = 0
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                # A chunk per step with tokens (text may be empty: a special token);
                # the last one carries only the usage.
                if chunk.get("choices"):
                    stamps.append(time.monotonic())
                usage = chunk.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens", 0)
    except Exception as exc:  # a failed request fails the run below
        return {"ok": False, "error": repr(exc)}
    if not stamps or tokens != max_tokens:
        return {"ok": False, "error": f"{tokens} of {max_tokens} tokens ({len(stamps)} chunks)"}
    n = len(stamps)
    return {
        "ok": True,
        "sent": sent,
        "ttft_s": stamps[0] - sent,
        "tpot_s": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0,
        "end": stamps[-1],
        "tokens": tokens,
    }


def open_loop(server: Server, prompts: list[str], gaps: list[float], max_tokens: int) -> dict:
    """Send ``prompts`` at the given inter-arrival gaps, each in its own thread."""
    results: list[dict] = [{} for _ in prompts]
    threads = []
    start = time.monotonic()
    due = start
    for i, (prompt, gap) in enumerate(zip(prompts, gaps, strict=True)):
        due += gap
        time.sleep(max(0.0, due - time.monotonic()))
        th = threading.Thread(
            target=lambda i=i, p=prompt: results.__setitem__(i, stream(server, p, max_tokens))
        )
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    failed = [r.get("error") for r in results if not r.get("ok")]
    if failed:
        raise RuntimeError(f"{server.name}: {len(failed)} requests failed, e.g. {failed[0]}")
    wall = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "p95_ttft_s": p95([r["ttft_s"] for r in results]),
        "p95_tpot_s": p95([r["tpot_s"] for r in results]),
        "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in results),
        # per request, in request-set order: the same prompt at the same arrival
        # went to every server, so candidate and baseline pair request by request
        "ttft_ms": [round(r["ttft_s"] * 1e3, 2) for r in results],
        "tpot_ms": [round(r["tpot_s"] * 1e3, 3) for r in results],
    }


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def request_set(args: argparse.Namespace, seed: int) -> tuple[list[str], list[float]]:
    rng = random.Random(seed)
    words = word_maker(args.tokenizer, seed)
    prompts = [
        text(words, rng.randint(args.min_prompt, args.max_prompt)) for _ in range(args.requests)
    ]
    gaps = [rng.expovariate(args.rate) for _ in prompts]
    return prompts, gaps


def ratios(rounds: list[dict], role: str) -> dict[str, dict[str, float]]:
    out = {}
    for key, metric in (
        ("throughput_ratio", "throughput_tok_s"),
        ("p95_ttft_ratio", "p95_ttft_s"),
        ("p95_tpot_ratio", "p95_tpot_s"),
    ):
        values = [r[role][metric] / r["baseline"][metric] for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def pooled(rounds: list[dict], role: str) -> dict[str, Any]:
    """``role`` against the baseline over every request of every round: the p95
    and mean of all TTFTs and TPOTs pooled (a p95 of 64 requests is their 4th
    worst; pooled, of hundreds), and the paired per-request TTFT differences
    (same prompt, same arrival time), whose median resolves milliseconds."""

    def values(r: str, key: str) -> list[float]:
        return [v for rnd in rounds for v in rnd[r][key]]

    out: dict[str, Any] = {"requests": len(values(role, "ttft_ms"))}
    for key in ("ttft_ms", "tpot_ms"):
        mine, base = values(role, key), values("baseline", key)
        name = key.removesuffix("_ms")
        out[f"p95_{name}_ratio"] = p95(mine) / p95(base)
        out[f"mean_{name}_ratio"] = statistics.fmean(mine) / statistics.fmean(base)
    deltas = sorted(
        m - b for m, b in zip(values(role, "ttft_ms"), values("baseline", "ttft_ms"), strict=True)
    )
    out["paired_ttft_delta_ms"] = {
        "median": statistics.median(deltas),
        "mean": statistics.fmean(deltas),
        "p5": p95([-d for d in deltas]) * -1,
        "p95": p95(deltas),
    }
    return out


def per_round(rounds: list[dict], role: str) -> dict[str, list[float]]:
    """``role``'s mean TTFT and TPOT less the baseline's, in ms, round by round: a
    cost per decode step shows as a TPOT difference of one sign in every round
    (eager vLLM on the H100: kvcached +0.04-0.51 ms in all nine rounds at ec77bdf,
    the control -0.77-+0.46), which pooled ratios leave to the reader."""
    out: dict[str, list[float]] = {}
    for key in ("ttft_ms", "tpot_ms"):
        out[f"mean_{key}_over_baseline"] = [
            statistics.fmean(r[role][key]) - statistics.fmean(r["baseline"][key]) for r in rounds
        ]
    return out


def page_ops(instance: str) -> dict[str, int]:
    """The page ops ``instance`` sent its workers so far (its snapshot, at most
    one control tick old), summed over its pools."""
    from kvcached.control.snapshot import read_snapshots

    keys = ("page_maps", "page_unmaps", "page_ops_overlapped", "page_op_waits", "bytes_mapped")
    total = dict.fromkeys(keys, 0)
    for snap in read_snapshots(cleanup=False):
        if snap.instance == instance and snap.alive:
            for pool in snap.data.get("pools", []):
                for key in keys:
                    total[key] += int(pool.get(key, 0))
    return total


def per_request(before: dict[str, int], rounds: list[dict], requests: int) -> dict[str, float]:
    """Page ops per request from ``before`` to the last round's reading."""
    if not rounds or not requests:
        return {}
    after = rounds[-1]["page_ops"]
    return {key: (after[key] - before[key]) / requests for key in before if key != "bytes_mapped"}


def merge_halves(halves: list[dict]) -> dict[str, Any]:
    """One round of a server from its two halves: scalars averaged, per-request
    lists concatenated."""
    return {
        key: [v for h in halves for v in h[key]]
        if isinstance(halves[0][key], list)
        else statistics.fmean(h[key] for h in halves)
        for key in halves[0]
    }


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``--candidate-env`` values as a mapping; a malformed one is an error naming it."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--candidate-env {pair!r}: must be KEY=VALUE, e.g. KVCACHED_X=1")
        out[key] = value
    return out


def parse_order(text: str) -> tuple[str, ...]:
    """``--start-order``: the three roles, comma-separated, each once, or
    ``together`` (:data:`TOGETHER`)."""
    if text.strip() == TOGETHER:
        return (TOGETHER,)
    order = tuple(part.strip() for part in text.split(","))
    if sorted(order) != sorted(ROLES):
        raise SystemExit(
            f"--start-order {text!r}: must name {', '.join(ROLES)} once each, comma-separated, "
            f"e.g. candidate,baseline,control, or be {TOGETHER}"
        )
    return order


def server_setup(
    role: str, args: argparse.Namespace, together: bool
) -> tuple[list[str], dict[str, str]]:
    """A role's extra server arguments and environment. A native server gets
    ``--native-util`` (vLLM checks that much is free when it starts) and, with
    ``--native-kv-gib``, that KV cache exactly (vLLM then skips its memory
    profile). Servers started together compile into caches of their own, so
    that none reads another's half-written artifacts."""
    kvcached = role == "candidate"
    env = {
        "ENABLE_KVCACHED": "true" if kvcached else "false",
        "KVCACHED_IPC_NAME": f"bench-{role}",
        **(args.candidate_env if kvcached else {}),
    }
    if together:
        env["VLLM_CACHE_ROOT"] = str(Path(tempfile.gettempdir()) / f"vllm-cache-{role}")
    if kvcached:
        return [], env
    extra = ["--gpu-memory-utilization", str(args.native_util)]
    if args.native_kv_gib is not None:
        extra += ["--kv-cache-memory-bytes", str(int(args.native_kv_gib * 2**30))]
    return extra, env


def start_servers(servers: dict[str, Server], order: tuple[str, ...]) -> dict[str, float]:
    """Start ``servers`` in ``order``, each once the one before is ready, or all
    at once (``together``); seconds each took to be ready. Raises RuntimeError
    naming the log of one that did not start."""
    ready: dict[str, float] = {}
    batches = [list(servers)] if order == (TOGETHER,) else [[role] for role in order]
    for batch in batches:
        for role in batch:
            servers[role].start()
        for role in batch:
            took = servers[role].wait_ready(600)
            if took is None:
                raise RuntimeError(f"{role} did not start; log {servers[role].log}")
            ready[role] = took
    return ready


def gpu_name() -> str | None:
    """The card, as nvidia-smi names it (None where there is none)."""
    try:
        got = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return got.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--model-dir", help="serve this folder instead of making --model")
    ap.add_argument("--models-dir", default="/tmp/e2e-models")
    ap.add_argument("--make-model", default=".gpu/vllm/make_model.py")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="no round ends past it")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s, Poisson")
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--native-util", type=float, default=0.25)
    ap.add_argument("--device-args", default="", help="more server arguments, one string")
    ap.add_argument(
        "--candidate-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of the kvcached server only (repeatable), to "
        "measure a setting against native, e.g. KVCACHED_MIN_RESERVED_PAGES=20",
    )
    ap.add_argument(
        "--start-order",
        default="candidate,baseline,control",
        help="the order the servers start in, each alone (comma-separated roles): in eager "
        "runs on the H100 the servers' TPOT ranked in their start order (ec77bdf), so "
        "starting kvcached last tells a cost of kvcached from one of starting first; "
        f"'{TOGETHER}' starts all three at once (with --native-kv-gib): no server has a "
        "place, and the call saves two servers' start",
    )
    ap.add_argument(
        "--native-kv-gib",
        type=float,
        default=None,
        help="the native servers' KV cache in GiB (vLLM's --kv-cache-memory-bytes) instead "
        "of what their memory profile leaves under --native-util; needed by --start-order "
        f"{TOGETHER}",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="give each server its own equal share of whole physical cores and this "
        "client the rest (kvharness.cpus): an eager step is CPU-bound, and engines of "
        "the same code stepped up to 8%% apart from process to process on the H200",
    )
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--logs", default="/tmp/vllm-gpu-logs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/h200/vllm-gpu.json")
    args = ap.parse_args(argv)
    candidate_env = args.candidate_env = parse_env(args.candidate_env)
    start_order = parse_order(args.start_order)
    together = start_order == (TOGETHER,)
    if together and args.native_kv_gib is None:
        raise SystemExit(
            f"--start-order {TOGETHER} needs --native-kv-gib: a native server's memory "
            "profile would count what the others take meanwhile as its own (e.g. 6.07, what "
            "--native-util 0.28 gave an 8B on the H100: 'Available KV cache memory' in a "
            "sequential run's log)"
        )
    if args.native_kv_gib is not None and not args.native_kv_gib > 0:
        raise SystemExit(f"--native-kv-gib {args.native_kv_gib}: must be a size in GiB above 0")
    t0 = time.monotonic()
    block = _provenance.start(argv)
    block["machine"]["device"] = gpu_name()
    spec = MODELS[args.model]
    args.tokenizer = spec["tokenizer"]
    if args.model_dir is None:
        args.model_dir = str(make_model(args.model, Path(args.models_dir) / args.model,
                                        args.make_model))  # fmt: skip
    print(json.dumps({"model_ready_s": round(time.monotonic() - t0, 1)}), flush=True)
    common = [
        "--max-model-len",
        str(spec["max_model_len"]),
        "--seed",
        "0",
        *spec.get("args", []),
        *args.device_args.split(),
    ]
    pins: dict[str, list[int]] = {}
    if args.pin:
        sets, rest = split_cores(physical_cores(available()), len(ROLES), keep=1)
        pins = {**dict(zip(ROLES, sets, strict=True)), "client": rest}
        os.sched_setaffinity(0, rest)
    servers = {}
    for i, role in enumerate(ROLES):
        extra, env = server_setup(role, args, together)
        servers[role] = Server(
            f"bench-{role}",
            args.port + i,
            args.model_dir,
            [*common, *extra],
            env,
            Path(args.logs) / f"{role}.log",
            cpus=pins.get(role),
        )
    ready: dict[str, float] = {}
    rounds: list[dict] = []
    exits: dict[str, float | None] = {}
    warm_ops: dict[str, int] = {}

    def write(complete: bool) -> dict[str, Any]:
        result = {
            "complete": complete,
            **(ratios(rounds, "candidate") if rounds else {}),
            "control": ratios(rounds, "control") if rounds else {},
            "pooled": {r: pooled(rounds, r) for r in ("candidate", "control")} if rounds else {},
            "per_round": {r: per_round(rounds, r) for r in ("candidate", "control")},
            "rounds": rounds,
            "page_ops_after_warmup": warm_ops,
            "page_ops_per_request": per_request(warm_ops, rounds, len(rounds) * 2 * args.requests),
            "ready_s": ready,
            "exit_s": exits,
            "trace": {
                k: getattr(args, k)
                for k in ("requests", "rate", "min_prompt", "max_prompt", "max_tokens")
            },
            "model": args.model,
            "model_dir": args.model_dir,
            "candidate_env": candidate_env,
            "start_order": list(start_order),
            "cpus": pins or None,
        }
        _provenance.write_result(args.out, result, block)
        return result

    try:
        ready.update(start_servers(servers, start_order))
        warm = request_set(args, 0)[0][:16]
        for s in servers.values():
            open_loop(s, warm, [0.0] * len(warm), args.max_tokens)
        time.sleep(SNAPSHOT_S)
        warm_ops.update(page_ops(servers["candidate"].name))
        round_s = 0.0
        for k in range(args.rounds):
            if time.monotonic() - t0 + 1.2 * round_s + STOP_S > args.deadline_s:
                print(json.dumps({"deadline": f"round {k} not begun"}), flush=True)
                break
            began = time.monotonic()
            first, second = request_set(args, 1000 + 2 * k), request_set(args, 1001 + 2 * k)
            halves: dict[str, list[dict]] = {r: [] for r in ROLES}
            for order, (prompts, gaps) in ((ROLES, first), (ROLES[::-1], second)):
                for role in order:
                    halves[role].append(open_loop(servers[role], prompts, gaps, args.max_tokens))
            rounds.append({role: merge_halves(hs) for role, hs in halves.items()})
            time.sleep(SNAPSHOT_S)
            rounds[-1]["page_ops"] = page_ops(servers["candidate"].name)
            round_s = time.monotonic() - began
            print(json.dumps({"round": k, **ratios(rounds[-1:], "candidate")}), flush=True)
            write(complete=False)
    finally:
        exits.update({role: s.stop() for role, s in servers.items()})
    result = write(complete=len(rounds) == args.rounds)
    keys = ("throughput_ratio", "p95_ttft_ratio", "p95_tpot_ratio", "pooled")
    print(json.dumps({k: result.get(k) for k in keys}), flush=True)
    return 0 if rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
