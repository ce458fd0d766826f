"""Three models sharing one KV budget (kvcached) against a static split (native
vLLM), on the real vLLM CPU engine, under intermittent peaks.

Three vLLM CPU servers of tiny Llamas run at a time. ``kvcached``: every server
has ``ENABLE_KVCACHED=true`` and its own ``KVCACHED_IPC_NAME``, and all three
share one host device (``KVCACHED_HOST_DEVICE``, ``KVCACHED_HOST_CAPACITY``)
and its ledger: each may grow into the whole budget while the others leave it
free. ``native``: the same servers without kvcached, each with a static KV
cache of a third of that budget (``--kv-cache-memory-bytes``: vLLM's own KV
size setting; ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only). The budget is
what the kvcached ledger grants, ``capacity x KVCACHED_GPU_UTILIZATION``, so
both configurations have the same memory in all.

The trace (:mod:`multi_model_trace`) is one seeded file, replayed exactly by
both configurations: per model a ramp 0 -> peak -> low, staggered so that the
peaks partly overlap, at several peak levels. Per request: TTFT (first
streamed token), end-to-end latency, and the time it waited in vLLM's queue
(``queue_time_ms`` from ``--enable-per-request-metrics``). Per model, every
``--sample-s``: KV memory (kvcached: ``kvctl list --json``, the instance's
``used_bytes``; native: the engine's ``vllm:kv_cache_usage_perc`` from
``/metrics`` times its static size) and running / waiting requests.

Where the engines compute: ``--engine-cpus spread`` (the default) binds
model i's worker (its one OpenMP thread, ``VLLM_CPU_OMP_THREADS_BIND``) to
CPU i modulo the CPUs there are, so models whose peaks overlap (neighbours in
the stagger) compute on different CPUs; API servers, schedulers and this
client go where the kernel puts them. ``auto`` is vLLM's own binding, which
on a machine of two CPUs puts every engine's worker on CPU 0 and leaves CPU 1
to the rest (the runs before this option: three engines computing on one
core).

Configurations alternate in blocks (kvcached, native, then native, kvcached,
...), each block on freshly started servers running every peak once; each
configuration runs ``--rounds`` times, so round 0 against round 1 of the same
configuration is its control (the noise of the method). Results:
``benchmarks/results/multi-model-cpu.json`` (per peak mean / p50 / p99 TTFT of
both, ``mean_ttft_speedup`` and ``p99_ttft_speedup`` = native over kvcached,
keyed by peak, the controls, every run's load average and memory samples),
the per-request records beside it (``multi-model-cpu-requests.json``), and the
plots (``multi_model_plot.py``).

    python benchmarks/multi_model.py            # the full run (about 25 minutes)
    python benchmarks/multi_model.py --short    # one small peak, one round (CI)

:func:`launch` is the one place that starts a configuration's servers.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _provenance  # noqa: E402
from multi_model_trace import (  # noqa: E402
    TraceSpec,
    file_sha256,
    prompt_tokens,
    read_traces,
    write_traces,
)
from vllm_model import TINY_LLAMA_CONFIG  # noqa: E402
from vllm_server import SERVED_MODEL_NAME, ServerError, ServerOptions, VllmServer  # noqa: E402
from vllm_serving import group_cpu_s  # noqa: E402

MODELS = ("mm-a", "mm-b", "mm-c")
CONFIGS = ("kvcached", "native")
MIB = 1 << 20
#: The tiny Llama with 8 KV heads of 64: 4 KiB of KV per token, so a 4 MiB
#: kvcached page (2 layers x 2 MiB) holds 1024 tokens, and a budget of a few
#: dozen MiB is a handful of requests per model, as on a GPU at its peaks.
MODEL_CONFIG = {
    **TINY_LLAMA_CONFIG,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True)
class Setup:
    """The servers of one configuration (both use the same)."""

    capacity_mib: int = 40  #: the host device's capacity (KVCACHED_HOST_CAPACITY)
    utilization: float = 0.8  #: KVCACHED_GPU_UTILIZATION: the budget is capacity x this
    host_device: int = 61  #: KVCACHED_HOST_DEVICE: a device of these servers alone
    models: int = 3
    max_num_seqs: int = 128
    max_model_len: int = 1024
    #: The reserved-page pool (KVCACHED_MIN/MAX_RESERVED_PAGES): every idle
    #: pre-mapped page is one page of the shared budget the others cannot use.
    min_reserved: int = 0
    max_reserved: int = 1

    @property
    def budget_bytes(self) -> int:
        return int(self.capacity_mib * MIB * self.utilization)

    @property
    def static_bytes(self) -> int:
        """Each native server's KV cache: a third (1 / models) of the budget."""
        return self.budget_bytes // self.models


