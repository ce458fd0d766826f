"""Three models sharing one KV budget (kvcached) against a static split (native
vLLM) under intermittent peaks: on the real vLLM CPU engine (``--device cpu``,
the default, below) or on a GPU (``--device gpu``: three vLLM servers of an 8B
shape; the setup and why its trace differs from upstream's are in
:mod:`multi_model_gpu`).

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
``used_bytes``, and of it the idle ``reserved_bytes`` and ``prefix_cache_bytes``,
its ``misses`` and the idle ``yielded_bytes`` it released to neighbours so far;
native: the engine's ``vllm:kv_cache_usage_perc`` from ``/metrics`` times its
static size) and running / waiting requests.

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

**Sized to the card** (``--device gpu``, issue #33): the peaks come from
:mod:`gpu_plan` (the card's memory from nvidia-smi: the KV budget of three 8B
engines, the knee where a static third runs short, at least six peaks from well
below it to past it; on an H100 0.5 .. 3 req/s, on an H200 1.75 .. 10.5), and
the result's ``plan`` holds
that arithmetic with the ledger's measured budget. ``--peaks`` overrides. The
result goes to ``benchmarks/results/<card>/multi-model-gpu.json`` (``h100`` or
``h200``, from the card's name) unless ``--out`` says otherwise.

**In parts** (a device call lasts at most 10 minutes): ``--deadline-s`` (the
GPU's default 540) begins no configuration or peak that would end past it and
the result is written after every peak, ``"complete": false`` until every
(configuration, round, peak) ran; ``--resume RESULT`` keeps an earlier part's
runs (its ``-requests.json`` and ``-trace.json`` beside it), replays its trace
and runs only what it lacks; the result's ``calls`` names every call's commit,
command, card and the runs it added, so parts may come from several sessions
(``multi_model_merge.py`` joins separate sweeps whose measured code is the
same). With the gpu-vllm bundle (the H100 commands are in
``benchmarks/results/h100/README.md``)::

    source .gpu/vllm/install.sh >/dev/null && export PYTHONUNBUFFERED=1 \\
      KVCACHED_BENCH_COMMIT=<sha> && python benchmarks/multi_model.py --device gpu \\
      --out $OUT/multi-model-gpu.json [--resume benchmarks/results/h100/multi-model-gpu.json]

then commit what comes back (the JSON, its ``-requests.json``, ``-trace.json`` and
``-logs-<first block>.tar.gz``) under ``benchmarks/results/<card>/``
and resume from them in the next call. Requests still running ``--drain-s``
after a trace's last arrival are cut (the GPU's default 60 s: an overloaded
static split would otherwise hold a call for minutes); a cut request's TTFT,
if it had none yet, is the time it waited, a lower bound, so a cut favours
the configuration that queues (``cut`` and ``ttft_censored`` per run say how
many).

:class:`Configuration` is the one place that starts a configuration's servers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _provenance
from kvharness.vllm_model import TINY_LLAMA_CONFIG
from kvharness.vllm_server import SERVED_MODEL_NAME, ServerError, ServerOptions, VllmServer
from multi_model_client import Run, Target, run_trace, wait_idle, warm_up
from multi_model_gpu import (
    GIB,
    GPU_TRACE,
    SHAPE,
    GpuServers,
    GpuSetup,
    gpu_device,
    kv_plan,
    pack_logs,
    prepare_model,
)
from multi_model_stats import CONFIGS, peak_key, run_summary, summarize
from multi_model_trace import (
    TraceSpec,
    file_sha256,
    read_traces,
    upstream_delay,
    write_traces,
)

ROOT = Path(__file__).resolve().parent.parent

MODELS = ("mm-a", "mm-b", "mm-c")
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
    #: More KVCACHED_* settings for the kvcached servers (``--kvcached-env``).
    kvcached_env: tuple[tuple[str, str], ...] = ()

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
            **dict(setup.kvcached_env),
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


def targets_of(servers: list[VllmServer]) -> list[Target]:
    """The CPU servers as targets: each serves :data:`SERVED_MODEL_NAME` and is
    its own model's instance."""
    out = []
    for name, s in zip(MODELS, servers, strict=False):
        assert s.proc is not None
        out.append(Target(SERVED_MODEL_NAME, name, s.port, s.port, s.proc.pid))
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
#: Per device, the defaults of the trace and the run (``--device gpu``: see multi_model_gpu).
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {
        "peaks": [1.0, 2.0, 3.0, 4.0],
        "rounds": 2,
        "low": 0.25,
        "slope": 0.5,
        "hold_s": 8.0,
        "tail_s": 6.0,
        "prompt_min": 192,
        "prompt_max": 320,
        "max_tokens": 128,
        "upstream_delay": False,
        "sample_s": 0.5,
        "utilization": Setup.utilization,
        "drain_s": None,
        "deadline_s": None,
    },
    "gpu": {
        **{k: v for k, v in GPU_TRACE.items() if k != "upstream_delay"},
        "upstream_delay": GPU_TRACE["upstream_delay"],
        "rounds": 2,
        "sample_s": 1.0,
        "utilization": GpuSetup.utilization,
        "drain_s": 60.0,
        "deadline_s": 540.0,
    },
}
#: --short (CI): one small peak, one round, a short trace, on the CPU
SHORT = {
    "peaks": [1.0],
    "rounds": 1,
    "slope": 1.0,
    "hold_s": 4.0,
    "tail_s": 2.0,
    "max_tokens": 32,
    "sample_s": 0.2,  # its requests are short: sample often enough to see them in flight
    "plot": False,
}
#: seconds a configuration takes to start and warm up, and to stop (deadline estimates)
#: (GPU: three 8B engines were ready in 45-82 s on the H100, and stopped in under 1 s)
START_S = {"cpu": 120.0, "gpu": 120.0}
STOP_S = {"cpu": 30.0, "gpu": 20.0}


