"""Issues #24 and #33's long-tail scenario: how many 8B models one GPU serves within a
TTFT SLO, ``kvcached serve`` with sleep against a static split of the same GPU.

**Run on the H100** (``benchmarks/results/h100/long-tail-gpu.json``: static 4, kvcached 5
within 2 s; docs/benchmarks.md). ``--cpu`` runs every code path on vLLM's CPU build
with tiny Llamas (its figures mean nothing for a GPU). The device call (gpu-vllm bundle carried;
the H100's commands are in ``benchmarks/results/h100/README.md``)::

    source .gpu/vllm/install.sh >/dev/null && export PYTHONUNBUFFERED=1 \\
        KVCACHED_BENCH_COMMIT=<sha> && python benchmarks/long_tail.py \\
        --out $OUT/long-tail-gpu.json [--resume benchmarks/results/h100/long-tail-gpu.json]

**Sized to the card** (issue #33, :func:`gpu_plan.long_tail_plan`, written to the
result as ``plan``): the static fit, the model counts, the lanes and the bring-up
wave come from the card's memory (nvidia-smi); the result's default place is
``benchmarks/results/<card>/long-tail-gpu.json`` (``h100``, ``h200``). On an H100
(79.65 GiB): static fit 4, kvcached N = 8 and 9 (2x, and the most up to 3x whose step,
begun first in a call, is estimated inside one: N = 12 would take four bring-up
waves and a 167 s trace, ~610 s), one lane (two would keep four engines, 75.8 GiB,
awake beside the sleepers' residue), waves of 3; N = 4 is 55 s and 100 requests,
N = 8 111 s and 196, N = 12 167 s and 323. Flags override
(``--lanes``, ``--wave``, ``--static-fit``, ``--kvcached-ns``).

Beside ``--out`` it writes ``<out>-trace.json`` (the traces) and, for the K-th call
of a resumed sweep, ``<out>/call-K/``: ``run.log`` (these progress lines) and
``logs.tar.gz`` (serve's log, every engine's log, the configs).

**The trace** (:func:`make_trace`, seeded, one per model count N, written to
``<out>-trace.json``; both configurations replay the same one). Models are ranked
0..N-1; popularity is Zipf (weight ``1/(rank+1)**zipf_s``). A model's requests come
only in bursts of ``burst_s`` seconds at ``burst_rate`` req/s (Poisson, the first at
the burst's start); between its bursts it is idle. Bursts are ``bursts_per_model * N``:
one per model (every model is really served, not only counted) and the rest drawn by
popularity, shuffled, and played on ``lanes`` lanes one after another with ``gap_s``
between, a model never in two bursts at once: the load moves from model to model, at
most ``lanes`` models are busy at a time, and the trace lasts about
``bursts_per_model * N * (burst_s + gap_s) / lanes`` s. GPU defaults (2 lanes,
6 s bursts at 2 req/s, 1 s gaps, 2 bursts per model, seed 24): N = 7 is 51.5 s and
154 requests, N = 8 58.5 s and 196, N = 14 100.5 s and 361 requests of 256-1024 prompt
tokens and 32 output tokens, where the most popular model bursts 6 times and 8 of the
14 once (busy 6 % of the trace). P99 over 361 requests allows 3 slow ones.

**The SLO** (``--slo-s``, default 2 s): P99 TTFT over every request of the trace
<= 2 s, and no request failed (a failed request counts as an infinite TTFT). A
configuration's ``models_per_gpu`` is the largest N that meets it with every smaller
N it measured meeting it too (:func:`models_per_gpu`: one miss below ends the count).

**kvcached**: one ``kvcached serve`` of N models, all ``start: lazy``; before a
step the harness starts each new one (``/admin/.../wake``), sends it two warm-up
requests of the longest prompt (an engine's first-request costs are not a wake's) and puts it to
sleep, at most ``--wave`` starting at once (an engine holds its weights on the GPU
while it starts); static's engines get the same warm-up. Idle models sleep
``idle_after`` (3 s) after their last request; a request to a sleeping model waits
for its wake, which is what the SLO sees. Level: on the
GPU an 8B model's weights are 14.96 GiB, its KV share 2 GiB and its CUDA context and
activations ~2 GiB (18.96 GiB awake), so only the ``weights`` level frees enough for
many models (the ``kv`` level frees only the KV: ~7 models fit awake, no more than
static). vLLM's sleep mode runs its own KV cache, so these models run
``kvcached: false`` with the same ``--kv-cache-memory-bytes`` as static; serve's
``pressure: sleep-lru`` is set but acts only on kvcached instances (the CPU run's).
vLLM level 1 keeps the weights in pinned host memory (a wake is a 15 GiB copy, ~0.3 s
at ~50 GB/s; torch keeps the pinned buffer after the first sleep), level 2 drops them
and reloads from the files (seconds, page cache). The host has 128 GiB: with ~4 GiB
per engine (API server and engine core, an estimate: ``host_available_bytes`` per
step measures it) level 1 fits K = floor((host - 16 GiB - 4 GiB * N) / 14.96 GiB)
models (:func:`l1_models`; N = 14 gives 3), so the K most popular sleep at level 1
and the rest at level 2 (``--l1-models`` overrides). Awake at once: a lane's model
and, while ``idle_after`` < ``burst_s + gap_s``, its previous one: <= 2 * lanes = 4,
76 GiB, plus a sleeping engine's residue (CUDA context, ~1 GiB each; ~10 GiB at
N = 14): inside 140 GiB. Serve caps nothing itself: a weights wake takes its memory
from the driver, so the trace's lanes are what bound it.

**static**: the same serve, every model ``sleep: none``, ``kvcached: false``,
started together, each with the fixed 2 GiB KV share: M = floor(GPU memory /
18.96 GiB) = floor(140.4 / 18.96) = 7 fit (:func:`static_fit`, from nvidia-smi's
total and the safetensors' size; ``--static-fit`` overrides). A static step of N > M
configures M models and the requests of the others fail (the router's 404): they
cannot be served. Default static steps: M (GPU), M and M + 1 (CPU, to run that path).

**A step** is (configuration, N). Per step: every request's send time, model, TTFT,
end-to-end time and send lateness; every wake (serve's ``last_wake_s`` read from
``/v1/models/M/state`` when its ``wakes`` count moves, polled every 0.5 s) with its
level; the most models awake at once; host memory available and the GPU's used
memory after the bring-up; on the GPU vLLM's own wake times from the engine logs.
kvcached steps go in increasing N on one serve (each adds models); after a step that
misses the SLO the larger ones are skipped, and, if the smallest kvcached step missed,
one more runs at the most models above the static fit that all sleep at level 1
(:func:`fallback_n`: 5 on the H100, on the serve already up), so that a miss caused by
level-2 wakes (~2 s each for an 8B) still leaves a count. Default GPU sweep: static M; kvcached
2 M and 3 M (the goal: twice static's models, the aim three times).

**Time and resume.** The JSON (``--out``) is written after every step, with
``complete`` true once every planned step is done or skipped by the rule above. A
step is begun only if its estimate (its new engines in waves of ``--wave``, each
``--start-s``: the slowest start measured so far, resumed steps' included, else
120 s on the GPU; plus the trace and 30 s) and the shutdown (50 s) fit before
``--deadline-s`` (540 s from this script's start), except the first step of a call
that no whole call would hold (:func:`first_of_call_anyway`: it could never run
otherwise; the device's 600 s limit is then the backstop, and the steps before it
are written). ``--resume PATH`` takes the steps
of an earlier result (its JSON: commit it between calls) and runs only the others;
each step keeps the commit it measured. Estimated GPU calls (an 8B engine's start
is a guess of 120 s until measured; three 8B engines co-started in 45-82 s on the
H100): each call ~60 s of install and model. H100: call 1 static-4 (4 engines at
once, a 55 s trace, ~5 min); call 2 kvcached-8 (three waves of 3, 111 s, ~8 min,
begun as the first step of a call); call 3 kvcached-9 (three waves, 125 s, ~8 min).
H200: call 1 static-7; call 2 kvcached-14; call 3 kvcached-19.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import serve_gpu as sg  # (its Run, serve start and stop, model, log packing)
from gpu_plan import l1_models, static_fit  # the card's arithmetic, one copy
from kvharness.vllm_server import free_port
from multi_model_trace import prompt_tokens, trace_request
from serve import http_json

ROOT = Path(__file__).resolve().parent.parent

GIB = 1 << 30
CONFIGS = ("static", "kvcached")
#: CUDA context, activations and buffers of one eager 8B engine, beside weights and KV
ENGINE_OVERHEAD_BYTES = 2 * GIB
SHUTDOWN_RESERVE_S = sg.SHUTDOWN_RESERVE_S


# -- pure pieces (tests/test_long_tail_benchmark.py) ------------------------------------------
@dataclass(frozen=True)
class TraceSpec:
    """The long-tail trace's shape (module docstring)."""

    lanes: int = 2
    burst_s: float = 6.0
    burst_rate: float = 2.0
    gap_s: float = 1.0
    bursts_per_model: int = 2
    zipf_s: float = 1.1
    prompt_min: int = 256
    prompt_max: int = 1024
    max_tokens: int = 32

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.bursts_per_model < 1 or self.burst_s <= 0:
            raise ValueError("TraceSpec: lanes, bursts_per_model >= 1 and burst_s > 0")
        if self.burst_rate <= 0 or self.gap_s < 0 or self.zipf_s < 0:
            raise ValueError("TraceSpec: burst_rate > 0, gap_s >= 0, zipf_s >= 0")
        if not 1 <= self.prompt_min <= self.prompt_max or self.max_tokens < 1:
            raise ValueError("TraceSpec: 1 <= prompt_min <= prompt_max, max_tokens >= 1")


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def make_trace(spec: TraceSpec, n: int, seed: int) -> dict[str, Any]:
    """The trace over ``n`` models: ``bursts`` (model, start, end) and ``requests``
    (``t``, ``model`` rank, ``prompt_seed``, ``prompt_len``, ``max_tokens``) in time order."""
    rng = random.Random(f"long-tail/{seed}/{n}")
    queue = list(range(n)) + rng.choices(
        range(n), zipf_weights(n, spec.zipf_s), k=(spec.bursts_per_model - 1) * n
    )
    rng.shuffle(queue)
    step = spec.burst_s + spec.gap_s
    lane_free = [lane * step / spec.lanes for lane in range(spec.lanes)]
    busy_until: dict[int, float] = {}
    bursts, requests = [], []
    while queue:
        lane = min(range(spec.lanes), key=lambda i: lane_free[i])
        t0 = lane_free[lane]
        # the first queued model not in a burst now; else the queue's head, once it is free
        pick = next((i for i, m in enumerate(queue) if busy_until.get(m, -1.0) <= t0), None)
        if pick is None:
            pick = 0
            t0 = busy_until[queue[0]] + spec.gap_s
        model = queue.pop(pick)
        end = t0 + spec.burst_s
        bursts.append({"model": model, "start": round(t0, 4), "end": round(end, 4)})
        busy_until[model] = end
        lane_free[lane] = end + spec.gap_s
        t = t0
        while t < end:
            requests.append(trace_request(rng, t, model, spec))
            t += rng.expovariate(spec.burst_rate)
    requests.sort(key=lambda r: (r["t"], r["model"]))
    bursts.sort(key=lambda b: (b["start"], b["model"]))
    duration = max(b["end"] for b in bursts)
    doc = {"n": n, "seed": seed, "spec": asdict(spec), "duration_s": round(duration, 4)}
    doc.update(bursts=bursts, requests=requests)
    doc["sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return doc


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def slo_check(records: list[dict[str, Any]], slo_s: float, q: float = 0.99) -> dict[str, Any]:
    """Whether a step's requests meet the SLO: P``q`` TTFT <= ``slo_s`` over all of
    them, a failed request counting as an infinite TTFT, and none failed."""
    ttfts = [r["ttft_s"] if r["ok"] else math.inf for r in records]
    failed = sum(1 for r in records if not r["ok"])
    p = percentile(ttfts, q)
    return {
        "requests": len(records),
        "failed": failed,
        "ttft_p99_s": None if p is None or math.isinf(p) else p,
        "slow": sum(1 for t in ttfts if t > slo_s),
        "met": bool(records) and failed == 0 and p is not None and p <= slo_s,
    }


def models_per_gpu(steps: dict[str, dict[str, Any]], config: str) -> int | None:
    """The largest N whose step of ``config`` met the SLO, every smaller measured N
    meeting it too; None when none did."""
    done = sorted(
        (s["n"], s["slo"]["met"])
        for s in steps.values()
        if s.get("config") == config and s.get("status") == "done"
    )
    best = None
    for n, met in done:
        if not met:
            break
        best = n
    return best


#: SLO bounds (s) the headline also counts models at, from the same requests: a
#: level-2 wake reloads 16 GB of weights (seconds), so the first requests of a
#: burst to such a model may pass 2 s where a looser SLO still holds
SLO_BOUNDS_S = (2.0, 5.0, 10.0)


def models_per_gpu_at(steps: dict[str, dict[str, Any]], config: str, bound_s: float) -> int | None:
    """:func:`models_per_gpu` with the SLO's bound at ``bound_s``, recomputed from
    each step's requests (the sweep stops after a miss at ``--slo-s``, so a looser
    bound's count is a lower bound)."""
    graded = {
        k: {**s, "slo": slo_check(s["requests"], bound_s)}
        for k, s in steps.items()
        if s.get("status") == "done" and isinstance(s.get("requests"), list)
    }
    return models_per_gpu(graded, config)


def plan_steps(static_ns: list[int], kvcached_ns: list[int]) -> list[tuple[str, int]]:
    """The steps in the order they run: static, then kvcached by increasing N."""
    return [("static", n) for n in sorted(set(static_ns))] + [
        ("kvcached", n) for n in sorted(set(kvcached_ns))
    ]


def fallback_n(kvcached_ns: list[int], fit: int, host_bytes: int, weights_bytes: int) -> int | None:
    """The kvcached step to measure if the smallest planned one misses the SLO: the
    most models above the static fit that all sleep at level 1 (a level-2 wake
    reloads the weights from the files, ~2 s for an 8B on the H100, which a 2 s P99
    cannot absorb), so that a miss still leaves a count; None when no such N lies
    between the static fit and the smallest planned N."""
    below = [
        n for n in range(fit + 1, min(kvcached_ns)) if l1_models(n, host_bytes, weights_bytes) >= n
    ]
    return max(below) if below else None


def step_key(config: str, n: int) -> str:
    return f"{config}-{n}"


def pending(
    plan: list[tuple[str, int]], steps: dict[str, dict[str, Any]], fallback: int | None = None
) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """Of ``plan``, the steps still to run, and the ones skipped with the reason: done
    already (a resumed result), or larger than a step of the same configuration that
    missed the SLO. kvcached's ``fallback`` N (:func:`fallback_n`) runs only once a
    larger kvcached step missed the SLO."""
    smallest_miss: dict[str, int] = {}
    for s in steps.values():
        if s.get("status") == "done" and not s["slo"]["met"]:
            config = s.get("config")
            smallest_miss[config] = min(s["n"], smallest_miss.get(config, s["n"]))
    todo, skipped = [], {}
    for config, n in plan:
        key = step_key(config, n)
        if steps.get(key, {}).get("status") == "done":
            continue
        miss = smallest_miss.get(config)
        if miss is not None and n > miss:
            skipped[key] = f"skipped: N={miss} missed the SLO"
            continue
        todo.append((config, n))
    miss = smallest_miss.get("kvcached")
    if (
        fallback is not None
        and miss is not None
        and fallback < miss
        and steps.get(step_key("kvcached", fallback), {}).get("status") != "done"
    ):
        todo.append(("kvcached", fallback))
    return todo, skipped


def merge_resumed(old: dict[str, Any] | None, plan: list[tuple[str, int]]) -> dict[str, Any]:
    """The steps an earlier result measured (``--resume``) that this plan still holds."""
    if not old:
        return {}
    keys = {step_key(c, n) for c, n in plan}
    return {
        k: s
        for k, s in old.get("steps", {}).items()
        if k in keys and isinstance(s, dict) and s.get("status") == "done"
    }


def step_estimate_s(new_engines: int, wave: int, start_s: float, trace_s: float) -> float:
    """A step's time: its new engines' start in waves, the trace, and 30 s to drain."""
    return math.ceil(new_engines / max(1, wave)) * start_s + trace_s + 30.0


def measured_start_s(steps: dict[str, dict[str, Any]]) -> float | None:
    """The slowest engine start (``/admin/wake`` of a lazy model to ready) that the
    steps so far measured: a wave's time for the next estimates; None before any."""
    starts = [
        e["start_s"]
        for s in steps.values()
        for e in (s.get("bring_up") or {}).get("engines", [])
        if e.get("start_s") is not None
    ]
    return max(starts) if starts else None


def first_of_call_anyway(need_s: float, deadline_s: float) -> bool:
    """Whether a step estimated at ``need_s`` that does not fit what is left is begun
    anyway, as the first step of a call: when even a whole call (``deadline_s``, less
    ~60 s of install and model and the shutdown) would not hold it, waiting for the next
    call gains nothing, and the steps before it are already written."""
    return need_s + SHUTDOWN_RESERVE_S > deadline_s - 60.0


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p99": percentile(values, 0.99),
        "max": max(values),
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the steps so far."""
    steps = result["steps"]
    per = {c: models_per_gpu(steps, c) for c in CONFIGS}
    wakes = [w for s in steps.values() if s.get("config") == "kvcached" for w in s.get("wakes", [])]
    by_level: dict[str, list[float]] = {}
    for w in wakes:
        if w.get("wake_s") is not None:
            by_level.setdefault(str(w["level"]), []).append(w["wake_s"])
    ratio = per["kvcached"] / per["static"] if per["kvcached"] and per["static"] else None
    return {
        "models_per_gpu": per,
        "ratio": ratio,
        "goal": {
            "target": "kvcached >= 2 x static",
            # on the CPU static's fit is set (--static-fit), not found: no goal to meet
            "met": None if ratio is None or result.get("harness_check_only") else ratio >= 2,
        },
        "wake_s": {level: spread(v) for level, v in sorted(by_level.items())},
        "models_per_gpu_by_slo_s": {
            f"{b:g}": {c: models_per_gpu_at(steps, c, b) for c in CONFIGS} for b in SLO_BOUNDS_S
        },
    }


# -- serve configs ------------------------------------------------------------------------------
def serve_config(
    config: str,
    names: list[str],
    model_dir: str,
    port: int,
    state_dir: str,
    *,
    cpu: bool,
    kv_bytes: int,
    weights_levels: list[int],
    idle_after: float,
) -> dict[str, Any]:
    """The serve config of one configuration, built from serve_gpu's entries: its
    ``w1`` (vLLM's own KV of ``kv_bytes``, sleep mode) on the GPU, its ``kv`` on the CPU."""
    base = sg.serve_config(model_dir, port, state_dir, cpu=cpu, native_kv_bytes=kv_bytes)
    by = {m["name"]: m for m in base["models"]}
    models = []
    for i, name in enumerate(names):
        if config == "static":
            m = copy.deepcopy(by["kv"] if cpu else by["w1"])
            m.update(kvcached=False, sleep={"level": "none"})
        elif cpu:
            m = copy.deepcopy(by["kv"])
            m.update(start="lazy", sleep={"level": "kv", "idle_after": idle_after})
        else:
            m = copy.deepcopy(by["w1"])
            sleep = {"level": "weights", "weights_level": weights_levels[i]}
            m.update(start="lazy", sleep={**sleep, "idle_after": idle_after})
        m["name"] = name
        m["startup_timeout"] = m["wake_timeout"] = 480
        models.append(m)
    return {**base, "models": models}


def model_names(config: str, n: int) -> list[str]:
    return [f"{config[0]}{rank:02d}" for rank in range(n)]


# -- the run ------------------------------------------------------------------------------------
class Run(sg.Run):
    """serve_gpu's Run (requests, states, logs, clock) with this benchmark's result."""

    def __init__(self, args: argparse.Namespace, out: Path, logs: Path, work: Path) -> None:
        super().__init__(args, out, logs, work)
        self.result.update(benchmark="long-tail", issue=24, steps={}, skipped={})
        del self.result["levels"], self.result["phases"]
        self.started: set[str] = set()
        self.warmed: set[str] = set()

    def save(self) -> None:
        self.result["figures"] = headline(self.result)
        self.result.update(self.result["figures"])
        self.result["requests_sent"] = self.requests
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        sg._provenance.write_result(self.out, self.result, self.block, indent=1)


def host_available() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def bring_up(run: Run, names: list[str]) -> dict[str, Any]:
    """Start each lazy model (``/admin/wake``) and put it to sleep, ``--wave`` at once."""

    def one(name: str) -> dict[str, Any]:
        began = time.monotonic()
        status, doc = http_json(run.port, "POST", f"/admin/models/{name}/wake", 600)
        up = time.monotonic() - began
        if status != 200:
            return {"name": name, "error": f"start: {status} {doc}"[:300]}
        run.started.add(name)
        warm(run, [name], run.args.warm_len)
        try:
            took, slept = run.sleep(name)
        except RuntimeError as exc:
            return {"name": name, "start_s": round(up, 2), "error": str(exc)[:300]}
        return {"name": name, "start_s": round(up, 2), "sleep_s": round(took, 2),
                "level": slept.get("sleep_level")}  # fmt: skip

    new = [n for n in names if n not in run.started]
    began = time.monotonic()
    with ThreadPoolExecutor(max(1, run.args.wave)) as pool:
        done = list(pool.map(one, new))
    run.say(f"bring-up of {len(new)} in {time.monotonic() - began:.1f} s: {done}")
    return {"engines": done, "s": round(time.monotonic() - began, 1)}


def warm(run: Run, names: list[str], prompt_len: int) -> None:
    """Two requests of the trace's longest prompt to each new engine, together, so that no
    step's TTFT carries an engine's first-request costs (kernel set-up for a shape,
    allocator warm-up): a wake's cost is what is measured."""
    batch = [prompt_tokens(seed, prompt_len) for seed in (7, 8)]
    for name in names:
        if name not in run.warmed:
            run.load(name, batch, 2, "warm-up")
            run.warmed.add(name)


def sleep_all(run: Run, names: list[str]) -> None:
    """Every model of the step asleep before its trace (the same start for every step)."""
    for name in names:
        if run.state(name).get("state") == "ready":
            with contextlib.suppress(RuntimeError):
                run.sleep(name)


def kv_misses(run: Run) -> dict[str, int]:
    """Each kvcached instance's allocation misses so far (its snapshot, as ``kvctl list``)."""
    with contextlib.suppress(Exception):
        return {n: r["misses"] or 0 for n, r in run.ledger()["instances"].items()}
    return {}


class Watch(threading.Thread):
    """Polls the step's models' states: each wake (serve's ``last_wake_s``) and how
    many are awake at once."""

    def __init__(self, run: Run, names: list[str], levels: dict[str, Any], t0: float) -> None:
        super().__init__(daemon=True)
        self.run_, self.names, self.levels, self.t0 = run, names, levels, t0
        self.stop = threading.Event()
        self.wakes: list[dict[str, Any]] = []
        self.max_awake = 0
        self.seen = {n: run.state(n).get("wakes", 0) for n in names}

    def run(self) -> None:
        while not self.stop.is_set():
            awake = 0
            for name in self.names:
                with contextlib.suppress(OSError, ValueError):
                    st = self.run_.state(name)
                    awake += st.get("state") in ("ready", "waking")
                    if st.get("wakes", 0) > self.seen[name]:
                        self.wakes.append(
                            {
                                "model": name,
                                "at_s": round(time.monotonic() - self.t0, 2),
                                "wake_s": st.get("last_wake_s"),
                                "wakes_since": st["wakes"] - self.seen[name],
                                "level": self.levels.get(name),
                            }
                        )
                        self.seen[name] = st["wakes"]
            self.max_awake = max(self.max_awake, awake)
            self.stop.wait(0.5)


def replay(run: Run, trace: dict[str, Any], names: list[str], phase: str) -> list[dict[str, Any]]:
    """Send every request of ``trace`` at its time; each one's TTFT, e2e and lateness."""
    prompts = [prompt_tokens(r["prompt_seed"], r["prompt_len"]) for r in trace["requests"]]

    def send(r: dict[str, Any], prompt: list[int], late: float) -> dict[str, Any]:
        done = run.request(names[r["model"]], prompt, r["max_tokens"], phase)
        return {"t": r["t"], "model": r["model"], "ok": done["ok"],
                "ttft_s": done["ttft_s"], "e2e_s": time.monotonic() - done["sent"],
                "late_s": late, **({"error": done["error"]} if "error" in done else {})}  # fmt: skip

    t0 = time.monotonic()
    futures = []
    with ThreadPoolExecutor(64) as pool:
        for r, prompt in zip(trace["requests"], prompts, strict=True):
            wait = t0 + r["t"] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            late = round(time.monotonic() - t0 - r["t"], 4)
            futures.append(pool.submit(send, r, prompt, late))
        return [f.result() for f in futures]


def run_step(
    run: Run, config: str, n: int, trace: dict[str, Any], levels: dict[str, Any]
) -> dict[str, Any]:
    names = model_names(config, n)
    served = [m for m in names if m in levels]
    step: dict[str, Any] = {"config": config, "n": n, "commit": run.block["commit"]}
    step["trace"] = {k: trace[k] for k in ("sha256", "duration_s", "seed")}
    step["trace"].update(requests=len(trace["requests"]), bursts=len(trace["bursts"]))
    step["served"], step["unserved"] = len(served), len(names) - len(served)
    step["levels"] = {m: levels[m] for m in served}
    if config == "kvcached":
        step["bring_up"] = bring_up(run, served)
        sleep_all(run, served)
    else:
        warm(run, served, run.args.warm_len)
    step["host_available_bytes"] = host_available()
    step["gpu"] = sg.parse_gpu(run.smi("--query-gpu=memory.used,memory.free,memory.total") or "")
    logs0 = {m: len(sg.engine_wake_times(run.engine_log(m))) for m in served}
    misses0 = kv_misses(run)
    t0 = time.monotonic()
    watch = Watch(run, served, levels, t0)
    watch.start()
    try:
        records = replay(run, trace, names, step_key(config, n))
    finally:
        watch.stop.set()
        watch.join()
    step["replay_s"] = round(time.monotonic() - t0, 1)
    misses = kv_misses(run)  # kvcached instances only: the CPU run's, not weights-level ones
    step["kv_misses"] = {m: misses[m] - misses0.get(m, 0) for m in misses if m in served}
    step["slo"] = slo_check(records, run.args.slo_s)
    ok = [r for r in records if r["ok"]]
    step["ttft_s"] = spread([r["ttft_s"] for r in ok])
    step["e2e_s"] = spread([r["e2e_s"] for r in ok])
    step["late_s_max"] = max((r["late_s"] for r in records), default=None)
    step["wakes"], step["max_awake"] = watch.wakes, watch.max_awake
    step["wakes_total"] = sum(w["wakes_since"] for w in watch.wakes)
    if not run.args.cpu:  # vLLM's own wake times, from each engine's log
        step["engine_wake_s"] = {
            m: sg.engine_wake_times(run.engine_log(m))[logs0[m] :] for m in served
        }
    step["requests"] = records
    step["status"] = "done"
    return step


# -- main ---------------------------------------------------------------------------------------
def card_plan(cpu: bool, host_bytes: int, kv_bytes: int) -> tuple[Any, dict[str, Any]]:  # noqa: ANN401
    """The card (nvidia-smi) and :func:`gpu_plan.long_tail_plan` of it, with the
    host's memory at least ``host_bytes``; on the CPU, or where no card is found,
    none (the H200's defaults then hold)."""
    if cpu:
        return None, {}
    import gpu_plan

    card = gpu_plan.read_card()
    if card is None:
        return None, {"note": "no GPU found (nvidia-smi): nothing sized"}
    host = gpu_plan.host_bytes_at_least(host_bytes)
    return card, gpu_plan.long_tail_plan(card.total_bytes, host, kv_bytes=kv_bytes)


def default_out(cpu: bool, card: Any) -> Path:  # noqa: ANN401
    """``benchmarks/results/long-tail-cpu.json``, or on a GPU
    ``benchmarks/results/<card>/long-tail-gpu.json`` (``h100``, ``h200``)."""
    if cpu:
        return ROOT / "benchmarks" / "results" / "long-tail-cpu.json"
    import gpu_plan

    return gpu_plan.results_dir(ROOT, card) / "long-tail-gpu.json"


def parse_ns(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--resume", default="", help="an earlier result: its done steps are kept")
    p.add_argument("--cpu", action="store_true", help="vLLM's CPU build, tiny Llamas, kv level")
    p.add_argument("--deadline-s", type=float, default=540.0, help="from this script's start")
    p.add_argument("--slo-s", type=float, default=2.0, help="P99 TTFT bound")
    p.add_argument("--static-fit", type=int, default=0, help="0: from the GPU's memory")
    p.add_argument("--static-ns", default="", help="default: fit (GPU), fit,fit+1 (CPU)")
    p.add_argument(
        "--kvcached-ns",
        default="",
        help="default: GPU the plan's (2x fit, the most up to 3x a call holds: H100 8,9), CPU 2,3,4",
    )
    p.add_argument("--l1-models", type=int, default=-1, help="-1: from host memory")
    p.add_argument(
        "--host-gib",
        type=int,
        default=128,
        help="the GPU machine's host memory at least (its MemTotal reads 31 GiB at start)",
    )
    p.add_argument("--kv-gib", type=float, default=2.0, help="each model's KV (GPU)")
    p.add_argument("--idle-after", type=float, default=0.0, help="0: 3 s (GPU), 1 s (CPU)")
    p.add_argument(
        "--wave", type=int, default=0, help="engines started at once (0: GPU from the card, CPU 2)"
    )
    p.add_argument(
        "--lanes",
        type=int,
        default=0,
        help="bursts at once (0: GPU from the card, gpu_plan: 1 on an H100, 2 on an H200; CPU 2)",
    )
    p.add_argument(
        "--start-s", type=float, default=0.0, help="a wave's start (0: measured, else 120/90 s)"
    )
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--models-dir", default="/tmp/e2e-models")
    p.add_argument("--make-model", default=".gpu/vllm/make_model.py")
    p.add_argument("--workdir", default="")
    # serve_gpu's model step reads it: the long tail's arithmetic is the 8B's
    p.set_defaults(shape=sg.SHAPE)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cpu = args.cpu
    card, sizing = card_plan(cpu, args.host_gib << 30, int(args.kv_gib * GIB))
    args.wave = args.wave or (2 if cpu else sizing.get("wave", 5))
    start_s_given = args.start_s > 0
    args.idle_after = args.idle_after or (1.0 if cpu else 3.0)
    args.out = args.out or str(default_out(cpu, card))
    lanes = args.lanes or (2 if cpu else sizing.get("lanes", 2))
    spec = (
        TraceSpec(lanes, burst_s=3.0, burst_rate=2.0, prompt_min=64, prompt_max=256, max_tokens=8)
        if cpu
        else TraceSpec(lanes=lanes)
    )
    args.warm_len = spec.prompt_max

    out = Path(args.out)
    old = json.loads(Path(args.resume).read_text()) if args.resume else None
    call = len((old or {}).get("calls", [])) + 1 + bool(old)  # this device call's number
    logs = out.with_suffix("") / f"call-{call}"  # run.log and logs.tar.gz of this call
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcached-long-tail-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["KVCACHED_LEDGER_DIR"] = str(work)
    run = Run(args, out, logs, work)
    signal.signal(signal.SIGTERM, sg._interrupt)
    res = run.result
    res["slo"] = {"ttft_percentile": 99, "bound_s": args.slo_s, "failed_requests": 0,
                  "over": "every request of the step's trace"}  # fmt: skip
    res["trace_spec"] = asdict(spec)
    if not cpu:  # the sizing arithmetic (gpu_plan), as the result's plan
        res["plan"] = {"card": asdict(card) if card else None, **sizing}
    if cpu:
        res["harness_check_only"] = "vLLM's CPU build and tiny Llamas: no GPU figure"
    res["call"] = call
    # an earlier result's steps stay in the file even if this call breaks off early
    done = (old or {}).get("steps", {})
    res["steps"] = {k: s for k, s in done.items() if s.get("status") == "done"}
    if old:
        res["calls"] = [*old.get("calls", []), old.get("provenance")]
    all_names: list[str] = []
    everyone: list[str] = []  # every engine of every serve of this call (their logs)
    try:
        res["vllm_version"] = sg._vllm_version()
        model_dir = sg.prepare_model(run)
        weights = res["model"].get("weights_bytes", 0)
        gpu = sg.parse_gpu(run.smi("--query-gpu=memory.used,memory.free,memory.total") or "")
        kv_bytes = GIB if cpu else int(args.kv_gib * GIB)  # CPU: VLLM_CPU_KVCACHE_SPACE=1
        fit = args.static_fit or (
            2
            if cpu or gpu is None
            else static_fit(gpu["total_mib"] << 20, weights, kv_bytes, ENGINE_OVERHEAD_BYTES)
        )
        static_ns = parse_ns(args.static_ns) or ([fit, fit + 1] if cpu else [fit])
        sized_ns = sizing.get("kvcached_ns") if not args.static_fit else None
        kv_ns = parse_ns(args.kvcached_ns) or ([2, 3, 4] if cpu else sized_ns or [2 * fit, 3 * fit])
        plan = plan_steps(static_ns, kv_ns)
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if not cpu:  # a Firecracker machine's MemTotal starts small and grows with use
            host = max(host, args.host_gib << 30)
        n_max = max(kv_ns)
        k1 = args.l1_models if args.l1_models >= 0 else l1_models(n_max, host, weights)
        levels_kv = {m: ("kv" if cpu else (1 if r < k1 else 2))
                     for r, m in enumerate(model_names("kvcached", n_max))}  # fmt: skip
        fallback = None if cpu else fallback_n(kv_ns, fit, host, weights)
        with_fallback = plan + ([("kvcached", fallback)] if fallback is not None else [])
        res["setup"] = {"static_fit": fit, "gpu": gpu, "kv_bytes": kv_bytes, "weights_bytes": weights,
                        "host_bytes": host, "l1_models": k1, "levels": levels_kv,
                        "plan": [step_key(c, n) for c, n in plan], "wave": args.wave,
                        "fallback": None if fallback is None else step_key("kvcached", fallback)}  # fmt: skip
        res["steps"] = merge_resumed(old, with_fallback)
        traces = {n: make_trace(spec, n, args.seed) for _, n in with_fallback}
        trace_path = out.with_name(out.stem + "-trace.json")
        trace_path.write_text(json.dumps({str(n): t for n, t in traces.items()}) + "\n")
        for key, step in res["steps"].items():
            if step["trace"]["sha256"] != traces[step["n"]]["sha256"]:
                raise SystemExit(f"--resume: step {key}'s trace differs from this one's")
        run.say(f"plan {res['setup']['plan']}, resumed {sorted(res['steps'])}; static fit {fit}")
        run.save()
        current, ran_here = None, False
        while True:
            todo, res["skipped"] = pending(plan, res["steps"], fallback)
            if not todo:
                break
            config, n = todo[0]
            key = step_key(config, n)
            served_n = min(n, fit) if config == "static" else n
            names = model_names(config, served_n)
            new = len(names) if current != config else len(set(names) - run.started)
            if not start_s_given:  # measured once a step started engines, else a guess
                args.start_s = measured_start_s(res["steps"]) or (90.0 if cpu else 120.0)
            need = step_estimate_s(new, args.wave, args.start_s, traces[n]["duration_s"])
            if current not in (None, config):
                need += SHUTDOWN_RESERVE_S
            over = run.left() < need + SHUTDOWN_RESERVE_S
            if over and (ran_here or not first_of_call_anyway(need, args.deadline_s)):
                run.say(f"{key}: not begun, {run.left():.0f} s left, it needs ~{need:.0f} s "
                        f"(engine waves of {args.start_s:.0f} s: --start-s, --wave)")  # fmt: skip
                break
            if over:  # no call would give it more time: the device's limit is the backstop
                run.say(f"{key}: needs ~{need:.0f} s, more than a call has; begun anyway")
            if current != config:
                if current is not None:
                    res.setdefault("shutdowns", []).append(sg.stop_serve(run, tuple(all_names)))
                    run.serve, run.started = None, set()
                top = max(m for c, m in todo if c == config)
                all_names = model_names(config, min(top, fit) if config == "static" else top)
                everyone += all_names
                levels = {m: "none" for m in all_names} if config == "static" else levels_kv
                cfg = serve_config(config, all_names, model_dir, free_port(),
                                   str(work / "state"), cpu=cpu, kv_bytes=kv_bytes,
                                   weights_levels=[levels_kv.get(m, 1) for m in all_names]
                                   if not cpu else [], idle_after=args.idle_after)  # fmt: skip
                res.setdefault("startups", {})[config] = sg.start_serve(
                    run, model_dir, tuple(all_names), cfg
                )
                (run.stage / f"serve-{config}.yaml").write_text(json.dumps(cfg, indent=1))
                if config == "static":
                    run.started = set(all_names)
                current = config
            run.say(f"{key}: begins ({len(traces[n]['requests'])} requests, "
                    f"{traces[n]['duration_s']:.0f} s)")  # fmt: skip
            began = time.monotonic()
            try:
                step = run_step(run, config, n, traces[n], levels)
            except Exception as exc:  # recorded; the run goes on with the next step
                step = {"config": config, "n": n, "status": f"error: {exc!r}"[:600]}
            step["elapsed_s"] = round(time.monotonic() - began, 1)
            step["estimate_s"], step["begun_over_estimate"] = round(need), over
            res["steps"][key] = step
            ran_here = True
            slo = step.get("slo", {})
            wake = spread([w["wake_s"] for w in step.get("wakes", []) if w["wake_s"] is not None])
            run.say(f"{key}: {step['status']}; SLO {slo}; TTFT {step.get('ttft_s')}; "
                    f"wakes {wake}, most awake {step.get('max_awake')}")  # fmt: skip
            run.save()
            if step["status"] != "done":
                break
    except KeyboardInterrupt:
        res["interrupted"] = True
        run.say("interrupted: stopping serve and writing what was measured")
    except Exception as exc:  # the run broke off: say where, keep what it has
        res["error"] = repr(exc)[:600]
        run.say(f"error: {exc!r}")
    finally:
        res.setdefault("shutdowns", []).append(sg.stop_serve(run, tuple(all_names)))
        native = [m for m in everyone if not cpu or m.startswith("s")]  # kvcached: false
        try:
            sg.pack_logs(run, tuple(everyone), native=tuple(native))
        except OSError as exc:  # the results stand without the logs
            res["logs_error"] = repr(exc)[:300]
        todo, res["skipped"] = (
            pending(plan, res["steps"], fallback) if "setup" in res else ([None], {})
        )
        res["complete"] = not todo
        run.save()
    run.say(json.dumps({k: res[k] for k in ("models_per_gpu", "ratio", "goal", "complete")}))
    run.say(json.dumps(res["wake_s"]))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