# -- servers ----------------------------------------------------------------------------------
def model_config(kv_heads: int, head_dim: int) -> dict[str, Any]:
    """The served model's ``config.json``: :data:`MODEL_CONFIG` with ``kv_heads``
    heads (query and KV alike) of ``head_dim``. More KV per token makes memory,
    not the CPU, what a peak runs out of first."""
    return {
        **MODEL_CONFIG,
        "num_attention_heads": kv_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


def write_models(directory: Path, count: int, config: dict[str, Any] = MODEL_CONFIG) -> list[Path]:
    """A model directory per served model (``config.json`` only: the servers
    load vLLM's dummy weights; outputs are ignored, lengths fixed by
    ``ignore_eos``)."""
    dirs = []
    for name in MODELS[:count]:
        d = directory / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=1))
        dirs.append(d)
    return dirs


def engine_cpu(spec: str, index: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for model ``index`` under ``--engine-cpus``
    (None: vLLM's own binding)."""
    if spec == "auto":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[index % len(cpus)])


def server_options(
    config: str, setup: Setup, name: str, ledger_dir: Path, cpu: str | None = None
) -> ServerOptions:
    if config not in CONFIGS:
        raise ValueError(f"config={config!r} is not valid: one of {CONFIGS}")
    kvcached = config == "kvcached"
    # kvcached: a virtual cache as large as the whole budget; native: its third.
    kv_bytes = setup.budget_bytes if kvcached else setup.static_bytes
    env = {}
    if kvcached:
        env = {
            "KVCACHED_LEDGER_DIR": str(ledger_dir),
            "KVCACHED_HOST_DEVICE": str(setup.host_device),
            "KVCACHED_HOST_CAPACITY": f"{setup.capacity_mib}M",
            "KVCACHED_GPU_UTILIZATION": str(setup.utilization),
            "KVCACHED_MIN_RESERVED_PAGES": str(setup.min_reserved),
            "KVCACHED_MAX_RESERVED_PAGES": str(setup.max_reserved),
        }
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    return ServerOptions(
        kvcached=kvcached,
        ipc_name=name if kvcached else None,
        load_format="dummy",
        # Every prompt is unique: a prefix cache would only hold idle blocks.
        prefix_caching=False,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.max_model_len,
        kv_cache_gib=None,
        extra_args=("--kv-cache-memory-bytes", str(kv_bytes), "--enable-per-request-metrics"),
        extra_env=env,
    )


def launch(
    config: str,
    setup: Setup,
    model_dirs: list[Path],
    workdir: Path,
    tag: str,
    engine_cpus: str = "spread",
) -> list[VllmServer]:
    """Start one configuration's servers (one per model, all at once) and
    return them ready, in model order. The one place a configuration is
    started: ``kvcached serve`` can take its place. On failure nothing is left
    running and :class:`ServerError` is raised."""
    ledger_dir = workdir / "ledger"
    ledger_dir.mkdir(parents=True, exist_ok=True)
    servers = [
        VllmServer(
            d,
            workdir / f"{tag}-{d.name}.log",
            server_options(config, setup, d.name, ledger_dir, engine_cpu(engine_cpus, i)),
        )
        for i, d in enumerate(model_dirs)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: list[VllmServer]) -> None:
    for s in servers:
        s.close()


# -- requests ---------------------------------------------------------------------------------
def send(port: int, prompt: list[int], max_tokens: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """One streamed greedy completion: TTFT, end-to-end, the engine's queue
    time, output tokens. Never raises for an HTTP or connection failure."""
    body = json.dumps(
        {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    out: dict[str, Any] = {
        "ok": False,
        "ttft_s": None,
        "e2e_s": None,
        "queue_s": None,
        "tokens": 0,
        "error": None,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    start = time.monotonic()
    try:
        conn.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return out
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and out["ttft_s"] is None:
                    out["ttft_s"] = time.monotonic() - start
                out["tokens"] += len(ids)
            queue_ms = (chunk.get("metrics") or {}).get("queue_time_ms")
            if queue_ms is not None:
                out["queue_s"] = queue_ms / 1e3
        out["e2e_s"] = time.monotonic() - start
        out["ok"] = out["ttft_s"] is not None and out["tokens"] == max_tokens
        if not out["ok"]:
            out["error"] = f"{out['tokens']} of {max_tokens} tokens"
    except (OSError, ValueError) as exc:
        out["error"] = repr(exc)
    finally:
        conn.close()
    return out


# -- sampling ---------------------------------------------------------------------------------
def engine_metrics(port: int) -> dict[str, float]:
    """``kv_cache_usage_perc``, ``num_requests_running`` and ``_waiting`` from
    the server's ``/metrics`` (empty if it does not answer)."""
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except OSError:
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name.split(":", 1)[1]] = out.get(name.split(":", 1)[1], 0.0) + float(
                    line.rsplit(" ", 1)[1]
                )
    return out


def _kvctl_json(*args: str) -> Any:
    """``kvctl ARGS --json`` run by kvctl's own code in this process (a new
    interpreter every sample would take CPU from the kvcached servers alone);
    None when it fails."""
    from kvcached.cli import kvctl

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            kvctl.main([*args, "--json"])
        except SystemExit:
            return None
    try:
        return json.loads(buf.getvalue() or "null")
    except ValueError:
        return None


def kvctl_ledger(ledger_dir: Path, gpu: str) -> dict[str, int]:
    """``kvctl gpus --json`` for ``gpu``: the ledger's budget, charges, batched
    refunds and headroom, in bytes (empty when not found)."""
    rows = _kvctl_json("gpus", "--ledger-dir", str(ledger_dir)) or []
    for g in rows:
        if g.get("gpu") == gpu:
            return {
                k: int(g[k])
                for k in ("budget_bytes", "charged_bytes", "released_bytes", "headroom_bytes")
            }
    return {}


def kvctl_used(ledger_dir: Path, gpu: str) -> dict[str, dict[str, int]]:
    """``kvctl list --json`` as ``{instance: {used_bytes, reserved_bytes,
    misses}}`` for the instances on ``gpu`` (misses: allocations the budget
    refused, so far)."""
    rows = _kvctl_json("list", "--ledger-dir", str(ledger_dir)) or []
    return {
        r["name"]: {
            "used_bytes": int(r["used_bytes"]),
            "reserved_bytes": int(r["reserved_bytes"]),
            "misses": int(r["misses"]),
        }
        for r in rows
        if r.get("gpu") == gpu and r.get("state") != "dead"
    }


class Sampler:
    """Every ``period_s``: per model its KV memory and running / waiting requests."""

    def __init__(
        self,
        config: str,
        setup: Setup,
        servers: list[VllmServer],
        ledger_dir: Path,
        period_s: float,
    ) -> None:
        self.config, self.setup, self.servers = config, setup, servers
        self.ledger_dir, self.period_s = ledger_dir, period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> Sampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample(self) -> dict[str, Any]:
        t = time.monotonic() - self._t0
        names = MODELS[: len(self.servers)]
        kv = (
            kvctl_used(self.ledger_dir, f"host-{self.setup.host_device}")
            if self.config == "kvcached"
            else {}
        )
        row: dict[str, Any] = {"t": round(t, 2)}
        if self.config == "kvcached":
            row["ledger"] = kvctl_ledger(self.ledger_dir, f"host-{self.setup.host_device}")
        for name, server in zip(names, self.servers, strict=True):
            m = engine_metrics(server.port)
            row[name] = {
                "kv_bytes": None,
                "running": m.get("num_requests_running"),
                "waiting": m.get("num_requests_waiting"),
            }
            if self.config == "kvcached":
                inst = kv.get(name, {})
                row[name]["kv_bytes"] = inst.get("used_bytes")
                row[name]["misses"] = inst.get("misses")
            elif m.get("kv_cache_usage_perc") is not None:
                row[name]["kv_bytes"] = int(m["kv_cache_usage_perc"] * self.setup.static_bytes)
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period_s)


# -- one run ----------------------------------------------------------------------------------
@dataclass
class Run:
    config: str
    round: int
    peak: float
    trace_seed: int
    loadavg_start: float = 0.0
    loadavg_end: float = 0.0
    wall_s: float = 0.0
    #: CPU seconds the servers' processes (API server, engine core, worker) used
    #: during the run, per model: less sensitive to other work on the machine
    #: than latency.
    cpu_s: list[float] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


def run_trace(
    config: str,
    rnd: int,
    setup: Setup,
    servers: list[VllmServer],
    trace: dict[str, Any],
    ledger_dir: Path,
    sample_s: float,
) -> Run:
    """Replay one trace against ``servers`` (request ``model`` i goes to
    server i) at its times; return every request's record and the samples."""
    run = Run(
        config,
        rnd,
        float(trace["spec"]["peak"]),
        int(trace["seed"]),
        loadavg_start=os.getloadavg()[0],
    )
    reqs = trace["requests"]
    prompts = [prompt_tokens(r["prompt_seed"], r["prompt_len"]) for r in reqs]
    results: list[dict[str, Any] | None] = [None] * len(reqs)
    late: list[float] = [0.0] * len(reqs)

    def one(i: int, t0: float) -> None:
        r = reqs[i]
        late[i] = time.monotonic() - t0 - r["t"]
        results[i] = send(servers[r["model"]].port, prompts[i], r["max_tokens"])

    cpu0 = [group_cpu_s(s) for s in servers]
    with (
        Sampler(config, setup, servers, ledger_dir, sample_s) as sampler,
        ThreadPoolExecutor(max_workers=max(8, len(reqs))) as pool,
    ):
        t0 = time.monotonic()
        for i, r in enumerate(reqs):
            delay = t0 + r["t"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, t0)
        pool.shutdown(wait=True)
        run.wall_s = time.monotonic() - t0
    run.samples = sampler.samples
    run.cpu_s = [round(group_cpu_s(s) - c, 3) for s, c in zip(servers, cpu0, strict=True)]
    run.loadavg_end = os.getloadavg()[0]
    for i, r in enumerate(reqs):
        res = results[i] or {"ok": False, "error": "not run"}
        run.requests.append(
            {"i": i, "model": r["model"], "t": r["t"], "late_s": round(late[i], 4), **res}
        )
    return run


def wait_idle(servers: list[VllmServer], timeout_s: float = 120.0) -> None:
    """Until no server has a request running or waiting (then 1 s more)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for s in servers:
            m = engine_metrics(s.port)
            busy += m.get("num_requests_running", 1.0) + m.get("num_requests_waiting", 0.0)
        if busy == 0:
            break
        time.sleep(0.5)
    time.sleep(1.0)


def warm_up(servers: list[VllmServer]) -> None:
    """A few requests per server, so no first-request cost lands in a run."""
    with ThreadPoolExecutor(max_workers=4 * len(servers)) as pool:
        futures = [
            pool.submit(send, s.port, prompt_tokens(10_000 + i, 200), 16)
            for s in servers
            for i in range(4)
        ]
        failed = [f.result()["error"] for f in futures if not f.result()["ok"]]
    if failed:
        raise ServerError(f"warm-up requests failed: {failed[0]}")


# -- statistics -------------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), q in 0..1."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, float]:
    n = len(values)
    return {
        "n": n,
        "mean": sum(values) / n if n else float("nan"),
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
    }


def run_summary(run: Run) -> dict[str, Any]:
    ok = [r for r in run.requests if r.get("ok")]
    return {
        "config": run.config,
        "round": run.round,
        "peak": run.peak,
        "trace_seed": run.trace_seed,
        "requests": len(run.requests),
        "failed": len(run.requests) - len(ok),
        "loadavg_1m_start": run.loadavg_start,
        "loadavg_1m_end": run.loadavg_end,
        "wall_s": round(run.wall_s, 2),
        "cpu_s": run.cpu_s,
        "cpu_ms_per_token": 1e3 * sum(run.cpu_s) / max(1, sum(r["tokens"] for r in ok)),
        "ttft_s": stats([r["ttft_s"] for r in ok]),
        "e2e_s": stats([r["e2e_s"] for r in ok]),
        "queue_s": stats([r["queue_s"] for r in ok if r.get("queue_s") is not None]),
        "client_late_s_max": max((r["late_s"] for r in run.requests), default=0.0),
        "samples": run.samples,
    }


def peak_key(peak: float) -> str:
    return f"{peak:g}"


def summarize(runs: list[Run], peaks: list[float]) -> dict[str, Any]:
    """Per peak and configuration the TTFT, end-to-end and queue statistics
    pooled over rounds; the speed-ups (native over kvcached); the controls
    (round 0 over round 1 of one configuration); the servers' CPU time per
    output token (``cpu_per_token_ratio``: kvcached over native)."""
    out: dict[str, Any] = {
        "ttft_s": {},
        "e2e_s": {},
        "queue_s": {},
        "mean_ttft_speedup": {},
        "p99_ttft_speedup": {},
        "p50_ttft_speedup": {},
        "mean_e2e_speedup": {},
        "cpu_ms_per_token": {},
        "cpu_per_token_ratio": {},
        "control": {},
    }
    for metric in ("ttft_s", "e2e_s", "queue_s"):
        for config in CONFIGS:
            out[metric][config] = {}
            for peak in peaks:
                vals = [
                    r[metric]
                    for run in runs
                    if run.config == config and run.peak == peak
                    for r in run.requests
                    if r.get("ok") and r.get(metric) is not None
                ]
                out[metric][config][peak_key(peak)] = stats(vals)
    for peak in peaks:
        k = peak_key(peak)
        kv, nat = out["ttft_s"]["kvcached"][k], out["ttft_s"]["native"][k]
        out["mean_ttft_speedup"][k] = nat["mean"] / kv["mean"]
        out["p99_ttft_speedup"][k] = nat["p99"] / kv["p99"]
        out["p50_ttft_speedup"][k] = nat["p50"] / kv["p50"]
        out["mean_e2e_speedup"][k] = (
            out["e2e_s"]["native"][k]["mean"] / out["e2e_s"]["kvcached"][k]["mean"]
        )
        cpu = {}
        for config in CONFIGS:
            sel = [run for run in runs if run.config == config and run.peak == peak]
            tokens = sum(r["tokens"] for run in sel for r in run.requests if r.get("ok"))
            cpu[config] = 1e3 * sum(sum(run.cpu_s) for run in sel) / max(1, tokens)
        out["cpu_ms_per_token"][k] = cpu
        out["cpu_per_token_ratio"][k] = cpu["kvcached"] / cpu["native"]
    for config in CONFIGS:
        ctrl: dict[str, dict[str, float]] = {"mean_ttft_ratio": {}, "p99_ttft_ratio": {}}
        for peak in peaks:
            by_round = sorted(
                (run for run in runs if run.config == config and run.peak == peak),
                key=lambda run: run.round,
            )
            if len(by_round) < 2:
                continue
            a = stats([r["ttft_s"] for r in by_round[0].requests if r.get("ok")])
            b = stats([r["ttft_s"] for r in by_round[1].requests if r.get("ok")])
            ctrl["mean_ttft_ratio"][peak_key(peak)] = a["mean"] / b["mean"]
            ctrl["p99_ttft_ratio"][peak_key(peak)] = a["p99"] / b["p99"]
        out["control"][config] = ctrl
    return out


# -- provenance -------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_1m_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
    }


def vllm_version() -> str:
    done = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return (
        done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout else "unknown"
    )


# -- main -------------------------------------------------------------------------------------
def trace_specs(args: argparse.Namespace) -> list[TraceSpec]:
    return [
        TraceSpec(
            peak=p,
            low=args.low,
            slope=args.slope,
            hold_s=args.hold_s,
            tail_s=args.tail_s,
            models=args.models,
            prompt_min=args.prompt_min,
            prompt_max=args.prompt_max,
            max_tokens=args.max_tokens,
            overlap=args.overlap,
        )
        for p in args.peaks
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--short", action="store_true", help="CI mode: one small peak, one round, a short trace"
    )
    ap.add_argument(
        "--peaks",
        type=float,
        nargs="+",
        default=None,
        help="peak rates in req/s per model (default 1 2 3 4; --short: 1)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs of each configuration (default 2: round 1 is the control)",
    )
    ap.add_argument("--models", type=int, default=3, choices=(2, 3))
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="replay this trace file instead of writing one from --seed",
    )
    ap.add_argument("--low", type=float, default=0.25)
    ap.add_argument("--slope", type=float, default=None, help="req/s per second (0.5)")
    ap.add_argument("--hold-s", type=float, default=None, help="seconds at the peak (8)")
    ap.add_argument("--tail-s", type=float, default=None)
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.5,
        help="share of a model's hold that the next model's ramp overlaps (0: one at a time)",
    )
    ap.add_argument("--prompt-min", type=int, default=192)
    ap.add_argument("--prompt-max", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens (128)")
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=MODEL_CONFIG["num_key_value_heads"],
        help="attention and KV heads of the served model",
    )
    ap.add_argument(
        "--head-dim",
        type=int,
        default=MODEL_CONFIG["head_dim"],
        help="head size (the CPU attention backend takes 32, 64, 80, 96, 112, 128, ...)",
    )
    ap.add_argument("--capacity-mib", type=int, default=Setup.capacity_mib)
    ap.add_argument("--utilization", type=float, default=Setup.utilization)
    ap.add_argument("--min-reserved", type=int, default=Setup.min_reserved)
    ap.add_argument("--max-reserved", type=int, default=Setup.max_reserved)
    ap.add_argument(
        "--sample-s", type=float, default=None, help="seconds between samples (0.5; --short: 0.2)"
    )
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument(
        "--engine-cpus",
        choices=("spread", "auto"),
        default="spread",
        help="spread: model i computes on CPU i mod n; auto: vLLM's own binding",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default benchmarks/results/multi-model-cpu.json; "
        "--short: in the work directory)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="logs, ledger, model dirs (default: a temporary directory)",
    )
    ap.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the PNGs beside --out (default: on unless --short)",
    )
    args = ap.parse_args(argv)
    short = args.short
    defaults = {
        "peaks": [1.0] if short else [1.0, 2.0, 3.0, 4.0],
        "rounds": 1 if short else 2,
        "slope": 1.0 if short else 0.5,
        "hold_s": 4.0 if short else 8.0,
        "tail_s": 2.0 if short else 6.0,
        "max_tokens": 32 if short else 128,
        # --short's requests are short: sample often enough to see them in flight.
        "sample_s": 0.2 if short else 0.5,
        "plot": not short,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be 1 or more")
    if not 0 < args.utilization <= 1:
        ap.error(f"--utilization {args.utilization}: must be in (0, 1]")
    return args


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: servers are stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvcached-multi-model-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or (
        workdir / "multi-model-cpu.json"
        if args.short
        else ROOT / "benchmarks" / "results" / "multi-model-cpu.json"
    )
    setup = Setup(
        capacity_mib=args.capacity_mib,
        utilization=args.utilization,
        models=args.models,
        min_reserved=args.min_reserved,
        max_reserved=args.max_reserved,
    )
    if args.trace is not None:
        trace_path = args.trace
        doc = read_traces(trace_path)
    else:
        trace_path = out.with_name(out.stem + "-trace.json")
        doc = write_traces(trace_path, trace_specs(args), args.seed)
    traces = doc["traces"]
    peaks = [float(t["spec"]["peak"]) for t in traces]
    prov = _provenance.start(argv)
    # The report's own commit fields, as the provenance block records them.
    info = {
        "machine": machine(),
        "vllm": vllm_version(),
        "commit": prov["commit"],
        "dirty": prov["tree_dirty"],
    }
    served = model_config(args.kv_heads, args.head_dim)
    model_dirs = write_models(workdir / "models", setup.models, served)
    runs: list[Run] = []
    print(
        f"budget {setup.budget_bytes / MIB:.1f} MiB, native {setup.static_bytes / MIB:.2f} "
        f"MiB each; peaks {peaks}; {args.rounds} round(s); trace {trace_path}",
        flush=True,
    )
    for rnd in range(args.rounds):
        order = args.configs if rnd % 2 == 0 else args.configs[::-1]
        for config in order:
            started = time.monotonic()
            servers = launch(
                config, setup, model_dirs, workdir, f"{config}-r{rnd}", args.engine_cpus
            )
            print(f"[{config} r{rnd}] ready in {time.monotonic() - started:.0f} s", flush=True)
            try:
                warm_up(servers)
                wait_idle(servers)
                for trace in traces:
                    run = run_trace(
                        config, rnd, setup, servers, trace, workdir / "ledger", args.sample_s
                    )
                    wait_idle(servers)
                    runs.append(run)
                    s = run_summary(run)
                    print(
                        f"[{config} r{rnd}] peak {run.peak:g}: {s['requests']} requests "
                        f"({s['failed']} failed), TTFT mean {s['ttft_s']['mean']:.3f} s "
                        f"p99 {s['ttft_s']['p99']:.3f} s, e2e mean {s['e2e_s']['mean']:.2f} "
                        f"s, load {run.loadavg_start:.1f}->{run.loadavg_end:.1f}",
                        flush=True,
                    )
            finally:
                stop(servers)
    summary = summarize(runs, peaks) if set(args.configs) == set(CONFIGS) else {}
    report: dict[str, Any] = {
        "benchmark": "multi_model",
        "command": " ".join(
            ["python", "benchmarks/multi_model.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **info,
        "short": args.short,
        "trace": {
            "file": str(
                trace_path.relative_to(ROOT) if trace_path.is_relative_to(ROOT) else trace_path
            ),
            "seed": int(doc["seed"]),
            "sha256": file_sha256(trace_path),
            "specs": [t["spec"] for t in traces],
        },
        "setup": {
            **asdict(setup),
            "budget_bytes": setup.budget_bytes,
            "static_bytes": setup.static_bytes,
            "models": list(MODELS[: setup.models]),
            "model_config": served,
            "kv_bytes_per_token": kv_bytes_per_token(served),
        },
        "configs": args.configs,
        "engine_cpus": {
            "mode": args.engine_cpus,
            "workers": [engine_cpu(args.engine_cpus, i) for i in range(setup.models)],
        },
        "peaks": [peak_key(p) for p in peaks],
        "rounds": args.rounds,
        **summary,
        "runs": [run_summary(r) for r in runs],
    }
    prov["command"] = report["command"]  # as given, also when main() is called in-process
    _provenance.write_result(out, report, prov, indent=1)
    raw = out.with_name(out.stem + "-requests.json")
    raw.write_text(
        json.dumps(
            [
                {"config": r.config, "round": r.round, "peak": r.peak, "requests": r.requests}
                for r in runs
            ],
            separators=(",", ":"),
        )
        + "\n"
    )
    for peak in report["peaks"] if summary else []:
        print(
            f"peak {peak}: mean TTFT speed-up {summary['mean_ttft_speedup'][peak]:.2f}x, "
            f"p99 {summary['p99_ttft_speedup'][peak]:.2f}x "
            f"(kvcached {summary['ttft_s']['kvcached'][peak]['mean']:.3f} s, "
            f"native {summary['ttft_s']['native'][peak]['mean']:.3f} s)"
        )
    print(f"-> {out}")
    if args.plot and summary:
        from multi_model_plot import plot_all, tag_of

        for path in plot_all(report, out.parent, tag_of(out)):
            print(f"-> {path}")
    return 0


def kv_bytes_per_token(c: dict[str, Any] = MODEL_CONFIG) -> int:
    return (
        2 * int(c["num_hidden_layers"]) * int(c["num_key_value_heads"]) * int(c["head_dim"]) * 2
    )  # K and V, bf16


if __name__ == "__main__":
    sys.exit(main())
