"""What ``kvcached serve`` costs and what its sleep levels give, on vLLM's CPU build.

One real ``kvcached serve`` (the CLI) in front of a real vLLM CPU server of the
tiny Llama (kvcached on, the ``host`` backend). In each of ``--rounds``
alternating rounds the same load goes through the router and straight to the
engine, in the order router-direct on even rounds and direct-router on odd
ones, so a drift of the machine hits both alike:

* a request set: ``--requests`` streamed greedy completions, ``--concurrency``
  at a time, ``--max-tokens`` each (ignore_eos): throughput = output tokens /
  wall time. The two sides get prompts of the same lengths but different
  tokens (a prefix cache hit would favour whichever side came second), swapped
  every round;
* ``--ttft-probes`` single streamed requests, one at a time, router and
  direct interleaved: TTFT (time to the first streamed token) medians.

``proxy_throughput_ratio`` is the median over rounds of router / direct
throughput; ``proxy_ttft_p50_added_ms`` the median over rounds of the two TTFT
medians' difference. On a machine of few cores the router's own CPU time comes
out of the engine's, so each round also records the CPU seconds (from
``/proc``) of the router process and of the engine's process tree during the
router side's load: ``router_cpu_over_engine`` (median over rounds) is what
the router costs per token, as a fraction of what the engine spends.

Where each process runs: ``--engine-cpus`` (default: every CPU but the
last, "0" on two) holds the engine: its compute threads are bound there
(``VLLM_CPU_OMP_THREADS_BIND``) and, once it is up, every thread of its
process tree (API server, engine core, worker) is pinned there; the router
and this load client are pinned to the CPUs left. So, as on a GPU host,
where the engine computes on the GPU from cores of its own, the router's CPU
never comes out of the engine's, and the ratio shows what the router's path
itself costs a stream. ``--engine-cpus all`` pins nothing, as the runs
before this option did: vLLM's own binding then puts the worker's one OpenMP
thread on CPU 0 and leaves CPU 1 to the engine's API server and scheduler
process, where the router and the client compete with them; for the same
tokens a round's engine CPU varied 3.2-9.9 s and its throughput 400-1250
tok/s (serve-cpu-shared-cores.json, the run of 6e79fff).

Then the ``kv`` sleep, ``--wake-rounds`` times: ``POST /admin/models/M/sleep``
(the instance is held at zero; ``kv_sleep_released_fraction`` = KV bytes
released / bytes held before, from the ledger), then one streamed request to
the sleeping model and one to the woken model: ``kv_wake_ms_p50`` = median of
(sleeping TTFT - ready TTFT). Last, the ``stop`` level's cold start: a second
model (``start: lazy``, ``sleep: stop``) answers its first request (a start
from nothing) and, once stopped after its sleep, a second one:
``stop_cold_start_s``.

    python benchmarks/serve.py            # writes benchmarks/results/serve-cpu.json

Needs vLLM's CPU build and kvcached[serve] in this interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _provenance
from kvharness.vllm_model import write_tiny_llama
from kvharness.vllm_server import free_port, group_cpu_s, group_stats

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "host": platform.node(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def split_cpus(spec: str) -> tuple[set[int], set[int]]:
    """``(engine CPUs, router and client CPUs)`` for ``--engine-cpus``; two empty
    sets for "all" or a machine of one CPU (nothing pinned)."""
    cpus = sorted(os.sched_getaffinity(0))
    if spec == "all" or (not spec and len(cpus) < 2):
        return set(), set()
    if not spec:
        return set(cpus[:-1]), {cpus[-1]}
    try:
        engine = {int(c) for c in spec.split(",")}
    except ValueError:
        raise SystemExit(
            f"--engine-cpus {spec!r}: give CPU numbers like 0 or 0,1, or 'all'"
        ) from None
    other = set(cpus) - engine
    if not engine <= set(cpus) or not other:
        raise SystemExit(
            f"--engine-cpus {spec!r}: must be some, not all, of this process' CPUs {cpus}"
        )
    return engine, other


def pin_group(pgid: int, cpus: set[int]) -> int:
    """Pin every thread of process group ``pgid`` to ``cpus``; the threads pinned."""
    n = 0
    for pid, _ in group_stats(pgid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    n += 1
    return n


def provenance_start(result: dict[str, Any]) -> dict[str, Any]:
    """The ``provenance`` block every result file carries (the schema of
    ``benchmarks/_provenance.py``: commit, tree_dirty, command, machine, load averages)."""
    sha = result["commit"]
    m = result["machine"]
    return {
        "commit": sha.removesuffix("-dirty"),
        "tree_dirty": sha.endswith("-dirty"),
        "command": result["command"],
        "machine": {
            "host": m["host"],
            "platform": platform.platform(),
            "cpu": m["cpu"],
            "cpus": m["cpus"],
            "python": m["python"],
        },
        "load_average_start": [round(x, 2) for x in m["loadavg_at_start"]],
        "started_utc": _provenance.now_utc(),
    }


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def stream(port: int, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One streamed greedy completion: (TTFT seconds, output tokens)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.monotonic()
    ttft, tokens = -1.0, 0
    try:
        conn.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"port {port}: status {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft < 0:
                    ttft = time.monotonic() - start
                tokens += len(ids)
    finally:
        conn.close()
    return ttft, tokens


def load(
    port: int, model: str, batch: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, float]:
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream(port, model, p, max_tokens), batch))
    wall = time.monotonic() - start
    tokens = sum(t for _, t in results)
    return {
        "throughput_tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "ttft_p50_ms": 1000 * statistics.median(t for t, _ in results),
    }


def http_json(port: int, method: str, path: str, timeout: float = 600) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=b"" if method == "POST" else None)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def wait_for(check, timeout_s: float, what: str) -> Any:  # noqa: ANN001, ANN401
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--ttft-probes", type=int, default=8)
    p.add_argument("--wake-rounds", type=int, default=7)
    p.add_argument("--cold-starts", type=int, default=2, help="0 skips the stop level")
    p.add_argument(
        "--engine-cpus",
        default="",
        help="CPUs of the engine, e.g. '0' (default: every CPU but the last; the router "
        "and the client get the rest); 'all': no pinning, vLLM's own thread binding",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve-cpu.json"))
    p.add_argument("--workdir", default="")
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcached-serve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = write_tiny_llama(work / "tiny-llama", weights_seed=0)
    vargs = [
        "--load-format",
        "safetensors",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "32",
        "--seed",
        "0",
        "--enable-prefix-caching",
    ]
    engine_cpus, other_cpus = split_cpus(args.engine_cpus)
    engine_env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if engine_cpus:
        engine_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(engine_cpus)))
    port = free_port()
    models = [
        {
            "name": "bench",
            "model": str(model_dir),
            "args": vargs,
            "env": engine_env,
            "sleep": {"level": "kv", "idle_after": 86400},
            "startup_timeout": 1800,
            "wake_timeout": 600,
        }
    ]
    if args.cold_starts:
        models.append(
            {
                "name": "cold",
                "model": str(model_dir),
                "args": vargs,
                "env": engine_env,
                "start": "lazy",
                "sleep": {"level": "stop", "idle_after": 1, "stop_after": 1},
                "startup_timeout": 1800,
                "wake_timeout": 1800,
            }
        )
    cfg = {"port": port, "state_dir": str(work / "state"), "idle_check_s": 0.1, "models": models}
    (work / "serve.yaml").write_text(json.dumps(cfg))
    env = dict(
        os.environ,
        KVCACHED_LEDGER_DIR=str(work),
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.pop("KVCACHED_IPC_NAME", None)
    result: dict[str, Any] = {
        "benchmark": "serve",
        "commit": _provenance.commit_label(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "machine": machine(),
        "settings": vars(args),
    }
    provenance = provenance_start(result)
    with open(work / "serve.log", "ab") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvcached", "serve", str(work / "serve.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_for(lambda: http_json(port, "GET", "/ready")[0] == 200, 1800, "serve /ready")
        state = http_json(port, "GET", "/v1/models/bench/state")[1]
        # Each engine runs in a session of its own (its pid is its process group);
        # the serve process's own group is the router and supervisor alone.
        engine, engine_group = state["port"], state["pid"]
        if engine_cpus:
            pinned = pin_group(engine_group, engine_cpus)
            pin_group(serve.pid, other_cpus)  # the router
            os.sched_setaffinity(0, other_cpus)  # this client (its threads come later)
            result["pinning"] = {
                "engine_cpus": sorted(engine_cpus),
                "router_and_client_cpus": sorted(other_cpus),
                "engine_threads_pinned": pinned,
            }
            print(
                f"engine on CPUs {sorted(engine_cpus)} ({pinned} threads), router and "
                f"client on {sorted(other_cpus)}",
                flush=True,
            )
        rng = random.Random(1)
        targets = {"router": port, "direct": engine}
        warm = prompts(
            99, [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
        )
        for side in targets.values():
            load(side, "bench", warm, args.concurrency, args.max_tokens)
        rounds = []
        for r in range(args.rounds):
            lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
            sets = [prompts(1000 + 2 * r, lengths), prompts(1001 + 2 * r, lengths)]
            order = ["router", "direct"] if r % 2 == 0 else ["direct", "router"]
            entry: dict[str, Any] = {"order": order, "loadavg_1m": os.getloadavg()[0]}
            for i, side in enumerate(order):
                before = group_cpu_s(serve.pid), group_cpu_s(engine_group)
                entry[side] = load(
                    targets[side], "bench", sets[(i + r) % 2], args.concurrency, args.max_tokens
                )
                entry[side]["router_cpu_s"] = group_cpu_s(serve.pid) - before[0]
                entry[side]["engine_cpu_s"] = group_cpu_s(engine_group) - before[1]
            entry["router_cpu_over_engine"] = (
                entry["router"]["router_cpu_s"] / entry["router"]["engine_cpu_s"]
            )
            probe_lens = [
                rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.ttft_probes)
            ]
            probes: dict[str, list[float]] = {"router": [], "direct": []}
            for k, n in enumerate(probe_lens):
                pair = prompts(5000 + 100 * r + k, [n, n])
                for j, side in enumerate(order if k % 2 == 0 else order[::-1]):
                    probes[side].append(1000 * stream(targets[side], "bench", pair[j], 1)[0])
            entry["probe_ttft_ms"] = probes
            entry["throughput_ratio"] = (
                entry["router"]["throughput_tok_s"] / entry["direct"]["throughput_tok_s"]
            )
            entry["ttft_added_ms"] = statistics.median(probes["router"]) - statistics.median(
                probes["direct"]
            )
            rounds.append(entry)
            print(
                f"round {r}: throughput ratio {entry['throughput_ratio']:.3f}, TTFT added "
                f"{entry['ttft_added_ms']:+.2f} ms, router CPU "
                f"{entry['router_cpu_over_engine']:.3f} of the engine's "
                f"(load {entry['loadavg_1m']:.1f})",
                flush=True,
            )
        result["rounds"] = rounds
        ratios = [e["throughput_ratio"] for e in rounds]
        added = [e["ttft_added_ms"] for e in rounds]
        result["proxy_throughput_ratio"] = statistics.median(ratios)
        result["proxy_throughput_ratio_range"] = [min(ratios), max(ratios)]
        result["proxy_ttft_p50_added_ms"] = statistics.median(added)
        result["proxy_ttft_p50_added_ms_range"] = [min(added), max(added)]
        shares = [e["router_cpu_over_engine"] for e in rounds]
        result["router_cpu_over_engine"] = statistics.median(shares)
        result["router_cpu_over_engine_range"] = [min(shares), max(shares)]

        wakes = []
        for w in range(args.wake_rounds):
            load(port, "bench", prompts(7000 + w, [256] * 4), 4, 8)  # memory to release
            status, doc = http_json(port, "POST", "/admin/models/bench/sleep")
            if status != 200:
                raise SystemExit(f"sleep refused: {status} {doc}")
            a, b = prompts(8000 + w, [128, 128])
            sleeping_ttft = stream(port, "bench", a, 1)[0]
            ready_ttft = stream(port, "bench", b, 1)[0]
            wakes.append(
                {
                    "released_fraction": doc["kv_released_fraction"],
                    "released_bytes": doc["kv_released_bytes"],
                    "sleeping_ttft_ms": 1000 * sleeping_ttft,
                    "ready_ttft_ms": 1000 * ready_ttft,
                    "wake_ms": 1000 * (sleeping_ttft - ready_ttft),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
            print(
                f"wake {w}: released {doc['kv_released_fraction']}, wake "
                f"{wakes[-1]['wake_ms']:.1f} ms",
                flush=True,
            )
        result["kv_wakes"] = wakes
        result["kv_wake_ms_p50"] = statistics.median(x["wake_ms"] for x in wakes)
        result["kv_sleep_released_fraction"] = min(x["released_fraction"] or 0 for x in wakes)

        colds = []
        for c in range(args.cold_starts):
            if c:
                wait_for(
                    lambda: (
                        http_json(port, "GET", "/v1/models/cold/state")[1]["state"] == "stopped"
                    ),
                    600,
                    "the cold model to stop",
                )
            began = time.monotonic()
            ttft = stream(port, "cold", prompts(9000 + c, [64])[0], 1)[0]
            colds.append(
                {
                    "ttft_s": ttft,
                    "wall_s": time.monotonic() - began,
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
            print(f"cold start {c}: {ttft:.1f} s", flush=True)
        if colds:
            result["stop_cold_starts"] = colds
            result["stop_cold_start_s"] = statistics.median(x["ttft_s"] for x in colds)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(300)
        except subprocess.TimeoutExpired:
            serve.kill()
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["provenance"] = {
        **provenance,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "finished_utc": _provenance.now_utc(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    keys = (
        "proxy_throughput_ratio",
        "proxy_ttft_p50_added_ms",
        "kv_wake_ms_p50",
        "kv_sleep_released_fraction",
        "stop_cold_start_s",
    )
    print(json.dumps({k: result.get(k) for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
