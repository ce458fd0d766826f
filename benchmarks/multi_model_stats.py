"""The multi-model benchmark's statistics: per run, and per peak and
configuration pooled over rounds, with the speed-ups and the controls."""

from __future__ import annotations

import math
from typing import Any

from multi_model_client import Run

CONFIGS = ("kvcached", "native")


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


def ttft_values(requests: list[dict[str, Any]]) -> list[float]:
    """Every request's TTFT: measured where a first token came (a request cut
    later still has it), else the lower bound a cut request waited
    (``ttft_censored_s``). Requests that failed otherwise have none."""
    out = []
    for r in requests:
        if r.get("ttft_s") is not None:
            out.append(r["ttft_s"])
        elif r.get("ttft_censored_s") is not None:
            out.append(r["ttft_censored_s"])
    return out


def run_summary(run: Run) -> dict[str, Any]:
    ok = [r for r in run.requests if r.get("ok")]
    cut = [r for r in run.requests if r.get("cut")]
    return {
        "config": run.config,
        "round": run.round,
        "peak": run.peak,
        "trace_seed": run.trace_seed,
        "requests": len(run.requests),
        "failed": len(run.requests) - len(ok) - len(cut),
        "cut": len(cut),
        "ttft_censored": sum(1 for r in cut if r.get("ttft_s") is None),
        "drain_s": run.drain_s,
        "loadavg_1m_start": run.loadavg_start,
        "loadavg_1m_end": run.loadavg_end,
        "wall_s": round(run.wall_s, 2),
        "cpu_s": run.cpu_s,
        "cpu_ms_per_token": 1e3 * sum(run.cpu_s) / max(1, sum(r["tokens"] for r in ok)),
        "ttft_s": stats(ttft_values(run.requests)),
        "e2e_s": stats([r["e2e_s"] for r in ok]),
        "queue_s": stats([r["queue_s"] for r in ok if r.get("queue_s") is not None]),
        "client_late_s_max": max((r["late_s"] for r in run.requests), default=0.0),
        "samples": run.samples,
    }


def peak_key(peak: float) -> str:
    return f"{peak:g}"


def metric_values(run: Run, metric: str) -> list[float]:
    """One run's values of ``ttft_s`` (:func:`ttft_values`), ``e2e_s`` or
    ``queue_s`` (completed requests only)."""
    if metric == "ttft_s":
        return ttft_values(run.requests)
    return [r[metric] for r in run.requests if r.get("ok") and r.get(metric) is not None]


def ratio(num: float, den: float) -> float:
    """``num / den``; NaN where either is missing or the denominator is 0."""
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0:
        return float("nan")
    return num / den


def summarize(
    runs: list[Run], peaks: list[float], configs: tuple[str, ...] = CONFIGS
) -> dict[str, Any]:
    """Per peak and configuration the TTFT, end-to-end and queue statistics
    pooled over rounds; the speed-ups (native over kvcached) at each peak both
    configurations ran; the controls (round 0 over round 1 of one
    configuration); the servers' CPU time per output token
    (``cpu_per_token_ratio``: kvcached over native)."""
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
        for config in configs:
            out[metric][config] = {}
            for peak in peaks:
                sel = [run for run in runs if run.config == config and run.peak == peak]
                if sel:
                    vals = [v for run in sel for v in metric_values(run, metric)]
                    out[metric][config][peak_key(peak)] = stats(vals)
    for peak in peaks:
        k = peak_key(peak)
        if not all(k in out["ttft_s"].get(c, {}) for c in CONFIGS):
            continue
        kv, nat = out["ttft_s"]["kvcached"][k], out["ttft_s"]["native"][k]
        out["mean_ttft_speedup"][k] = ratio(nat["mean"], kv["mean"])
        out["p99_ttft_speedup"][k] = ratio(nat["p99"], kv["p99"])
        out["p50_ttft_speedup"][k] = ratio(nat["p50"], kv["p50"])
        out["mean_e2e_speedup"][k] = ratio(
            out["e2e_s"]["native"][k]["mean"], out["e2e_s"]["kvcached"][k]["mean"]
        )
        cpu = {}
        for config in CONFIGS:
            sel = [run for run in runs if run.config == config and run.peak == peak]
            tokens = sum(r["tokens"] for run in sel for r in run.requests if r.get("ok"))
            cpu[config] = 1e3 * sum(sum(run.cpu_s) for run in sel) / max(1, tokens)
        out["cpu_ms_per_token"][k] = cpu
        out["cpu_per_token_ratio"][k] = ratio(cpu["kvcached"], cpu["native"])
    for config in configs:
        ctrl: dict[str, dict[str, float]] = {"mean_ttft_ratio": {}, "p99_ttft_ratio": {}}
        for peak in peaks:
            by_round = sorted(
                (run for run in runs if run.config == config and run.peak == peak),
                key=lambda run: run.round,
            )
            if len(by_round) < 2:
                continue
            a = stats(ttft_values(by_round[0].requests))
            b = stats(ttft_values(by_round[1].requests))
            ctrl["mean_ttft_ratio"][peak_key(peak)] = ratio(a["mean"], b["mean"])
            ctrl["p99_ttft_ratio"][peak_key(peak)] = ratio(a["p99"], b["p99"])
        out["control"][config] = ctrl
    return out
