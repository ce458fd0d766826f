"""The GPU benchmarks sized to the card they find (issue #33): ``multi_model.py
--device gpu``, ``long_tail.py`` and ``serve_gpu.py`` read the card's memory
(:func:`read_card`) and take their defaults from here; every plan is a dict that
the harness writes into its result as ``plan``, so the arithmetic travels with
the figures. Explicit flags still win.

**Memory per engine** (Llama-3.1-8B's shape, eager, vLLM 0.26): 14.96 GiB of
bf16 weights and ~2 GiB of CUDA context, activations and buffers
(:data:`ENGINE_OVERHEAD_BYTES`). The kvcached ledger keeps ``total x (1 -
KVCACHED_GPU_UTILIZATION)`` back. On the H100 (81,559 MiB) three engines leave
``79.65 x 0.95 - 3 x 16.96`` = 24.8 GiB of KV budget (the ledger measured 24.45),
on the H200 (143,771 MiB) ~82.5 GiB.

**The multi-model knee** (:func:`multi_model_plan`). The GPU trace is
upstream's ramp with no hold: a model climbs 0 -> P at 1 req/s per second and
falls back to ``low`` (1 req/s) at once, so its requests in flight at the
busiest moment are the arrivals of the busiest window of one end-to-end time
(Little's law over the trace's own rate, not the steady state at the peak):
``(P - 1)^2 + W`` for W = 15 s (measured 13-17 s on the H100). A static
share queues once a burst of that many, two standard deviations of a Poisson
count above its mean, holds more KV than the share: each request ~352 MiB
(2,560 prompt tokens and half its 512 output tokens at 128 KiB each). On the
H100 that puts the knee at P ~ 2 (1.93 with the ledger's budget; measured: no
queueing at 2.0, native p99 TTFT 3.3 s at 2.5); on the H200, whose thirds are
~3.3x larger, at ~8. The two standard deviations are fitted to that one
measurement, not derived: the mean alone would put the H100's knee at ~4.0. The
default peaks are steps of ``knee / 4.5`` (a multiple of 0.25): six at least,
four of them at or below the knee, and more up to kvcached's own knee (where
the peaking model's burst plus the others at ``low`` exceed the whole budget:
H100 ~4.5) while one configuration's block of them fits one call (a call holds
one block either way) and the whole sweep, both rounds, fits one session's
device time (:data:`SWEEP_SESSION_S`). H100: 0.5 .. 3.0 in steps of 0.5 (four
calls of ~353 s; eight peaks to 4.0 would take four of ~452 s, past a session);
H200: 1.75 .. 10.5 (six calls of 380-458 s: two sessions at its six).

**Models per GPU** (:func:`long_tail_plan`): a static split fits
``total / (weights + KV share + overhead)`` models (H100: 4, H200: 7); kvcached
is tried at 2x that and at the most up to 3x whose step, begun first in a call
(a resumed call starts every engine again), is estimated inside one (H100: 8
and 9, as 12 would take ~610 s; H200: 14 and 19). At most ``2 x lanes`` models are awake at once (a
lane's model and the one before it, until ``idle_after``), so the lanes are as
many as fit beside every sleeping engine's residue (~0.8 GiB each): 1 on the
H100, 2 on the H200. vLLM's level-1 sleep keeps an 8B's weights (14.96 GiB)
in pinned host memory: on a 128 GiB host beside ~4 GiB per engine and 16 GiB
kept free, ``floor((128 - 16 - 4 N) / 14.96)`` models sleep at level 1, the
rest at level 2 (weights reloaded from the files: seconds, so their first
requests may pass a 2 s SLO; the plan says how many).

**serve at 8B** (:func:`serve_plan`): the five engines' footprints against
``total x 0.95``; those that do not fit from the start begin ``lazy`` and are
started before the first phase that needs them, and a model no later phase
needs is put to sleep after its phase.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multi_model_trace import TraceSpec, upstream_delay

GIB = 1 << 30
MIB = 1 << 20
#: Llama-3.1-8B's bf16 weights (8,030,261,248 parameters; the bundle's safetensors)
WEIGHTS_8B_BYTES = 8_030_261_248 * 2
#: CUDA context, activations and buffers of one eager 8B engine, beside weights and KV
ENGINE_OVERHEAD_BYTES = 2 * GIB
#: what a weights-level sleep leaves of an engine on the GPU (H100, 1B: 816 MiB)
SLEEP_RESIDUE_BYTES = 816 * MIB
KV_PER_TOKEN_8B = 128 * 1024
#: host memory of the device machine (its MemTotal reads less at start: it grows)
HOST_BYTES = 128 * GIB
HOST_RESERVE_BYTES = 16 * GIB
#: per-engine host memory (API server and engine core), an estimate
ENGINE_HOST_BYTES = 4 * GIB
UTILIZATION = 0.95
#: the multi-model sweep's measured end to end on the H100 (13.1-16.7 s at peaks 1-2.5)
E2E_S = 15.0
#: a burst's size above its mean, in standard deviations of a Poisson count
BURST_Z = 2.0


@dataclass(frozen=True)
class Card:
    """The GPU a run found: its name and total memory (nvidia-smi)."""

    name: str
    memory_mib: int

    @property
    def total_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def folder(self) -> str:
        return card_folder(self.name)


H100 = Card("NVIDIA H100 80GB HBM3", 81_559)
H200 = Card("NVIDIA H200", 143_771)


def card_folder(name: str) -> str:
    """The results folder of a card: ``h100`` for any H100, ``h200`` for an H200,
    else the first model number in the name (``a100``), else ``gpu``."""
    found = re.search(r"\b([A-Z]{1,3}\d{2,4})\b", name.upper().replace("NVIDIA", " "))
    return found.group(1).lower() if found else "gpu"


def parse_card(text: str) -> Card | None:
    """The first line of ``nvidia-smi --query-gpu=name,memory.total
    --format=csv,noheader,nounits``; None for anything else."""
    for line in text.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 1)]
        if len(parts) == 2 and parts[0] and parts[1].isdigit():
            return Card(parts[0], int(parts[1]))
    return None


def read_card() -> Card | None:
    """The card this machine has (nvidia-smi; ``CUDA_VISIBLE_DEVICES``' first), or None."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_card(done.stdout)


def results_dir(root: Path, card: Card | None) -> Path:
    """``benchmarks/results/<card>/`` under the repository ``root`` (``gpu`` without one)."""
    return root / "benchmarks" / "results" / (card.folder if card else "gpu")


def require_card(card: Card | None, what: str) -> Card:
    if card is None:
        raise SystemExit(
            f"{what}: no GPU found (nvidia-smi): give the sizes by hand or run on the device"
        )
    return card


# -- multi-model ----------------------------------------------------------------------------------
def busiest_in_flight(spec: TraceSpec, window_s: float, step_s: float = 0.05) -> float:
    """Expected arrivals of the busiest ``window_s`` of any one model's rate
    (requests in flight there if each takes ``window_s``: Little's law)."""
    if window_s <= 0:
        raise ValueError(f"window_s={window_s} must be > 0")
    n = int(spec.duration_s / step_s) + 1
    best = 0.0
    for model in range(spec.models):
        rates = [spec.rate(model, i * step_s) * step_s for i in range(n)]
        width = max(1, round(window_s / step_s))
        acc = sum(rates[:width])
        top = acc
        for i in range(width, n):
            acc += rates[i] - rates[i - width]
            top = max(top, acc)
        best = max(best, top)
    return best


#: the GPU trace's shape (``multi_model_gpu.GPU_TRACE``): upstream's ramp, no hold
GPU_TRACE_SHAPE: dict[str, Any] = {
    "slope": 1.0,
    "hold_s": 0.0,
    "tail_s": 10.0,
    "prompt_min": 2048,
    "prompt_max": 3072,
    "max_tokens": 512,
}


def gpu_trace_spec(peak: float, low: float = 1.0, models: int = 3, **trace: Any) -> TraceSpec:
    """The GPU sweep's trace at ``peak`` (upstream's stagger; ``low`` no higher than the peak)."""
    shape = {**GPU_TRACE_SHAPE, **trace}
    return TraceSpec(
        peak=peak,
        low=min(low, peak),
        models=models,
        model_delay_s=upstream_delay(peak),
        **{k: shape[k] for k in GPU_TRACE_SHAPE},
    )


def kv_budget_bytes(
    total_bytes: int,
    engines: int,
    utilization: float = UTILIZATION,
    weights: int = WEIGHTS_8B_BYTES,
    overhead: int = ENGINE_OVERHEAD_BYTES,
) -> int:
    """The KV memory ``engines`` engines share: ``total x utilization`` less
    their weights and overhead (what the ledger grants once they are up)."""
    return int(total_bytes * utilization) - engines * (weights + overhead)


def engines_fit(
    total_bytes: int,
    utilization: float = UTILIZATION,
    weights: int = WEIGHTS_8B_BYTES,
    overhead: int = ENGINE_OVERHEAD_BYTES,
    min_kv: int = 4096 * KV_PER_TOKEN_8B,
) -> int:
    """Engines that fit with at least one full-length request's KV (``min_kv``) each."""
    return max(0, int(total_bytes * utilization) // (weights + overhead + min_kv))


def peak_point(
    peak: float,
    share: int,
    budget: int,
    engines: int,
    request_kv: int,
    e2e_s: float,
    low: float,
    z: float = BURST_Z,
    **trace: Any,
) -> dict[str, Any]:
    """One peak's arithmetic: the busiest model's in flight, its burst, against
    its static share and (with the others at ``low``) against the whole budget."""
    spec = gpu_trace_spec(peak, low, engines, **trace)
    mean = busiest_in_flight(spec, e2e_s)
    burst = mean + z * math.sqrt(mean)
    others = (engines - 1) * spec.low * e2e_s
    everyone = mean + others + z * math.sqrt(mean + others)
    return {
        "peak": peak,
        "assumed_e2e_s": e2e_s,
        "in_flight": round(mean, 1),
        "in_flight_burst": round(burst, 1),
        "kv_held_gib": round(mean * request_kv / GIB, 2),
        "share_gib": round(share / GIB, 2),
        "over_share": round(mean * request_kv / share, 2),
        "over_share_burst": round(burst * request_kv / share, 2),
        "over_budget_burst": round(everyone * request_kv / budget, 2),
        "trace_s": round(spec.duration_s, 2),
        "expected_requests": round(expected_requests(spec), 1),
        "prefill_tok_s_at_peak": round(peak * (spec.prompt_min + spec.prompt_max) / 2),
    }


def expected_requests(spec: TraceSpec, step_s: float = 0.05) -> float:
    """Requests a trace of ``spec`` holds on average (its rate integrated)."""
    n = int(spec.duration_s / step_s)
    return sum(spec.rate(m, i * step_s) * step_s for m in range(spec.models) for i in range(n))


def knee(
    share: int,
    request_kv: int,
    e2e_s: float,
    low: float,
    engines: int,
    key: str = "over_share_burst",
    budget: int | None = None,
    **trace: Any,
) -> float | None:
    """The lowest peak (to 0.01 req/s) where ``key`` passes 1; None below 40 req/s."""
    budget = budget or share * engines

    def over(p: float) -> float:
        return peak_point(p, share, budget, engines, request_kv, e2e_s, low, **trace)[key]

    lo, hi = 0.05, 40.0
    if over(hi) <= 1.0:
        return None
    if over(lo) > 1.0:
        return lo
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if over(mid) > 1.0 else (mid, hi)
    return round(hi, 2)


#: the multi-model harness on the H100 (the two calls of 2026-12-06 at ce1c439): seconds
MEASURED_START_S = 82.0  #: three 8B engines ready (45-82 s; the slowest on a fresh machine)
MEASURED_RUN_TAIL_S = 14.0  #: a run's wall beyond its trace's arrivals (the last requests)
MEASURED_CALL_SETUP_S = 45.0  #: model folder (~30 s on a fresh machine), imports, versions
#: the command time a whole sweep (both rounds) may take: one session's 1,800 s of
#: device time less ~300 s for the machine's start (60-105 s, more when it fails
#: once), the transfers and the estimates' error, so that it can finish in one session
SWEEP_SESSION_S = 1500.0


def sweep_peaks(knee_peak: float, n: int = 6) -> list[float]:
    """``n`` peaks in steps of ``knee / (0.75 n)``, a multiple of 0.25: the knee
    three quarters of the way up (four of six at or below it, two past)."""
    if n < 2:
        raise ValueError(f"n={n}: a sweep needs at least 2 peaks")
    step = max(0.25, round(knee_peak / (0.75 * n) * 4) / 4)
    return [round(step * i, 2) for i in range(1, n + 1)]


def extend_sweep(
    peaks: list[float],
    ceiling: float | None,
    trace_s: Any,  # noqa: ANN401  (peak -> seconds of its trace)
    most: int = 10,
    session_s: float = SWEEP_SESSION_S,
) -> list[float]:
    """``peaks`` and more of its steps past them, up to ``ceiling`` (kvcached's own
    knee: past it the shared budget runs short too), while one configuration's
    block of them still fits one call (:func:`sweep_calls`: a call holds one
    block either way, so the extra peaks cost no call) and the whole sweep's
    calls, two rounds, fit ``session_s`` of command time (each extra peak costs
    every call its run: eight peaks on the H100 would take ~1,808 s, past a session)."""
    step, out = peaks[0], list(peaks)
    while len(out) < most:
        nxt = round(step * (len(out) + 1), 2)
        if ceiling is None or nxt > ceiling:
            break
        more = [*out, nxt]
        calls = sweep_calls([trace_s(p) for p in more], rounds=2)
        # the first call begins with the first configuration's block: it must hold all of it
        if len(calls[0]["runs"]) < len(more) or sum(c["estimate_s"] for c in calls) > session_s:
            break
        out = more
    return out


def multi_model_plan(
    total_bytes: int,
    *,
    engines: int = 3,
    utilization: float = UTILIZATION,
    budget_bytes: int | None = None,
    per_token: int = KV_PER_TOKEN_8B,
    prompt_min: int = 2048,
    prompt_max: int = 3072,
    max_tokens: int = 512,
    low: float = 1.0,
    e2e_s: float = E2E_S,
    peaks: list[float] | None = None,
    n_peaks: int = 6,
    **trace: Any,
) -> dict[str, Any]:
    """The multi-model sweep on a card of ``total_bytes`` (module docstring).
    ``budget_bytes``: the ledger's measured budget where known, else estimated."""
    fit = engines_fit(total_bytes, utilization)
    if fit < engines:
        raise ValueError(
            f"{engines} engines of an 8B do not fit {total_bytes / GIB:.1f} GiB "
            f"at utilization {utilization} (fit: {fit})"
        )
    estimate = kv_budget_bytes(total_bytes, engines, utilization)
    budget = budget_bytes or estimate
    share = budget // engines
    request_kv = int((prompt_min + prompt_max) / 2 + max_tokens / 2) * per_token
    trace = {**trace, "prompt_min": prompt_min, "prompt_max": prompt_max, "max_tokens": max_tokens}
    native_knee = knee(share, request_kv, e2e_s, low, engines, budget=budget, **trace)
    shared_knee = knee(share, request_kv, e2e_s, low, engines, "over_budget_burst", budget, **trace)
    chosen = list(peaks) if peaks else sweep_peaks(native_knee or 40.0, n_peaks)
    if not peaks:

        def trace_s(p: float) -> float:
            return gpu_trace_spec(p, low, engines, **trace).duration_s

        chosen = extend_sweep(chosen, shared_knee, trace_s)
    return {
        "total_gib": round(total_bytes / GIB, 2),
        "engines": engines,
        "engines_fit": fit,
        "utilization": utilization,
        "weights_gib_each": round(WEIGHTS_8B_BYTES / GIB, 2),
        "overhead_gib_each": round(ENGINE_OVERHEAD_BYTES / GIB, 2),
        "kv_budget_estimate_gib": round(estimate / GIB, 2),
        "kv_budget_gib": round(budget / GIB, 2),
        "kv_budget_source": "ledger" if budget_bytes else "estimate",
        "share_gib": round(share / GIB, 2),
        "request_kv_mib": round(request_kv / MIB, 1),
        "share_requests": round(share / request_kv, 1),
        "assumed_e2e_s": e2e_s,
        "burst_z": BURST_Z,
        "knee_peak": native_knee,
        "kvcached_knee_peak": shared_knee,
        "peaks": chosen,
        "peaks_from": "given"
        if peaks
        else f"steps of knee / {0.75 * n_peaks:g}, at least {n_peaks}, more up to kvcached's "
        "own knee while one configuration's block of them fits one call and the sweep one "
        "session",
        "per_peak": [
            peak_point(p, share, budget, engines, request_kv, e2e_s, low, **trace) for p in chosen
        ],
    }


def sweep_calls(
    trace_s: list[float],
    rounds: int = 2,
    deadline_s: float = 540.0,
    start_need_s: float = 120.0,
    stop_need_s: float = 20.0,
    drain_s: float = 60.0,
    start_s: float = MEASURED_START_S,
    tail_s: float = MEASURED_RUN_TAIL_S,
    setup_s: float = MEASURED_CALL_SETUP_S,
) -> list[dict[str, Any]]:
    """The device calls a multi-model sweep takes: ``multi_model.py``'s own rules
    (a block begins if its start and first trace fit, a peak if its trace, the
    drain and the stop fit; ``--resume`` goes on in the next call), timed with
    this session's measurements. One entry per call: its runs and its seconds."""
    blocks = []
    for rnd in range(rounds):
        order = ("kvcached", "native") if rnd % 2 == 0 else ("native", "kvcached")
        blocks += [(c, rnd) for c in order]
    todo = [(c, r, i) for c, r in blocks for i in range(len(trace_s))]
    calls: list[dict[str, Any]] = []
    while todo:
        t, runs, current = setup_s, [], None
        while todo:
            config, rnd, i = todo[0]
            need = trace_s[i] + drain_s + 15.0
            if current != (config, rnd):
                if deadline_s - t < start_need_s + need + stop_need_s:
                    break
                t += start_s + 5.0
                current = (config, rnd)
            if deadline_s - t < need + stop_need_s:
                break
            t += trace_s[i] + tail_s + 2.0
            runs.append(f"{config} r{rnd} #{i}")
            todo.pop(0)
            if not todo or todo[0][:2] != current:
                t += 2.0  # stop
                current = None
        if not runs:
            raise ValueError(f"no run fits a call of {deadline_s} s: {todo[0]}")
        calls.append({"runs": runs, "estimate_s": round(t)})
    return calls


# -- long tail --------------------------------------------------------------------------------------
#: a bring-up wave of lazy 8B engines (start, two warm-up requests, a sleep), estimated
#: from three 8B engines co-started in 45-82 s on the H100
WAVE_S = 75.0
CALL_SETUP_S = 60.0
#: the most a step begun first in a call may be estimated at (the device's limit is 600 s)
CALL_LIMIT_S = 575.0


def static_fit(total_bytes: int, weights: int, kv_bytes: int, overhead: int) -> int:
    """Models a static split holds: each its weights, KV share and overhead."""
    return max(0, total_bytes // (weights + kv_bytes + overhead))


def l1_models(
    n: int,
    host_bytes: int,
    weights_bytes: int,
    per_engine: int = ENGINE_HOST_BYTES,
    reserve: int = HOST_RESERVE_BYTES,
) -> int:
    """How many of ``n`` models sleep at vLLM level 1 (weights in pinned host
    memory) beside ``n`` engines' own host memory."""
    if weights_bytes <= 0:
        return n
    return max(0, min(n, (host_bytes - reserve - n * per_engine) // weights_bytes))


def lanes_fit(
    total_bytes: int,
    n: int,
    footprint: int,
    residue: int = SLEEP_RESIDUE_BYTES,
    utilization: float = UTILIZATION,
    most: int = 2,
) -> int:
    """Lanes (``2 x lanes`` models awake at once) that fit beside ``n`` engines'
    sleeping residue; at least 1, at most ``most`` (the trace's default)."""
    room = int(total_bytes * utilization) - n * residue
    return max(1, min(most, room // (2 * footprint)))


def long_tail_step_s(n: int, lanes: int, wave: int) -> dict[str, Any]:
    """A kvcached step of ``n`` models begun first in a call (a resumed call starts
    every engine again): install and model, its bring-up waves, the trace (2 bursts
    a model of 6 s and a 1 s gap, on ``lanes``), 30 s of drain and 50 of shutdown."""
    trace_s = 2 * n * 7.0 / lanes
    waves = math.ceil(n / wave)
    return {"trace_s": trace_s, "waves": waves,
            "first_of_call_s": round(CALL_SETUP_S + waves * WAVE_S + trace_s + 30 + 50)}  # fmt: skip


def long_tail_plan(
    total_bytes: int,
    host_bytes: int = HOST_BYTES,
    weights: int = WEIGHTS_8B_BYTES,
    kv_bytes: int = 2 * GIB,
    overhead: int = ENGINE_OVERHEAD_BYTES,
    call_s: float = CALL_LIMIT_S,
) -> dict[str, Any]:
    """Models per GPU on a card of ``total_bytes`` (module docstring): kvcached at
    twice the static fit and at the most up to three times that one call holds."""
    footprint = weights + kv_bytes + overhead
    fit = static_fit(total_bytes, weights, kv_bytes, overhead)
    if fit < 1:
        raise ValueError(f"no 8B engine fits {total_bytes / GIB:.1f} GiB")
    lanes = lanes_fit(total_bytes, 3 * fit, footprint)
    room = int(total_bytes * UTILIZATION) - 3 * fit * SLEEP_RESIDUE_BYTES
    wave = max(1, min(5, room // footprint))
    fits_call = [
        n
        for n in range(2 * fit + 1, 3 * fit + 1)
        if long_tail_step_s(n, lanes, wave)["first_of_call_s"] <= call_s
    ]
    kv_ns = [2 * fit] + fits_call[-1:]
    per_n = {}
    for n in sorted({*kv_ns, 3 * fit}):
        k1 = l1_models(n, host_bytes, weights)
        per_n[str(n)] = {
            **long_tail_step_s(n, lanes, wave),
            "l1_models": k1,
            "l2_models": n - k1,
            "awake_most": 2 * lanes,
            "awake_gib": round((2 * lanes * footprint + n * SLEEP_RESIDUE_BYTES) / GIB, 1),
            "host_l1_gib": round((k1 * weights + n * ENGINE_HOST_BYTES) / GIB, 1),
        }
    return {
        "total_gib": round(total_bytes / GIB, 2),
        "host_gib": round(host_bytes / GIB, 1),
        "footprint_gib": round(footprint / GIB, 2),
        "static_fit": fit,
        "static_ns": [fit],
        "kvcached_ns": kv_ns,
        "aim_n": 3 * fit,
        "call_limit_s": call_s,
        "lanes": lanes,
        "wave": wave,
        "wave_s_assumed": WAVE_S,
        "per_n": per_n,
        "level_2_note": "models past the level-1 count sleep at level 2 (weights "
        "reloaded from the files, seconds): their bursts' first requests may pass a 2 s SLO",
    }


# -- serve at 8B ------------------------------------------------------------------------------------
def serve_plan(
    total_bytes: int,
    phases: list[tuple[str, tuple[str, ...]]],
    footprints: dict[str, int],
    levels: dict[str, int | None],
    host_bytes: int = HOST_BYTES,
    weights: int = WEIGHTS_8B_BYTES,
    utilization: float = UTILIZATION,
) -> dict[str, Any]:
    """Which of serve_gpu's models start eagerly and which lazily, so that the
    models awake at any phase fit ``total x utilization``: in phase order, every
    model a phase needs is awake during it; a model no later phase needs sleeps
    after its last phase (its footprint then counts ``SLEEP_RESIDUE_BYTES``).
    ``levels``: a model's vLLM weights level (1 keeps its weights in host memory)
    or None (kvcached: its sleep frees KV only, so its footprint stays)."""
    room = int(total_bytes * utilization)
    order = [m for _, needs in phases for m in needs]
    first_use = {m: order.index(m) for m in footprints if m in order}
    last_phase = {m: max(i for i, (_, n) in enumerate(phases) if m in n) for m in first_use}
    eager: list[str] = []
    held = 0
    for m in sorted(first_use, key=lambda m: first_use[m]):
        if held + footprints[m] > room:
            break
        eager.append(m)
        held += footprints[m]
    awake: set[str] = set(eager)
    slept: set[str] = set()
    per_phase = []
    for i, (phase, needs) in enumerate(phases):
        awake |= set(needs)
        on_gpu = sum(
            footprints[m] if (m in awake or levels.get(m) is None) else SLEEP_RESIDUE_BYTES
            for m in awake | slept
        )
        per_phase.append({"phase": phase, "awake": sorted(awake), "gpu_gib": round(on_gpu / GIB, 1),
                          "fits": on_gpu <= room})  # fmt: skip
        done = {m for m in awake if last_phase.get(m, -1) <= i and levels.get(m) is not None}
        awake -= done
        slept |= done
    host_l1 = sum(weights for m, lvl in levels.items() if lvl == 1)
    host_need = host_l1 + len(footprints) * ENGINE_HOST_BYTES + HOST_RESERVE_BYTES
    return {
        "total_gib": round(total_bytes / GIB, 2),
        "room_gib": round(room / GIB, 2),
        "footprint_gib": {m: round(b / GIB, 2) for m, b in footprints.items()},
        "awake_fit": awake_fit(room, list(footprints.values())),
        "eager": eager,
        "lazy": [m for m in first_use if m not in eager],
        "sleep_after_phase": sleep_after_phase(phases, levels),
        "per_phase": per_phase,
        "fits": all(p["fits"] for p in per_phase),
        "host_gib_needed": round(host_need / GIB, 1),
        "host_gib": round(host_bytes / GIB, 1),
        "level_1_fits_host": host_need <= host_bytes,
    }


def awake_fit(room: int, footprints: list[int]) -> int:
    """How many of these models fit awake at once in ``room`` (the smallest first)."""
    held, n = 0, 0
    for size in sorted(footprints):
        if held + size > room:
            break
        held, n = held + size, n + 1
    return n


def sleep_after_phase(
    phases: list[tuple[str, tuple[str, ...]]], levels: dict[str, int | None]
) -> dict[str, list[str]]:
    """Per phase, the weights-level models whose last phase it is (put to sleep after
    it, so that the next phases' models fit); the last phase's stay as they are."""
    out: dict[str, list[str]] = {}
    for i, (phase, needs) in enumerate(phases[:-1]):
        later = {m for _, n in phases[i + 1 :] for m in n}
        done = sorted(m for m in needs if m not in later and levels.get(m) is not None)
        if done:
            out[phase] = done
    return out


def host_bytes_at_least(floor_bytes: int = HOST_BYTES) -> int:
    """This machine's memory, at least ``floor_bytes`` (a Firecracker machine's
    MemTotal starts small and grows with use)."""
    return max(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), floor_bytes)