def trace_specs(args: argparse.Namespace) -> list[TraceSpec]:
    return [
        TraceSpec(
            peak=p,
            low=min(args.low, p),  # a peak below the low rate: flat at the peak
            slope=args.slope,
            hold_s=args.hold_s,
            tail_s=args.tail_s,
            models=args.models,
            prompt_min=args.prompt_min,
            prompt_max=args.prompt_max,
            max_tokens=args.max_tokens,
            overlap=args.overlap,
            model_delay_s=upstream_delay(p) if args.upstream_delay else None,
        )
        for p in args.peaks
    ]


def traces_at(traces: list[dict], peaks: list[float], source: Path) -> list[dict]:
    """The traces of ``peaks`` among those replayed from ``source`` (``--peaks``
    with ``--trace`` or ``--resume``: a subset of a committed trace, e.g. its
    lowest peaks, with the same arrivals and prompts)."""
    have = [float(t["spec"]["peak"]) for t in traces]
    missing = [p for p in peaks if p not in have]
    if missing:
        raise SystemExit(
            f"--peaks {' '.join(f'{p:g}' for p in missing)}: not in the trace {source} "
            f"(its peaks: {' '.join(f'{p:g}' for p in have)})"
        )
    return [t for t in traces if float(t["spec"]["peak"]) in peaks]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu: vLLM's CPU build, tiny Llamas; gpu: vLLM on the GPU, an 8B shape",
    )
    ap.add_argument(
        "--short", action="store_true", help="CI mode: one small peak, one round, a short trace"
    )
    ap.add_argument(
        "--peaks",
        type=float,
        nargs="+",
        default=None,
        help="peak rates in req/s per model (cpu: 1 2 3 4; gpu: sized to the card by "
        "gpu_plan, from well below the knee to past it, H100: 0.5..3; --short: 1); with "
        "--trace or --resume, which of the trace's peaks to run (default: all)",
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
    ap.add_argument("--low", type=float, default=None, help="req/s after the peak")
    ap.add_argument("--slope", type=float, default=None, help="req/s per second")
    ap.add_argument("--hold-s", type=float, default=None, help="seconds at the peak")
    ap.add_argument("--tail-s", type=float, default=None)
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.5,
        help="share of a model's hold that the next model's ramp overlaps (0: one at a time)",
    )
    ap.add_argument(
        "--upstream-delay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="models PEAK/4 + 2*PEAK s apart, as upstream (gpu: on; cpu: off, --overlap)",
    )
    ap.add_argument("--prompt-min", type=int, default=None)
    ap.add_argument("--prompt-max", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens")
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=MODEL_CONFIG["num_key_value_heads"],
        help="cpu: attention and KV heads of the served model",
    )
    ap.add_argument(
        "--head-dim",
        type=int,
        default=MODEL_CONFIG["head_dim"],
        help="cpu: head size (the CPU attention backend takes 32, 64, 80, 96, 112, 128, ...)",
    )
    ap.add_argument("--capacity-mib", type=int, default=Setup.capacity_mib, help="cpu")
    ap.add_argument(
        "--utilization",
        type=float,
        default=None,
        help="KVCACHED_GPU_UTILIZATION (cpu: 0.8 of --capacity-mib; gpu: 0.95)",
    )
    ap.add_argument("--min-reserved", type=int, default=Setup.min_reserved, help="cpu")
    ap.add_argument("--max-reserved", type=int, default=Setup.max_reserved, help="cpu")
    ap.add_argument("--sample-s", type=float, default=None, help="seconds between samples")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument(
        "--engine-cpus",
        choices=("spread", "auto"),
        default="spread",
        help="cpu: spread: model i computes on CPU i mod n; auto: vLLM's own binding",
    )
    ap.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="requests still running this long after a trace's last arrival are cut, "
        "their TTFT a lower bound (gpu: 60; cpu: never)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="from the start: begin no configuration or peak that would end past it "
        "(gpu: 540, one device call; cpu: none)",
    )
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a result of an earlier part (its -requests.json and -trace.json beside it): "
        "keep its runs, replay its trace, run only what it lacks",
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="gpu: serve this model folder")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/e2e-models"), help="gpu")
    ap.add_argument("--make-model", default=".gpu/vllm/make_model.py", help="gpu")
    ap.add_argument(
        "--device-args",
        default="--enforce-eager",
        help="gpu: extra arguments of every vLLM server, one string",
    )
    ap.add_argument("--base-port", type=int, default=GpuSetup.base_port, help="gpu")
    ap.add_argument(
        "--kvcached-env",
        action="append",
        default=[],
        metavar="KVCACHED_NAME=VALUE",
        help="one more setting for the kvcached servers (repeatable; recorded in the "
        "result's setup), e.g. KVCACHED_YIELD_IDLE=true",
    )
    ap.add_argument(
        "--kv-total-gib",
        type=float,
        default=None,
        help="gpu: the KV memory of all models together (native: a third each); "
        "default: the kvcached configuration's ledger budget once its servers are up",
    )
    ap.add_argument(
        "--assume-e2e-s",
        type=float,
        default=15.0,
        help="gpu: the end-to-end time the KV plan assumes per request (H100: 13-17 s)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (cpu: benchmarks/results/multi-model-cpu.json; gpu: "
        "benchmarks/results/<card>/multi-model-gpu.json, h100 or h200 from the card's name; "
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
        help="write the PNGs beside --out once every run is done (default: on unless --short)",
    )
    args = ap.parse_args(argv)
    if args.short and args.device != "cpu":
        ap.error("--short is the CPU's CI mode")
    # A replayed trace runs all its peaks unless --peaks picks some (a device's
    # default peaks only shape a new trace).
    args.peaks_given = args.peaks is not None
    defaults = {**DEFAULTS[args.device], "plot": True, **(SHORT if args.short else {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be 1 or more")
    if not 0 < args.utilization <= 1:
        ap.error(f"--utilization {args.utilization}: must be in (0, 1]")
    if args.resume is not None and not args.resume.is_file():
        ap.error(f"--resume {args.resume}: no such result file")
    try:
        args.kvcached_env = kvcached_env(args.kvcached_env)
    except ValueError as e:
        ap.error(f"--kvcached-env {e}")
    return args


#: Settings the harness gives the kvcached servers itself (its own options set them).
HARNESS_ENV = frozenset(
    {
        "ENABLE_KVCACHED",
        "KVCACHED_IPC_NAME",
        "KVCACHED_LEDGER_DIR",
        "KVCACHED_GPU_UTILIZATION",
        "KVCACHED_HOST_DEVICE",
        "KVCACHED_HOST_CAPACITY",
        "KVCACHED_MIN_RESERVED_PAGES",
        "KVCACHED_MAX_RESERVED_PAGES",
        "KVCACHED_LOG_LEVEL",
    }
)


def kvcached_env(items: list[str]) -> dict[str, str]:
    """``--kvcached-env`` items (``NAME=VALUE``) as a dict, each checked as
    kvcached itself reads it. Raises ValueError naming the bad item."""
    from kvcached.config import VARIABLES

    known = {v.name: v for v in VARIABLES}
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise ValueError(
                f"{item!r}: NAME=VALUE with NAME a kvcached setting (docs/configuration.md)"
            )
        if name in HARNESS_ENV:
            raise ValueError(f"{item!r}: {name} is set by the harness itself (see --help)")
        try:
            known[name].parse(value)
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
        out[name] = value
    return out


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: servers are stopped


@dataclass
class Previous:
    """An earlier part's result, read back for ``--resume``."""

    runs: list[Run]
    blocks: list[dict[str, Any]]
    trace_path: Path
    kv_total_bytes: int | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    kvcached_env: dict[str, str] = field(default_factory=dict)


def read_previous(result_path: Path) -> Previous:
    """The runs, blocks and trace of an earlier part (``result_path``, its
    ``-requests.json`` and ``-trace.json`` beside it). Raises ValueError naming
    the file that is missing or does not match."""
    result = json.loads(result_path.read_text())
    requests_path = result_path.with_name(result_path.stem + "-requests.json")
    trace_path = result_path.with_name(result_path.stem + "-trace.json")
    for p in (requests_path, trace_path):
        if not p.is_file():
            raise ValueError(f"--resume {result_path}: {p} is missing (written beside it)")
    recorded = (result.get("trace") or {}).get("sha256")
    if recorded and recorded != file_sha256(trace_path):
        raise ValueError(f"--resume {result_path}: {trace_path} is not the trace it ran")
    by_key = {
        (r["config"], r["round"], float(r["peak"])): r["requests"]
        for r in json.loads(requests_path.read_text())
    }
    runs = []
    for s in result.get("runs", []):
        key = (s["config"], s["round"], float(s["peak"]))
        if key not in by_key:
            raise ValueError(f"--resume {result_path}: {requests_path} lacks the run {key}")
        runs.append(
            Run(
                s["config"],
                s["round"],
                float(s["peak"]),
                int(s["trace_seed"]),
                loadavg_start=s.get("loadavg_1m_start", 0.0),
                loadavg_end=s.get("loadavg_1m_end", 0.0),
                wall_s=s.get("wall_s", 0.0),
                cpu_s=list(s.get("cpu_s", [])),
                requests=by_key[key],
                samples=list(s.get("samples", [])),
                drain_s=s.get("drain_s"),
            )
        )
    setup = result.get("setup") or {}
    return Previous(
        runs,
        list(result.get("blocks", [])),
        trace_path,
        setup.get("kv_total_bytes"),
        calls_of(result),
        dict(setup.get("kvcached_env") or {}),
    )


#: what a result's ``calls`` keep of each call's provenance block
CALL_KEYS = ("commit", "tree_dirty", "command", "started_utc", "finished_utc")


def calls_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls that made ``result`` (``calls``), or, for a result written before
    it kept them, its last call as its ``provenance`` block tells it (``known``
    says that the calls before it are not recorded)."""
    if result.get("calls"):
        return list(result["calls"])
    prov = result.get("provenance") or {}
    if not prov:
        return []
    return [
        {
            **{k: prov.get(k) for k in CALL_KEYS},
            "runs": None,
            "known": "the result's last call only: written before results kept their calls",
        }
    ]


def this_call(prov: dict[str, Any], gpu: dict[str, Any] | None, ran: list[Any]) -> dict[str, Any]:
    """One entry of ``calls``: this call's commit, command and times, its card
    and the runs it added (``config rN peak``): a result resumed over several
    calls, or sessions, says which code and machine measured each run."""
    return {
        **{k: prov.get(k) for k in CALL_KEYS},
        "finished_utc": _provenance.now_utc(),
        "gpu": (gpu or {}).get("name"),
        "host": (prov.get("machine") or {}).get("host"),
        "runs": [f"{r.config} r{r.round} {peak_key(r.peak)}" for r in ran],
    }


def long_tail_figures(path: Path) -> dict[str, Any]:
    """The long-tail scenario's figures (``benchmarks/long_tail.py``'s result
    beside this one), so that the GPU result carries ``models_per_gpu`` and its
    SLO; what is missing says so."""
    if not path.is_file():
        return {"source": path.name, "models_per_gpu": None, "note": "long_tail.py has not run"}
    lt = json.loads(path.read_text())
    return {
        "source": path.name,
        "complete": lt.get("complete"),
        "commit": lt.get("commit"),
        "models_per_gpu": lt.get("models_per_gpu"),
        "slo": lt.get("slo"),
        "goal": lt.get("goal"),
        "wake_s": lt.get("wake_s"),
    }


def remaining_s(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.monotonic()


def trace_need_s(trace: dict[str, Any], drain_s: float | None) -> float:
    """Seconds one trace takes at most: its arrivals, the drain, the idle wait."""
    arrivals = trace.get("duration_s") or TraceSpec(**trace["spec"]).duration_s
    return float(arrivals) + (drain_s if drain_s is not None else 60.0) + 15.0


class Configuration:
    """One configuration's servers on either device: :meth:`start` returns the
    targets, :meth:`close` stops them. The one place servers are started."""

    def __init__(
        self, args: argparse.Namespace, config: str, workdir: Path, tag: str, **device: Any
    ) -> None:
        self.args, self.config, self.workdir, self.tag = args, config, workdir, tag
        self.device = device
        self.record: dict[str, Any] = {"config": config, "tag": tag}
        self._cpu: list[VllmServer] = []
        self._gpu: GpuServers | None = None

    def start(self) -> list[Target]:
        began = time.monotonic()
        if self.args.device == "cpu":
            self._cpu = launch(
                self.config,
                self.device["setup"],
                self.device["model_dirs"],
                self.workdir,
                self.tag,
                self.args.engine_cpus,
            )
            targets = targets_of(self._cpu)
        else:
            self._gpu = GpuServers(
                self.device["setup"],
                self.config,
                self.workdir,
                self.tag,
                kv_share_bytes=self.device.get("kv_share_bytes"),
            )
            targets = self._gpu.start()
            self.record["ready_s"] = self._gpu.ready_s
        self.record["start_s"] = round(time.monotonic() - began, 1)
        return targets

    def kv_budget_bytes(self) -> int | None:
        return self._gpu.kv_budget_bytes() if self._gpu is not None else None

    def close(self) -> None:
        if self._gpu is not None:
            # The logs are read once the servers are gone: vLLM's API server writes its
            # shutdown traceback (``shutdown_tracebacks``) after the stop signal.
            self.record["stop_s"] = self._gpu.close()
            self.record["findings"] = self._gpu.findings()
            self._gpu = None
        stop(self._cpu)
        self._cpu = []


def write_requests(out: Path, runs: list[Any]) -> None:
    """Every run's requests beside the report ``out``, as ``<stem>-requests.json``."""
    out.with_name(out.stem + "-requests.json").write_text(
        json.dumps(
            [
                {"config": r.config, "round": r.round, "peak": r.peak, "requests": r.requests}
                for r in runs
            ],
            separators=(",", ":"),
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    gpu = args.device == "gpu"
    card = None
    if gpu:
        import gpu_plan

        card = gpu_plan.read_card()
        size_gpu_run(args, card)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvcached-multi-model-"))
    workdir.mkdir(parents=True, exist_ok=True)
    default_out = (
        card_results(card) / "multi-model-gpu.json"
        if gpu
        else ROOT / "benchmarks" / "results" / "multi-model-cpu.json"
    )
    out = args.out or (workdir / "multi-model-cpu.json" if args.short else default_out)
    previous = read_previous(args.resume) if args.resume is not None else None
    if previous is not None and previous.kvcached_env != args.kvcached_env:
        raise SystemExit(
            f"--resume {args.resume}: its kvcached servers ran with --kvcached-env "
            f"{previous.kvcached_env or 'none'}, this call with {args.kvcached_env or 'none'}: "
            "runs of one result share their settings"
        )
    # The trace lives beside the result, so that a later call can --resume it.
    trace_path = out.with_name(out.stem + "-trace.json")
    source = previous.trace_path if previous is not None else args.trace
    if source is not None:
        doc = read_traces(source)
        if source.resolve() != trace_path.resolve():
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, trace_path)
    else:
        doc = write_traces(trace_path, trace_specs(args), args.seed)
    traces = doc["traces"]
    if args.peaks_given and source is not None:
        traces = traces_at(traces, args.peaks, trace_path)
    peaks = [float(t["spec"]["peak"]) for t in traces]
    prov = _provenance.start(argv)
    info = {
        "machine": machine(),
        "vllm": vllm_version(),
        "commit": prov["commit"],
        "dirty": prov["tree_dirty"],
    }
    if gpu:
        info["gpu"] = gpu_device()
    runs: list[Run] = list(previous.runs) if previous else []
    resumed_runs = len(runs)
    earlier_calls = list(previous.calls) if previous else []
    blocks: list[dict[str, Any]] = list(previous.blocks) if previous else []
    done = {(r.config, r.round, r.peak) for r in runs}
    kv_total: int | None
    if gpu:
        model_dir = args.model_dir or prepare_model(args.models_dir, args.make_model)
        served = json.loads((model_dir / "config.json").read_text())
        gsetup = GpuSetup(
            model_dir=model_dir,
            models=MODELS[: args.models],
            base_port=args.base_port,
            utilization=args.utilization,
            device_args=tuple(args.device_args.split()),
            kvcached_env=tuple(sorted(args.kvcached_env.items())),
        )
        kv_total = (
            int(args.kv_total_gib * GIB)
            if args.kv_total_gib
            else (previous.kv_total_bytes if previous else None)
        )
        model_dirs: list[Path] = []
        setup = None
    else:
        setup = Setup(
            capacity_mib=args.capacity_mib,
            utilization=args.utilization,
            models=args.models,
            min_reserved=args.min_reserved,
            max_reserved=args.max_reserved,
            kvcached_env=tuple(sorted(args.kvcached_env.items())),
        )
        served = model_config(args.kv_heads, args.head_dim)
        model_dirs = write_models(workdir / "models", setup.models, served)
        kv_total = setup.budget_bytes
    per_token = kv_bytes_per_token(served)
    print(
        f"[{args.device}] KV for all models {'(measured at start)' if kv_total is None else f'{kv_total / MIB:.1f} MiB'}; "
        f"peaks {peaks}; {args.rounds} round(s); trace {trace_path}; "
        f"{len(runs)} run(s) resumed from {args.resume}",
        flush=True,
    )

    plans: dict[int | None, dict[str, Any]] = {}

    def planned(card: Any, kv_total: int | None, peaks: list[float]) -> dict[str, Any]:  # noqa: ANN401
        """The sizing arithmetic for the result, once per KV budget (the ledger's, once known)."""
        if kv_total not in plans:
            plans[kv_total] = gpu_run_plan(args, card, kv_total, peaks)
        return dict(plans[kv_total])

    def write(complete: bool) -> dict[str, Any]:
        configs_ran = tuple(c for c in CONFIGS if any(r.config == c for r in runs))
        summary = summarize(runs, peaks, configs_ran) if runs else {}
        share = kv_total // args.models if kv_total else None
        report: dict[str, Any] = {
            "benchmark": "multi_model",
            "device": args.device,
            "complete": complete,
            "command": " ".join(
                [
                    "python",
                    "benchmarks/multi_model.py",
                    *(argv if argv is not None else sys.argv[1:]),
                ]
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
                **(asdict(setup) if setup is not None else {}),
                **(
                    {
                        "shape": SHAPE,
                        "utilization": args.utilization,
                        "device_args": args.device_args,
                        "max_model_len": GpuSetup.max_model_len,
                        "max_num_seqs": GpuSetup.max_num_seqs,
                    }
                    if gpu
                    else {}
                ),
                "kv_total_bytes": kv_total,
                "budget_bytes": kv_total,
                "static_bytes": share,
                "models": list(MODELS[: args.models]),
                "model_config": served,
                "kv_bytes_per_token": per_token,
                "kvcached_env": args.kvcached_env,
            },
            "configs": args.configs,
            "drain_s": args.drain_s,
            "peaks": [peak_key(p) for p in peaks],
            "rounds": args.rounds,
            **summary,
            "blocks": blocks,
            "runs": [run_summary(r) for r in runs],
            "calls": [*earlier_calls, this_call(prov, info.get("gpu"), runs[resumed_runs:])],
        }
        if not gpu:
            report["engine_cpus"] = {
                "mode": args.engine_cpus,
                "workers": [engine_cpu(args.engine_cpus, i) for i in range(args.models)],
            }
        else:
            beside = out.with_name("long-tail-gpu.json")  # else the committed one of this card
            lt_path = beside if beside.is_file() else card_results(card) / "long-tail-gpu.json"
            report["long_tail"] = long_tail_figures(lt_path)
            report["models_per_gpu"] = report["long_tail"].get("models_per_gpu")
        if gpu:
            report["plan"] = planned(card, kv_total, peaks)
        if gpu and share:
            prompt_mean = (args.prompt_min + args.prompt_max) / 2
            report["plan"]["steady_state"] = {
                "note": "the arithmetic before issue #33: each peak held for a whole end to "
                "end; the no-hold trace never holds it, so this overstates what is in flight",
                "per_peak": [
                    kv_plan(p, prompt_mean, args.max_tokens, per_token, share, args.assume_e2e_s)
                    for p in peaks
                ],
            }
        prov["command"] = report["command"]  # as given, also when main() is called in-process
        _provenance.write_result(out, report, prov, indent=1)
        write_requests(out, runs)
        return report

    stopped = ""
    call_tag = ""
    for rnd in range(args.rounds):
        order = args.configs if rnd % 2 == 0 else args.configs[::-1]
        for config in order:
            todo = [t for t in traces if (config, rnd, float(t["spec"]["peak"])) not in done]
            if not todo or stopped:
                continue
            if config == "native" and kv_total is None:
                print(f"[native r{rnd}] skipped: its share comes from a kvcached block's ledger")
                continue
            need = START_S[args.device] + trace_need_s(todo[0], args.drain_s)
            if remaining_s(deadline) < need + STOP_S[args.device]:
                stopped = f"{config} r{rnd} not begun: {remaining_s(deadline):.0f} s left"
                print(f"[deadline] {stopped}", flush=True)
                continue
            device: dict[str, Any] = (
                {"setup": gsetup, "kv_share_bytes": kv_total // args.models if kv_total else None}
                if gpu
                else {"setup": setup, "model_dirs": model_dirs}
            )
            conf = Configuration(args, config, workdir, f"{config}-r{rnd}", **device)
            blocks.append(conf.record)
            try:
                targets = conf.start()
                print(f"[{config} r{rnd}] ready in {conf.record['start_s']:.0f} s", flush=True)
                warm_up(targets)
                wait_idle(targets)
                if gpu and config == "kvcached" and kv_total is None:
                    kv_total = conf.kv_budget_bytes()
                    print(f"[kvcached r{rnd}] KV budget {kv_total / GIB:.2f} GiB", flush=True)
                conf.record["kv_total_bytes"] = kv_total
                for trace in todo:
                    if (
                        remaining_s(deadline)
                        < trace_need_s(trace, args.drain_s) + STOP_S[args.device]
                    ):
                        stopped = f"{config} r{rnd} peak {trace['spec']['peak']:g} not begun"
                        print(f"[deadline] {stopped}", flush=True)
                        break
                    run = run_trace(
                        config,
                        rnd,
                        targets,
                        trace,
                        workdir / "ledger",
                        args.sample_s,
                        kv_total // args.models if kv_total else 0,
                        drain_s=args.drain_s,
                    )
                    wait_idle(targets)
                    runs.append(run)
                    done.add((config, rnd, run.peak))
                    s = run_summary(run)
                    print(
                        f"[{config} r{rnd}] peak {run.peak:g}: {s['requests']} requests "
                        f"({s['failed']} failed, {s['cut']} cut), TTFT mean "
                        f"{s['ttft_s']['mean']:.3f} s p99 {s['ttft_s']['p99']:.3f} s, e2e mean "
                        f"{s['e2e_s']['mean']:.2f} s, load "
                        f"{run.loadavg_start:.1f}->{run.loadavg_end:.1f}",
                        flush=True,
                    )
                    write(False)
            except (RuntimeError, ServerError) as exc:
                conf.record["error"] = repr(exc)
                print(f"[{config} r{rnd}] failed: {exc!r}", flush=True)
                stopped = stopped or f"{config} r{rnd} failed"
            finally:
                conf.close()
                if gpu:  # one tarball per call, named by its first block: parts keep theirs
                    call_tag = call_tag or conf.tag
                    pack_logs(workdir, out.with_name(f"{out.stem}-logs-{call_tag}.tar.gz"))
    wanted = {(c, r, p) for r in range(args.rounds) for c in args.configs for p in peaks}
    complete = wanted <= done
    report = write(complete)
    for peak in report["peaks"] if complete else []:
        if peak in report.get("mean_ttft_speedup", {}):
            print(
                f"peak {peak}: mean TTFT speed-up {report['mean_ttft_speedup'][peak]:.2f}x, "
                f"p99 {report['p99_ttft_speedup'][peak]:.2f}x "
                f"(kvcached {report['ttft_s']['kvcached'][peak]['mean']:.3f} s, "
                f"native {report['ttft_s']['native'][peak]['mean']:.3f} s)"
            )
    print(f"-> {out} ({'complete' if complete else f'{len(wanted - done)} run(s) to go'})")
    if args.plot and complete and "mean_ttft_speedup" in report:
        try:
            from multi_model_plot import plot_all, tag_of

            for path in plot_all(report, out.parent, tag_of(out)):
                print(f"-> {path}")
        except ImportError as exc:  # the GPU machine's bundle has no matplotlib
            print(f"no plots ({exc}): python benchmarks/multi_model_plot.py {out} where it is")
    return 0 if runs else 1


def card_results(card: Any) -> Path:  # noqa: ANN401
    """``benchmarks/results/<card>/`` (``h100``, ``h200``; ``gpu`` where none was found)."""
    import gpu_plan

    return gpu_plan.results_dir(ROOT, card)


def gpu_plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The trace and run settings :func:`gpu_plan.multi_model_plan` sizes with."""
    return {
        "engines": args.models,
        "utilization": args.utilization,
        "prompt_min": args.prompt_min,
        "prompt_max": args.prompt_max,
        "max_tokens": args.max_tokens,
        "low": args.low,
        "e2e_s": args.assume_e2e_s,
        "slope": args.slope,
        "hold_s": args.hold_s,
        "tail_s": args.tail_s,
    }


def size_gpu_run(args: argparse.Namespace, card: Any) -> None:  # noqa: ANN401
    """``--peaks`` from the card (:mod:`gpu_plan`) unless given, resumed or replayed.
    Exits with a clear message where there is neither a card nor ``--peaks``."""
    import gpu_plan

    if args.peaks is not None or args.resume is not None or args.trace is not None:
        return
    card = gpu_plan.require_card(card, "multi_model.py --device gpu without --peaks")
    args.peaks = gpu_plan.multi_model_plan(card.total_bytes, **gpu_plan_kwargs(args))["peaks"]


def gpu_run_plan(
    args: argparse.Namespace,
    card: Any,  # noqa: ANN401
    kv_total: int | None,
    peaks: list[float],
) -> dict[str, Any]:
    """The result's ``plan``: the card and :func:`gpu_plan.multi_model_plan` at
    the run's peaks, with the ledger's budget once it is known."""
    import gpu_plan

    if card is None:
        return {"card": None, "note": "no GPU found (nvidia-smi): nothing sized"}
    try:
        plan = gpu_plan.multi_model_plan(
            card.total_bytes, budget_bytes=kv_total, peaks=peaks, **gpu_plan_kwargs(args)
        )
    except ValueError as exc:  # a card the plan does not hold: the run's figures still stand
        plan = {"error": str(exc)}
    return {"card": {"name": card.name, "memory_mib": card.memory_mib,
                     "folder": card.folder}, **plan}  # fmt: skip


def kv_bytes_per_token(c: dict[str, Any] = MODEL_CONFIG) -> int:
    """K and V of every layer, bf16 (``head_dim`` or hidden size over heads)."""
    head_dim = c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"])
    return 2 * int(c["num_hidden_layers"]) * int(c["num_key_value_heads"]) * int(head_dim) * 2


if __name__ == "__main__":
    sys.exit(main())
