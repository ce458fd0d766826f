"""Every figure the README and docs/benchmarks.md quote, against the committed result
file it comes from.

The measurement write-ups live in ``docs/benchmarks.md`` (``FIGURES``); the README
keeps a table of headline figures (``HEADLINES``). To quote a new figure, add a
``Figure`` to the list of the document it appears in, with the document's words and
the number in braces (``tests/readme_figures.py`` says what braces mean), the result
file (or a glob of runs: a range then covers every run, outliers included) and the
key. A number that is not ours to measure goes in ``UNMEASURED`` with the reason. A
ratio, µs or % figure in either document's prose (or in the other docs this test
reads) that none covers fails ``test_no_figure_goes_unchecked``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

import vllm_gpu
from tests import readme_figures as rf
from tests.readme_figures import Figure, Key, Unmeasured

README = (rf.ROOT / "README.md").read_text()
BENCHMARKS = (rf.ROOT / "docs" / "benchmarks.md").read_text()

MEMORY_RUNS = "h200/run*/memory-h200.json"
# Runs after the grow lock (runs 5 on): the pooled figure's "after".
MEMORY_RUNS_LOCKED = ("h200/run[5-9]/memory-h200.json", "h200/run[1-9][0-9]/memory-h200.json")
# vllm_gpu.py on the current defaults (page ops beside the step, a step-sized reserve).
GPU_GRAPHS_RUN = "h100/page-path-graphs/vllm-gpu-graphs.json"
GPU_EAGER_RUN = "h100/page-path-eager/vllm-gpu-eager.json"
GIL_RUNS = "h100/page-path-graphs/driver-gil*.json"
# The same defaults with at least 700 requests a side (commit ec77bdf).
GPU_700_GRAPHS = "h100/page-path-700/vllm-gpu-graphs.json"
GPU_700_EAGER = "h100/page-path-700/vllm-gpu-eager*.json"


# The pooled block of one vllm_gpu.py run, in the order its write-up quotes it.
POOLED_700_KEYS = (
    "pooled.candidate.requests",
    "throughput_ratio.median",
    "pooled.candidate.mean_ttft_ratio",
    "pooled.control.mean_ttft_ratio",
    "pooled.candidate.mean_tpot_ratio",
    "pooled.control.mean_tpot_ratio",
    "pooled.candidate.paired_ttft_delta_ms.median",
    lambda d: -d["pooled"]["control"]["paired_ttft_delta_ms"]["median"],
)


# The same block where both paired medians are quoted as "ms below" native's.
POOLED_BELOW_KEYS = (
    "throughput_ratio.median",
    "pooled.candidate.mean_ttft_ratio",
    "pooled.control.mean_ttft_ratio",
    "pooled.candidate.mean_tpot_ratio",
    "pooled.control.mean_tpot_ratio",
    lambda d: -d["pooled"]["candidate"]["paired_ttft_delta_ms"]["median"],
    lambda d: -d["pooled"]["control"]["paired_ttft_delta_ms"]["median"],
)


def _tpot_over_baseline(run: dict) -> list[float]:
    """kvcached's mean TPOT less the baseline's, per round, in ms (the result's
    ``per_round`` block, recomputed: runs before it was written lack it)."""
    return vllm_gpu.per_round(run["rounds"], "candidate")["mean_tpot_ms_over_baseline"]


# Eager, pinned, both start orders, pooled with --equal-rounds (commit 14dd89b).
GPU_PINNED_EAGER = "h100/page-path-pinned/vllm-gpu-eager.json"


def _over_baseline(run: dict, role: str, key: str) -> list[float]:
    """``role``'s mean ``key`` (``ttft_ms``, ``tpot_ms``) less the baseline's, per
    round, in ms."""
    return vllm_gpu.per_round(run["rounds"], role)[f"mean_{key}_over_baseline"]


def _less_control(run: dict, key: str) -> list[float]:
    """kvcached's mean ``key`` less the control's, per round, in ms."""
    cand, control = (_over_baseline(run, r, key) for r in ("candidate", "control"))
    return [a - b for a, b in zip(cand, control, strict=True)]


def _pooled_less_control(*path: str) -> Callable[[dict], float]:
    """A Figure key: kvcached's pooled value at ``path`` less the control's."""

    def key(d: dict) -> float:
        cand, control = d["pooled"]["candidate"], d["pooled"]["control"]
        for part in path:
            cand, control = cand[part], control[part]
        return cand - control

    return key


def _pinned_part(merged: dict, stem: str) -> dict:
    """One of the calls the pinned pool merged, read from its own file."""
    return json.loads((rf.RESULTS / "h100" / "page-path-pinned" / f"{stem}.json").read_text())


# CUDA graphs, pinned, both start orders, pooled with --equal-rounds (commit 5cca7b0).
GPU_PINNED_GRAPHS = "h100/page-path-graphs-pinned/vllm-gpu-graphs.json"
MAP_BESIDE_GPU_BOUND = tuple(
    f"h100/map-beside-kernels/map-beside-kernels{s}.json" for s in ("", "-4096")
)


def _graphs_part(stem: str, folder: str = "page-path-graphs-pinned") -> dict:
    path = rf.RESULTS / "h100" / folder / f"{stem}.json"
    return json.loads(path.read_text())


# CUDA graphs after the wait rule of 3636916 (commit 1ede519): every round of both calls.
GPU_WAIT_GRAPHS = "h100/page-path-graphs-wait/vllm-gpu-graphs.json"
# The three servers started together (commit 140394d, the page path of 1ede519).
GPU_TOGETHER_GRAPHS = "h100/page-path-together/graphs-together.json"
GPU_TOGETHER_EAGER = "h100/page-path-together/vllm-gpu-eager.json"


def _yield_requests() -> list[dict]:
    path = rf.RESULTS / "h100" / "multi-model-yield" / "multi-model-gpu-yield-requests.json"
    return json.loads(path.read_text())


def _yield_pooled(d: dict, config: str, stat: str) -> float:
    """TTFT ``stat`` over both rounds at 3.5 req/s: ``yield`` from the yield run,
    ``kvcached`` and ``native`` from the sweep's committed rounds (switch off)."""
    if config == "yield":
        runs = _yield_requests()
        config = "kvcached"
    else:
        runs = json.loads((rf.RESULTS / "h100" / "multi-model-gpu-requests.json").read_text())
    ttft = sorted(
        x["ttft_s"]
        for r in runs
        if r["config"] == config and float(r["peak"]) == 3.5
        for x in r["requests"]
        if x["ok"]
    )
    if stat == "mean":
        return statistics.fmean(ttft)
    if stat == "p50":
        return statistics.median(ttft)
    k = (len(ttft) - 1) * 0.99
    lo = int(k)
    hi = min(lo + 1, len(ttft) - 1)
    return ttft[lo] + (ttft[hi] - ttft[lo]) * (k - lo)


# The multi-model sweep on an H100 (issue #33): eight peaks, two rounds a side, merged.
H100_MULTI_MODEL = "h100/multi-model-gpu.json"
H100_LOW_PEAKS = ("0.5", "1", "1.5", "2", "2.5")  # no static third ran short


def _round_stat(d: dict, config: str, peak: str, stat: str) -> list[float]:
    """One configuration's TTFT ``stat`` (mean, p99) at ``peak``, a value per round."""
    return [
        r["ttft_s"][stat] for r in d["runs"] if r["config"] == config and f"{r['peak']:g}" == peak
    ]


def _worst_pairing(d: dict, peak: str, stat: str) -> float:
    """Native's best round over kvcached's worst: the smallest speed-up of any pairing."""
    return min(_round_stat(d, "native", peak, stat)) / max(_round_stat(d, "kvcached", peak, stat))


# The long tail on an H100 (issue #33): static at 4, kvcached at 8 and the fallback at 5.
H100_LONG_TAIL = "h100/long-tail-gpu.json"


def _lt_slo(step: str, key: str) -> Key:
    return lambda d: d["steps"][step]["slo"][key]


def _lt_wakes(d: dict, step: str, level: int) -> list[float]:
    """The wake times of one step's models that slept at ``level``."""
    return [w["wake_s"] for w in d["steps"][step]["wakes"] if w["level"] == level]


# The H200's last runs before the hot-path fold (runs 12 to 14, stale).
RUNS_NOW = "h200/run1[234]/memory-h200.json"
# memory.py on the folded hot path (issue #36), one H100.
MEMORY_H100 = "h100/memory-h100.json"


def _l1_vllm_wake(d: dict) -> float:
    """vLLM's own level-1 wake in a serve_gpu.py result (median over the rounds), s."""
    return statistics.median(r["engine_wake_s"] for r in d["levels"]["weights_l1"]["rounds"])


def _gil_at(d: dict, interval: float, key: str) -> float | None:
    """``key`` of a driver_gil.py result at one switch interval (None if not measured)."""
    for x in d["by_switch_interval"]:
        if abs(x["switch_interval_s"] - interval) < 1e-9:
            return x[key]
    return None


def _runs_wall(peak: float) -> list[float]:
    """Every run's wall time at ``peak`` in the main multi-model result."""
    doc = json.loads((rf.RESULTS / "multi-model-cpu.json").read_text())
    return [r["wall_s"] for r in doc["runs"] if r["peak"] == peak]


def _max_kvcached_mib(d: dict) -> float:
    """The most any kvcached model mapped, in MiB, over a multi-model result's samples."""
    return max(
        (x[m]["kv_bytes"] or 0) / 2**20
        for r in d["runs"]
        if r["config"] == "kvcached"
        for x in r["samples"]
        for m in d["setup"]["models"]
    )


def _controls(d: dict) -> list[float]:
    """Every control ratio (mean and P99, both configurations) of a multi-model result."""
    return [v for c in d["control"].values() for k in c.values() for v in k.values()]


FIGURES: list[Figure] = [
    # vLLM
    Figure(
        "on the current code: throughput {0.988}x native (median of {11} rounds, single rounds "
        "{0.848–1.336}x; TTFT p50 {0.986}x), while the native control measured {1.060}x, so "
        "differences of a few percent are noise at this scale; the kvcached server used {0.958}x "
        "native's CPU per output token",
        "vllm-cpu.json",
        (
            "throughput_ratio",
            "settings.rounds",
            "throughput_ratio_range",
            "ttft_p50_ratio",
            "control.throughput_ratio",
            "cpu_per_token_ratio",
        ),
    ),
    Figure(
        "(`benchmarks/vllm_block_pool.py`, {96} requests, 32 running at once), kvcached adds "
        "{1.13} µs per `allocate_slots` call, {36.3} µs per decode step (one call per running "
        "request), and the manager's work takes {1.114}x native's time (median of {9} rounds, "
        "{1.087–1.137}x;",
        "vllm-block-pool.json",
        (
            "settings.requests",
            "extra_us_per_allocate_slots",
            "extra_us_per_decode_step",
            "time_ratio",
            "settings.rounds",
            "time_ratio_range",
        ),
    ),
    Figure(
        "Before the shorter interval (stale since then): with overlap, steps took {0.880}x as "
        "long with the H200's per-call latencies emulated (median of 9 rounds, "
        "{0.867–0.932}x)",
        "page-ops-overlap.json",
        ("step_time_ratio", "step_time_ratio_range"),
    ),
    Figure(
        "(stale since then): with overlap, steps took 0.880x as long with the H200's per-call "
        "latencies emulated (median of 9 rounds, 0.867–0.932x) and {0.887}x on the host "
        "backend alone",
        "page-ops-overlap-host.json",
        "step_time_ratio",
    ),
    Figure(
        "Before the shorter interval (stale since then): with overlap, steps took 0.880x as "
        "long with the H200's per-call latencies emulated (median of 9 rounds, 0.867–0.932x) "
        "and 0.887x on the host backend alone (`page-ops-overlap*.json`); the step's thread "
        "still waited {11.2} ms per page op of the {20.6} ms it spent applying them itself",
        "page-ops-overlap.json",
        ("main_thread_ms_per_page_op.overlap", "main_thread_ms_per_page_op.sync"),
    ),
    Figure(
        "its one run so far, on a 2-core VM at load {11}",
        "page-ops-overlap-switch-loaded.json",
        lambda d: round(d["provenance"]["load_average_end"][0]),
    ),
    Figure(
        "single rounds swung from {0.71}x to {1.50}x",
        "page-ops-overlap-switch-loaded.json",
        (
            lambda d: d["step_time_ratio_range"][0],
            lambda d: d["step_time_ratio_range"][1],
        ),
    ),
    # driver
    Figure(
        "costs {0.96}x the raw ctypes loop (p50 {74.9} µs against {78.0} µs;",
        "driver-h200.json",
        ("overhead_ratio", "kvcached_us.2MiB.total.p50", "raw_us.2MiB.total.p50"),
    ),
    Figure(
        "64 MiB handles {0.98}x (`benchmarks/results/driver-h200.json`)",
        "driver-h200.json",
        "overhead_ratio_64MiB",
    ),
    Figure(
        "On the host backend, {1.02}x (`driver-host.json`)", "driver-host.json", "overhead_ratio"
    ),
    Figure(
        "CUDA graphs on (as vLLM serves by default; stale): 3 rounds before the call's deadline, "
        "{384} requests a side; throughput {1.000}x native, pooled mean TTFT {1.020}x against "
        "the native control's {0.946}x, paired TTFT {0.29} ms below native's against the "
        "control's {1.51} ms below (median); kvcached mapped {0.19} and unmapped {0.13} pages a request, every one of them "
        "beside the step ({0.32} overlapped)",
        GPU_GRAPHS_RUN,
        (
            "pooled.candidate.requests",
            "throughput_ratio.median",
            "pooled.candidate.mean_ttft_ratio",
            "pooled.control.mean_ttft_ratio",
            lambda d: -d["pooled"]["candidate"]["paired_ttft_delta_ms"]["median"],
            lambda d: -d["pooled"]["control"]["paired_ttft_delta_ms"]["median"],
            "page_ops_per_request.page_maps",
            "page_ops_per_request.page_unmaps",
            "page_ops_per_request.page_ops_overlapped",
        ),
    ),
    Figure(
        "Eager (stale): {5} rounds, {640} requests a side; throughput {1.008}x, pooled mean TTFT "
        "{0.927}x (control {0.923}x), mean TPOT {0.942}x (control {0.963}x), paired TTFT "
        "{0.73} ms below native's against the control's {1.43} ms below",
        GPU_EAGER_RUN,
        (lambda d: len(d["rounds"]), "pooled.candidate.requests", *POOLED_BELOW_KEYS),
    ),
    Figure(
        "CUDA graphs (stale): 3 rounds, {720} requests a side; throughput {1.0002}x, pooled mean TTFT "
        "{1.0049}x (control {0.9931}x), mean TPOT {0.9975}x (control {0.9997}x), paired TTFT "
        "{0.285} ms above native's against the control's {0.215} ms below (median)",
        GPU_700_GRAPHS,
        POOLED_700_KEYS,
    ),
    Figure(
        "Eager, {#two} runs (stale): {768-960} requests a side; throughput {0.9965-0.9972}x, pooled mean "
        "TTFT {1.009-1.021}x (control {0.977-0.981}x), mean TPOT {1.018-1.020}x (control "
        "{0.975-0.982}x), paired TTFT {0.490-0.955} ms above native's against the control's "
        "{0.870-1.385} ms below (median). kvcached's mean TPOT sat {0.04-0.51} ms above the "
        "baseline's in every one of the nine eager rounds",
        GPU_700_EAGER,
        (*POOLED_700_KEYS, _tpot_over_baseline),
    ),
    Figure(
        "and within {0.03} ms of it in the three rounds with CUDA graphs (stale)",
        GPU_700_GRAPHS,
        lambda d: max(abs(x) for x in _tpot_over_baseline(d)),
    ),
    Figure(
        "768 requests a side; stale since 3636916): throughput {1.0015}x, pooled mean TTFT {0.9717}x (control "
        "{0.9768}x), mean TPOT {0.9856}x (control {0.9821}x), paired TTFT {0.265} ms below "
        "native's against the control's {1.005} ms below (median).",
        GPU_PINNED_EAGER,
        POOLED_BELOW_KEYS,
    ),
    Figure(
        "in these stale runs it sat {0.01} ms a round below the control's on average over the five rounds",
        "h100/page-path-pinned/eager-rev.json",
        lambda d: -statistics.mean(_less_control(d, "tpot_ms")),
    ),
    Figure(
        "while started first it sat {0.53-0.59} ms above the control's (stale).",
        "h100/page-path-pinned/eager-fwd.json",
        lambda d: _less_control(d, "tpot_ms"),
    ),
    Figure(
        "the paired median is {0.74} ms above the control's (stale; asked: at most 0.5; the control's "
        "own median has moved between {2.24} ms below native's and {0.29} ms above from run "
        "to run)",
        "h100/page-path-pinned/vllm-gpu-eager.json",
        (
            _pooled_less_control("paired_ttft_delta_ms", "median"),
            lambda d: (
                -_pinned_part(d, "eager-fwd")["pooled"]["control"]["paired_ttft_delta_ms"]["median"]
            ),
            lambda d: _pinned_part(d, "eager-rev")["pooled"]["control"]["paired_ttft_delta_ms"][
                "median"
            ],
        ),
    ),
    Figure(
        "mean TTFT {0.261} s and p99 {0.850} s over 192 requests, where the sweep's "
        "switch-off kvcached rounds (commit 6b2765e, a separate run of the same trace, not "
        "side by side) had {0.364} s and {2.825} s; the p50 was {0.221} s against {0.207} s",
        "h100/multi-model-yield/multi-model-gpu-yield.json",
        (
            lambda d: _yield_pooled(d, "yield", "mean"),
            lambda d: _yield_pooled(d, "yield", "p99"),
            lambda d: _yield_pooled(d, "kvcached", "mean"),
            lambda d: _yield_pooled(d, "kvcached", "p99"),
            lambda d: _yield_pooled(d, "yield", "p50"),
            lambda d: _yield_pooled(d, "kvcached", "p50"),
        ),
    ),
    Figure(
        "(the longest queue {0.48} s); the models gave {0.6-2.3} GiB each to calls",
        "h100/multi-model-yield/multi-model-gpu-yield.json",
        (
            lambda d: max(x["queue_s"] for r in _yield_requests() for x in r["requests"]),
            lambda d: [
                max(s.get(m, {}).get("yielded_bytes", 0) for s in r["samples"]) / 2**30
                for r in d["runs"]
                for m in ("mm-a", "mm-b", "mm-c")
                if max(s.get(m, {}).get("yielded_bytes", 0) for s in r["samples"])
            ],
        ),
    ),
    Figure(
        "1,440 requests a side; stale since 3636916): throughput {1.0002}x, pooled mean TTFT {1.0177}x (control {0.9973}x), mean TPOT "
        "{1.0036}x (control {1.0009}x), paired TTFT {0.575} ms above native's against the "
        "control's {0.145} ms above (median)",
        GPU_PINNED_GRAPHS,
        (*POOLED_700_KEYS[1:-1], "pooled.control.paired_ttft_delta_ms.median"),
    ),
    Figure(
        "the paired median ({0.43} ms above the control's); the mean TTFT, {0.020} above the "
        "control's, does not (asked: at most 0.01; stale, as above)",
        GPU_PINNED_GRAPHS,
        (
            _pooled_less_control("paired_ttft_delta_ms", "median"),
            _pooled_less_control("mean_ttft_ratio"),
        ),
    ),
    Figure(
        "in these stale runs kvcached's mean TTFT less the control's was {1.10-4.61} ms in round 0 and {0.20} ms "
        "below it on average over the later rounds",
        GPU_PINNED_GRAPHS,
        (
            lambda d: [
                _less_control(_graphs_part(s), "ttft_ms")[0] for s in ("graphs-rev", "graphs-fwd")
            ],
            lambda d: (
                -statistics.mean(
                    x
                    for s in ("graphs-rev", "graphs-fwd")
                    for x in _less_control(_graphs_part(s), "ttft_ms")[1:]
                )
            ),
        ),
    ),
    Figure(
        "having taken the first call's time; every round pooled, {960} requests a side): "
        "throughput {0.9996}x, pooled mean TTFT {0.9966}x (control {0.9835}x), mean TPOT "
        "{1.0007}x (control {0.9971}x), paired TTFT {0.160} ms above native's against the "
        "control's {0.955} ms below (median)",
        GPU_WAIT_GRAPHS,
        POOLED_700_KEYS,
    ),
    Figure(
        "in round 0 kvcached's mean TTFT sat {0.40} and {0.11} ms below the baseline's",
        GPU_WAIT_GRAPHS,
        tuple(
            lambda d, s=s: (
                -_over_baseline(_graphs_part(s, "page-path-graphs-wait"), "candidate", "ttft_ms")[0]
            )
            for s in ("graphs-fwd", "graphs-rev")
        ),
    ),
    Figure(
        "({2.25} and {3.10} ms above it at 5cca7b0, stale)",
        GPU_PINNED_GRAPHS,
        (
            lambda d: _over_baseline(_graphs_part("graphs-fwd"), "candidate", "ttft_ms")[0],
            lambda d: _over_baseline(_graphs_part("graphs-rev"), "candidate", "ttft_ms")[0],
        ),
    ),
    Figure(
        "and over the four rounds kvcached's paired mean sat {0.18} ms below native's. Against "
        "#34's figures this meets throughput and mean TPOT ({0.0036} above the control's); the "
        "mean TTFT is {0.013} above the control's and the paired median {1.115} ms above it",
        GPU_WAIT_GRAPHS,
        (
            lambda d: -d["pooled"]["candidate"]["paired_ttft_delta_ms"]["mean"],
            _pooled_less_control("mean_tpot_ratio"),
            _pooled_less_control("mean_ttft_ratio"),
            _pooled_less_control("paired_ttft_delta_ms", "median"),
        ),
    ),
    Figure(
        "in the one forward round, where it started last, its mean TTFT ratio was {0.8903}",
        "h100/page-path-graphs-wait/graphs-fwd.json",
        "pooled.control.mean_ttft_ratio",
    ),
    Figure(
        "With kvcached started last alone ({720} requests a side) every figure is met: mean "
        "TTFT {0.9980}x against the control's {1.0131}x, paired TTFT {0.390} ms below native's "
        "against the control's {0.215} ms above (median)",
        "h100/page-path-graphs-wait/graphs-rev.json",
        (
            "pooled.candidate.requests",
            "pooled.candidate.mean_ttft_ratio",
            "pooled.control.mean_ttft_ratio",
            lambda d: -d["pooled"]["candidate"]["paired_ttft_delta_ms"]["median"],
            "pooled.control.paired_ttft_delta_ms.median",
        ),
    ),
    Figure(
        "CUDA graphs, 4 rounds, {960} requests a side: throughput {0.9999}x, pooled mean TTFT "
        "{1.0315}x (control {1.0344}x), mean TPOT {1.0081}x (control {1.0046}x), paired TTFT "
        "{0.970} ms above native's against the control's {0.950} ms above (median)",
        GPU_TOGETHER_GRAPHS,
        (*POOLED_700_KEYS[:-1], "pooled.control.paired_ttft_delta_ms.median"),
    ),
    Figure(
        "Eager, 7 rounds over two calls, {1344} requests a side: throughput {1.0031}x, pooled "
        "mean TTFT {1.1002}x (control {0.9831}x), mean TPOT {1.0947}x (control {0.9849}x), "
        "paired TTFT {3.480} ms above native's against the control's {1.505} ms below (median)",
        GPU_TOGETHER_EAGER,
        POOLED_700_KEYS,
    ),
    Figure(
        "mean TTFT sat above the control's in every one of the {7} eager rounds, by {6.5} ms "
        "on average ({0.3} ms in the closest round)",
        GPU_TOGETHER_EAGER,
        (
            lambda d: len(d["rounds"]),
            lambda d: statistics.mean(_less_control(d, "ttft_ms")),
            lambda d: min(_less_control(d, "ttft_ms")),
        ),
    ),
    Figure(
        "where in the stale eager runs at 14dd89b (`page-path-pinned`, above) it sat {0.01} ms "
        "above it on average over {7} rounds, and at most {2.5} ms above in any",
        "h100/page-path-pinned/vllm-gpu-eager-all-rounds.json",
        (
            lambda d: statistics.mean(_less_control(d, "ttft_ms")),
            lambda d: len(d["rounds"]),
            lambda d: max(_less_control(d, "ttft_ms")),
        ),
    ),
    Figure(
        "steps took {0.815}x as long as with every op before them (median of {9} rounds, "
        "{0.660–0.974}x), where waiting at each next step took {1.072}x ({0.964–1.175}x) in "
        "the same rounds; the step's thread spent {13.1} ms per page op instead of {23.9}",
        "page-ops-overlap-wait-rule.json",
        (
            "wait_rule_ratio",
            "settings.rounds",
            "wait_rule_ratio_range",
            "step_time_ratio",
            "step_time_ratio_range",
            "main_thread_ms_per_page_op.wait_rule",
            "main_thread_ms_per_page_op.sync",
        ),
    ),
    Figure(
        "steps took {0.999-1.003}x their time alone with pages mapped and unmapped beside them",
        MAP_BESIDE_GPU_BOUND,
        lambda d: [r["step_ratio"] for r in d["shapes"].values()],
    ),
    Figure(
        "and {0.59} ms a page where the step's thread is busy launching from Python ({1.26}x its time)",
        "h100/map-beside-kernels/map-beside-kernels-64.json",
        (
            lambda d: d["shapes"]["launch"]["us_per_page"] / 1e3,
            "shapes.launch.step_ratio",
        ),
    ),
    Figure(
        "Over the five (now stale) runs on either commit the control's pooled mean TTFT ranged {0.923-0.993}x",
        # the runs at ce1c439 and ec77bdf (page-path-pinned's are quoted on their own)
        tuple(f"h100/page-path-{d}/vllm-gpu-*.json" for d in ("eager", "graphs", "700")),
        "pooled.control.mean_ttft_ratio",
    ),
    Figure(
        "from these stale runs: two native servers differed by 5-8% in pooled mean TTFT (the control's {0.946}x with "
        "CUDA graphs",
        GPU_GRAPHS_RUN,
        "pooled.control.mean_ttft_ratio",
    ),
    Figure("and {0.923}x eager; both stale)", GPU_EAGER_RUN, "pooled.control.mean_ttft_ratio"),
    Figure(
        "calls: the busy thread kept {0.76–1.01} of its speed (median of 3 rounds per interval)",
        GIL_RUNS,
        lambda d: [x["busy_kept"] for x in d["by_switch_interval"]],
    ),
    Figure(
        "a page took {1.77–2.31} ms alone and {354–356} ms beside the busy thread at Python's "
        "default 5 ms interval, {70.3} ms at 0.5 ms, {18.0} ms at 0.1 ms and {9.89} ms at 0.02 "
        "ms (the busy thread then kept {0.93} of its speed)",
        GIL_RUNS,
        (
            lambda d: [x["ms_per_page_alone"] for x in d["by_switch_interval"]],
            lambda d: _gil_at(d, 0.005, "ms_per_page_together"),
            lambda d: _gil_at(d, 0.0005, "ms_per_page_together"),
            lambda d: _gil_at(d, 0.0001, "ms_per_page_together"),
            lambda d: _gil_at(d, 0.00002, "ms_per_page_together"),
            lambda d: _gil_at(d, 0.00002, "busy_kept"),
        ),
    ),
    Figure(
        "The ledger's KV budget was {24.45} GiB, static thirds of {8.15} GiB; 0 failed and 0 cut "
        "requests in all {32} runs.",
        H100_MULTI_MODEL,
        (
            lambda d: d["setup"]["budget_bytes"] / 2**30,
            lambda d: d["setup"]["static_bytes"] / 2**30,
            lambda d: len(d["runs"]) if all(r["failed"] == r["cut"] == 0 for r in d["runs"]) else 0,
        ),
    ),
    *[
        Figure(
            f"| {key} | {{{n}}} | {{{mean}}}x | {{{p50}}}x | {{{p99}}}x | {{{native}}} s | "
            f"{{{kvc}}} s |",
            H100_MULTI_MODEL,
            (
                lambda d, k=key: d["ttft_s"]["kvcached"][k]["n"],
                lambda d, k=key: d["mean_ttft_speedup"][k],
                lambda d, k=key: d["p50_ttft_speedup"][k],
                lambda d, k=key: d["p99_ttft_speedup"][k],
                lambda d, k=key: d["ttft_s"]["native"][k]["p99"],
                lambda d, k=key: d["ttft_s"]["kvcached"][k]["p99"],
            ),
        )
        for key, n, mean, p50, p99, native, kvc in (
            ("0.5", 36, "1.03", "1.12", "0.97", "0.39", "0.40"),
            ("1", 84, "1.04", "1.06", "1.06", "0.37", "0.35"),
            ("1.5", 62, "1.02", "1.03", "1.04", "0.40", "0.38"),
            ("2", 102, "0.98", "0.98", "0.99", "0.54", "0.55"),
            ("2.5", 106, "1.03", "0.99", "1.15", "0.56", "0.49"),
            ("3", 150, "1.20", "0.97", "2.45", "1.51", "0.61"),
            ("3.5", 192, "2.54", "1.18", "2.20", "6.21", "2.82"),
            ("4", 176, "2.44", "1.11", "10.05", "5.65", "0.56"),
        )
    ],
    Figure(
        "kvcached's mean TTFT is {0.98–1.04}x the static split's, while each configuration "
        "against itself (the control: its second round over its first) moved {0.95–1.09}x in "
        "means at those peaks",
        H100_MULTI_MODEL,
        (
            lambda d: [d["mean_ttft_speedup"][k] for k in H100_LOW_PEAKS],
            lambda d: [
                c["mean_ttft_ratio"][k] for c in d["control"].values() for k in H100_LOW_PEAKS
            ],
        ),
    ),
    Figure(
        "P99 TTFT {10.05}x at 4 req/s, mean {2.54}x at 3.5. Past the knee one round is noisy (the "
        "controls reach {1.94}x mean for kvcached at 3.5 and {1.95}x for native at 4), but every "
        "kvcached round beats every native round there: the worst pairing is {1.84}x in mean at "
        "3.5 and {1.59}x at 4, {5.7}x in p99 at 4.",
        H100_MULTI_MODEL,
        (
            lambda d: d["p99_ttft_speedup"]["4"],
            lambda d: d["mean_ttft_speedup"]["3.5"],
            lambda d: d["control"]["kvcached"]["mean_ttft_ratio"]["3.5"],
            lambda d: d["control"]["native"]["mean_ttft_ratio"]["4"],
            lambda d: _worst_pairing(d, "3.5", "mean"),
            lambda d: _worst_pairing(d, "4", "mean"),
            lambda d: _worst_pairing(d, "4", "p99"),
        ),
    ),
    Figure(
        "On one H100 80GB: {5} models within the 2 s SLO against static's {4} ({1.25}x, not the "
        "asked 2x), {8} within 5 s.",
        H100_LONG_TAIL,
        (
            "models_per_gpu.kvcached",
            "models_per_gpu.static",
            "ratio",
            lambda d: d["models_per_gpu_by_slo_s"]["5"]["kvcached"],
        ),
    ),
    Figure(
        "| static, 4 models | {100} | {0} | {0.14} s | {0} | none (no sleep) |",
        H100_LONG_TAIL,
        tuple(_lt_slo("static-4", k) for k in ("requests", "failed", "ttft_p99_s", "slow")),
    ),
    Figure(
        "| kvcached, 8 models (5 sleep at level 1, 3 at level 2) | {196} | {0} | {2.39} s | {8} | "
        "level 1: {0.35–0.48} s ({9}); level 2: {2.16–2.66} s ({3}) |",
        H100_LONG_TAIL,
        (
            *(_lt_slo("kvcached-8", k) for k in ("requests", "failed", "ttft_p99_s", "slow")),
            lambda d: _lt_wakes(d, "kvcached-8", 1),
            lambda d: len(_lt_wakes(d, "kvcached-8", 1)),
            lambda d: _lt_wakes(d, "kvcached-8", 2),
            lambda d: len(_lt_wakes(d, "kvcached-8", 2)),
        ),
    ),
    Figure(
        "| kvcached, 5 models (all at level 1) | {135} | {0} | {0.44} s | {0} | level 1 only |",
        H100_LONG_TAIL,
        tuple(_lt_slo("kvcached-5", k) for k in ("requests", "failed", "ttft_p99_s", "slow")),
    ),
    Figure(
        "the counts at looser bounds are {8} models at 5 s and {8} at 10 s (2x static;",
        H100_LONG_TAIL,
        (
            lambda d: d["models_per_gpu_by_slo_s"]["5"]["kvcached"],
            lambda d: d["models_per_gpu_by_slo_s"]["10"]["kvcached"],
        ),
    ),
    # memory
    Figure(
        "| growing 64 MiB at a time, against 2 MiB handles (`grow_ratio_coalesced_64mib`) | "
        "**{19.24}x** ({18.66}) |",
        MEMORY_H100,
        ("grow_ratio_coalesced_64mib", "paired_round_median.grow_ratio_coalesced_64mib"),
    ),
    Figure(
        "| one page of one 2 MiB handle per take (`grow_ratio`) | {0.877}x ({0.883}): {3.17} µs "
        "of Python per page (null driver) on {33.7} µs of driver calls |",
        MEMORY_H100,
        (
            "grow_ratio",
            "paired_round_median.grow_ratio",
            "grow_explained.python_us_per_page_null_driver",
            "raw_us_per_2mib",
        ),
    ),
    Figure(
        "| 32 pages per take (`grow_ratio_batched_32`) | {0.989}x ({0.995}) |",
        MEMORY_H100,
        ("grow_ratio_batched_32", "paired_round_median.grow_ratio_batched_32"),
    ),
    Figure(
        "| 32 pages given back (`shrink_ratio_batched_32`) | {0.977}x ({0.980}) |",
        MEMORY_H100,
        ("shrink_ratio_batched_32", "paired_round_median.shrink_ratio_batched_32"),
    ),
    Figure(
        "same calls at the same addresses | {0.993}x ({0.993}) |",
        MEMORY_H100,
        (
            "grow_ratio_llama3_8b_same_addresses",
            "paired_round_median.grow_ratio_llama3_8b_same_addresses",
        ),
    ),
    Figure(
        "(one 128 MiB handle) | {48.1}x ({46.9}) |",
        MEMORY_H100,
        ("grow_ratio_llama3_8b_contiguous", "paired_round_median.grow_ratio_llama3_8b_contiguous"),
    ),
    Figure(
        "| one-page takes with the pool refilling beside them (`grow_ratio_pooled`) | "
        "{0.836}x ({0.837}) |",
        MEMORY_H100,
        ("grow_ratio_pooled", "paired_round_median.grow_ratio_pooled"),
    ),
    Figure(
        "locked over a no-op lock | {1.65}x faster (median round) |",
        MEMORY_H100,
        "grow_lock.locked_over_unlocked_median_round",
    ),
    Figure("`available_size()` took {0.178} µs.", MEMORY_H100, "available_size_us"),
    Figure(
        "in O(1) ({0.17–0.39} µs on the H200 machine over {#eleven} stale runs;",
        MEMORY_RUNS,
        "available_size_us",
    ),
    Figure(
        "{0.31–0.33} µs in stale runs 12–14, the last before the fold",
        RUNS_NOW,
        "available_size_us",
    ),
    Figure(
        "growing 64 MiB at a time is {19.1–20.2}x faster than a raw loop of 2 MiB handles "
        "on the H200 in stale runs 12–14",
        RUNS_NOW,
        "grow_ratio_coalesced_64mib",
    ),
    Figure(
        "({19.1–21.0}x over all {#eleven} stale runs; `grow_ratio_coalesced_64mib`)",
        MEMORY_RUNS,
        "grow_ratio_coalesced_64mib",
    ),
    Figure(
        "a raw loop with one set-access per 32 mappings grows {1.037}x the per-page loop, "
        "one unmap per 32 shrinks {1.070}x",
        "h200/run13/driver-runs-h200.json",
        ("paired_over_per_page.grow_k32", "paired_over_per_page.shrink_k32"),
    ),
    Figure(
        "So 32 pages per take grow at {0.977–1.026}x the raw per-page loop in stale runs 12–14 "
        "(paired {0.959–0.998};",
        RUNS_NOW,
        ("grow_ratio_batched_32", "paired_round_median.grow_ratio_batched_32"),
    ),
    Figure(
        "{0.898–1.026}x over all {#eleven} stale runs; `grow_ratio_batched_32`; target 1.15, not met)",
        MEMORY_RUNS,
        "grow_ratio_batched_32",
    ),
    Figure(
        "and 32 pages given back shrink at {1.009–1.021}x the raw unmap + release loop "
        "(stale; paired {0.958–0.988};",
        RUNS_NOW,
        ("shrink_ratio_batched_32", "paired_round_median.shrink_ratio_batched_32"),
    ),
    Figure(
        "one page per take, runs at {0.903–0.969}x a raw driver loop on the H200 in stale runs "
        "12–14 (paired-round median {0.880–0.916}; target 0.85, met;",
        RUNS_NOW,
        ("grow_ratio", "paired_round_median.grow_ratio"),
    ),
    Figure(
        "{0.870–0.969}x over all {#eleven} stale runs, `grow_ratio`): kvcached adds {1.97–4.16} µs of "
        "Python per page (null driver, all runs) to {32.8–36.6} µs of driver calls",
        MEMORY_RUNS,
        ("grow_ratio", "grow_explained.python_us_per_page_null_driver", "raw_us_per_2mib"),
    ),
    Figure(
        "grows at {0.963–1.008}x a raw loop making the same calls at the same addresses "
        "(stale runs 10 and 12–14; paired {0.992–1.008};",
        MEMORY_RUNS,
        (
            "grow_ratio_llama3_8b_same_addresses",
            "paired_round_median.grow_ratio_llama3_8b_same_addresses",
        ),
    ),
    Figure(
        "and at {0.920–0.995}x the sequential raw loop (stale)", MEMORY_RUNS, "grow_ratio_llama3_8b"
    ),
    Figure(
        "grows {48.8–53.2}x the raw loop (`grow_ratio_llama3_8b_contiguous`, stale)",
        MEMORY_RUNS,
        "grow_ratio_llama3_8b_contiguous",
    ),
    Figure(
        "alloc + free costs {0.993}x vLLM's own `BlockPool` ({0.949}x without the lock) on the "
        "CPU machine",
        "memory-host.json",
        ("alloc_free_ratio_thread_safe", "alloc_free_ratio"),
    ),
    # The hot path written once (issue #36): main's code and the folded code, interleaved.
    Figure(
        "({2.60–2.73} µs against",
        "hot-path-fold-host/memory-host-after-*.json",
        "grow_python_overhead.allocator_python_us_per_page",
    ),
    Figure(
        "against {1.69–1.78} µs;",
        "hot-path-fold-host/memory-host-before-*.json",
        "grow_python_overhead.allocator_python_us_per_page",
    ),
    Figure(
        "grant+refund pair took {1802–2013} ns of CPU against",
        "hot-path-fold-host/ledger-host-after-*.json",
        "profile_cpu_ns.ledger_no_recycle_grant_refund",
    ),
    Figure(
        "against {1509–1597} ns kept",
        "hot-path-fold-host/ledger-host-before-*.json",
        "profile_cpu_ns.ledger_no_recycle_grant_refund",
    ),
    Figure(
        "Two threads creating and mapping at once run at {0.911}x one thread in the median "
        "round on the H200 ({0.782} in the best;",
        "h200/run12/driver-threads-h200.json",
        ("ratio_over_serial_median.threads_2", "ratio_over_serial_best.threads_2"),
    ),
    Figure(
        "run {1.36–1.41}x faster with the grow lock than with a no-op in its place "
        "(`grow_lock`, median rounds, stale runs 12–14)",
        RUNS_NOW,
        "grow_lock.locked_over_unlocked_median_round",
    ),
    Figure(
        "run at {0.80–0.87}x the raw loop in stale runs 12–14 (`grow_ratio_pooled`;",
        RUNS_NOW,
        "grow_ratio_pooled",
    ),
    Figure("{0.80–0.91}x since the lock came (stale),", MEMORY_RUNS_LOCKED, "grow_ratio_pooled"),
    Figure("run 4 before it: {0.53}x)", "h200/run4/memory-h200.json", "grow_ratio_pooled"),
    # layouts
    Figure(
        "contiguous over per-layer {1.003} with shuffled blocks, {1.001} with sequential "
        "ones; against plain torch tensors, per-layer {1.000} and {1.003}, contiguous "
        "{1.003} and {1.005}; a gather + SDPA read of sequential blocks {1.02} on contiguous",
        "kv-layout-h200.json",
        (
            "summary.triton_paged_shuffled.contiguous_over_per_layer",
            "summary.triton_paged_sequential.contiguous_over_per_layer",
            "summary.triton_paged_shuffled.per_layer_over_native",
            "summary.triton_paged_sequential.per_layer_over_native",
            "summary.triton_paged_shuffled.contiguous_over_native",
            "summary.triton_paged_sequential.contiguous_over_native",
            "summary.gather_sdpa_sequential.contiguous_over_per_layer",
        ),
    ),
    Figure(
        "a contiguous page is one handle ({48.8–53.2}x the raw 2 MiB loop for a Llama-3-8B page, stale)",
        MEMORY_RUNS,
        "grow_ratio_llama3_8b_contiguous",
    ),
    Figure(
        "where a per-layer page is one handle per layer and buffer ({0.931}x in run 14, the "
        "latest, stale)",
        "h200/run14/memory-h200.json",
        "grow_ratio_llama3_8b",
    ),
    Figure(
        "KV writes up to {1.58}x slower on contiguous",
        "kv-layout-h200.json",
        "summary.write_sequential.contiguous_over_per_layer",
    ),
    # ledger
    Figure(
        "they filled {94.9–95.0}% of the device",
        ("h200/run14/ledger-gpu-test-*.json", "h200/run15/ledger-gpu-test-*.json"),
        lambda d: [100 * r["peak_fill_of_total"] for r in d["runs"]],
    ),
    Figure(
        "command and the 1-minute load average after each round: {1.36–2.16}; re-measured "
        "after issue #36 split the ledger into one class per job and handed its settings "
        "down). Speeds are ratios against the seed PR's design on the same accounting code (a "
        "blocking whole-file `flock` behind a lock object and a thread lock around every "
        "update, every grant to the ledger), taken round by round and reported as medians of "
        "{21} alternating rounds. On equal work (every grant to the ledger) the ledger runs at "
        "{1.15}x that design (the worst of 1, 2 and 4 processes, here one; key "
        "`no_recycle_vs_flock`; target 1.0), {1.851}x with 2 and {1.416}x with 4. In the "
        "grow/shrink pattern (32 grants, then 32 refunds) it runs at {1.139}x (the worst, again "
        "with one process; key `growshrink_vs_flock`; target 1.0), {1.562}x with 2 and "
        "{1.249}x with 4.",
        "ledger-host.json",
        (
            "machine.load_average_1min_per_round",
            "rounds",
            "no_recycle_vs_flock",
            "no_recycle_vs_flock_by_procs.2",
            "no_recycle_vs_flock_by_procs.4",
            "growshrink_vs_flock",
            "growshrink_vs_flock_by_procs.2",
            "growshrink_vs_flock_by_procs.4",
        ),
    ),
    Figure(
        "the bare lock and unlock costing {393} ns of CPU, where the seed's lock object and "
        "thread lock cost {647} ns (key `profile_cpu_ns`); a grant+refund pair costs {1488} ns "
        "against {1713} ns. Single one-process rounds ranged {1.095–1.176}x, so",
        "ledger-host.json",
        (
            "profile_cpu_ns.flock_lock_unlock",
            "profile_cpu_ns.flock_baseline_data_lock_pair",
            "profile_cpu_ns.ledger_no_recycle_grant_refund",
            "profile_cpu_ns.flock_baseline_grant_refund",
            lambda d: d["growshrink"]["variants"]["ledger"]["rounds_vs_flock"]["1"],
        ),
    ),
    Figure(
        "the ledger ran at {1.191}x on equal work and {1.116}x in the grow/shrink pattern",
        "h200/run15/ledger-host-16cpu.json",
        ("no_recycle_vs_flock", "growshrink_vs_flock"),
    ),
    Figure(
        "ran at {0.849–0.894}x of the flock design on equal work (key "
        "`ofd_no_recycle_vs_flock_by_procs`): the kernel's POSIX-lock path costs {660} ns of "
        "CPU per lock and unlock against {393} ns for `flock`",
        "ledger-host.json",
        (
            lambda d: list(d["ofd_no_recycle_vs_flock_by_procs"].values()),
            "profile_cpu_ns.ofd_lock_unlock",
            "profile_cpu_ns.flock_lock_unlock",
        ),
    ),
    Figure(
        "makes the shipped ledger {1.746–5.021}x the flock design (key `speedup_vs_flock`), at "
        "{0.93} µs per pair",
        "ledger-host.json",
        (lambda d: list(d["speedup_vs_flock"].values()), "pair_p50_us"),
    ),
    # kvcached serve
    Figure(
        "priority meanwhile, 1-minute load {2.6} to {5.2}): a `kv` sleep released {1.0} of the "
        "KV bytes held (target 0.99), a sleeping model's first token came {30.0} ms later than "
        "a ready one's (median of {7}; target 50), and through the router throughput was "
        "{1.003}x direct (median of {21} alternating rounds; target 0.97) with {1.70} ms more "
        "TTFT (target 2). Single rounds ranged {0.759–1.158}x; the router used {0.064} of the "
        "engine's CPU seconds over the same requests ({0.058} to {0.078} per round).",
        "serve-cpu.json",
        (
            lambda d: min(r["loadavg_1m"] for r in d["rounds"]),
            lambda d: max(r["loadavg_1m"] for r in d["rounds"]),
            "kv_sleep_released_fraction",
            "kv_wake_ms_p50",
            "settings.wake_rounds",
            "proxy_throughput_ratio",
            "settings.rounds",
            "proxy_ttft_p50_added_ms",
            "proxy_throughput_ratio_range",
            "router_cpu_over_engine",
            lambda d: d["router_cpu_over_engine_range"][0],
            lambda d: d["router_cpu_over_engine_range"][1],
        ),
    ),
    Figure(
        "With every CPU shared (`--engine-cpus all`; the {11}-round run of 6e79fff, kept as "
        "`serve-cpu-shared-cores.json`) the ratio was {0.960}x, single rounds {0.558–1.915}x: "
        "vLLM's own binding puts the worker's one OpenMP thread on CPU 0 and leaves CPU 1 to "
        "the engine's API server and scheduler, where the router ({0.036} of the engine's CPU) "
        "and the client compete with them, and the same tokens cost the engine {3.2} to {9.9} "
        "CPU seconds from round to round.",
        "serve-cpu-shared-cores.json",
        (
            "settings.rounds",
            "proxy_throughput_ratio",
            "proxy_throughput_ratio_range",
            "router_cpu_over_engine",
            lambda d: min(e[s]["engine_cpu_s"] for e in d["rounds"] for s in ("router", "direct")),
            lambda d: max(e[s]["engine_cpu_s"] for e in d["rounds"] for s in ("router", "direct")),
        ),
    ),
    Figure("The `stop` level's cold start took {54.8} s", "serve-cpu.json", "stop_cold_start_s"),
    Figure(
        "a level-1 wake to the first token took {0.475} s (15 GiB of weights back from pinned "
        "host memory), a `kv` wake {37.7} ms (median of 5), a weights sleep released {0.965} of "
        "the engine's GPU memory, a level-2 wake (weights from disk) took {3.41} s to the first "
        "token, the `stop` level's cold start {65.8} s, and {0} requests failed",
        "h200/serve-gpu.json",
        (
            "l1_wake_to_first_token_s",
            "kv_wake_ms_p50",
            "weights_sleep_released_fraction",
            "l2_wake_to_first_token_s",
            "stop_cold_start_s",
            "failed_requests",
        ),
    ),
    Figure(
        "a level-1 wake to the first token took {0.399} s (vLLM's own wake {0.352} s of it), a "
        "`kv` wake {23.6} ms (median of 5), a weights sleep released {0.965} of the engine's GPU "
        "memory, a level-2 wake {2.11} s, the `stop` level's cold start {41.5} s, and {0} "
        "requests failed",
        "h100/serve-gpu.json",
        (
            "l1_wake_to_first_token_s",
            _l1_vllm_wake,
            "kv_wake_ms_p50",
            "weights_sleep_released_fraction",
            "l2_wake_to_first_token_s",
            "stop_cold_start_s",
            "failed_requests",
        ),
    ),
    # the multi-model benchmark
    Figure(
        "Mean TTFT speed-up (native over kvcached) was {1.15}x, {0.81}x, {1.08}x, {0.95}x at "
        "peaks 1, 2, 3, 4 (P99 {1.07}x, {0.94}x, {1.11}x, {0.82}x), while each configuration "
        "against itself, in the control round, measured {0.58}x to {1.75}x (mean; P99 {0.52}x "
        "to {1.68}x)",
        "multi-model-cpu.json",
        (
            "mean_ttft_speedup.1",
            "mean_ttft_speedup.2",
            "mean_ttft_speedup.3",
            "mean_ttft_speedup.4",
            "p99_ttft_speedup.1",
            "p99_ttft_speedup.2",
            "p99_ttft_speedup.3",
            "p99_ttft_speedup.4",
            lambda d: min(v for c in d["control"].values() for v in c["mean_ttft_ratio"].values()),
            lambda d: max(v for c in d["control"].values() for v in c["mean_ttft_ratio"].values()),
            lambda d: min(v for c in d["control"].values() for v in c["p99_ttft_ratio"].values()),
            lambda d: max(v for c in d["control"].values() for v in c["p99_ttft_ratio"].values()),
        ),
    ),
    Figure(
        "The 1-minute load average of {7.8} to {22.1} is the benchmark's own",
        "multi-model-cpu.json",
        (
            lambda d: min(r["loadavg_1m_start"] for r in d["runs"]),
            lambda d: max(r["loadavg_1m_end"] for r in d["runs"]),
        ),
    ),
    Figure(
        "(mean {1.63} s with kvcached and {1.37} s natively at peak 2, {13.18} s and {12.13} s "
        "at peak 4)",
        "multi-model-cpu.json",
        (
            "queue_s.kvcached.2.mean",
            "queue_s.native.2.mean",
            "queue_s.kvcached.4.mean",
            "queue_s.native.4.mean",
        ),
    ),
    Figure(
        "peak 4's {52.0} s of arrivals took {73.1–85.8} s to serve in either configuration "
        "(peak 2's {34.6} s took {38.9–40.2} s)",
        "multi-model-cpu-trace.json",
        (
            lambda d: max(
                r["t"] for t in d["traces"] if t["spec"]["peak"] == 4.0 for r in t["requests"]
            ),
            lambda d: _runs_wall(4.0),
            lambda d: max(
                r["t"] for t in d["traces"] if t["spec"]["peak"] == 2.0 for r in t["requests"]
            ),
            lambda d: _runs_wall(2.0),
        ),
    ),
    Figure(
        "from {10.71} ms natively at peak 1 to {4.11} ms at peak 4 (kvcached {11.16} and {4.51} "
        "ms)",
        "multi-model-cpu.json",
        (
            "cpu_ms_per_token.1.native",
            "cpu_ms_per_token.4.native",
            "cpu_ms_per_token.1.kvcached",
            "cpu_ms_per_token.4.kvcached",
        ),
    ),
    Figure(
        "At low load (peak 1) kvcached's servers used {1.04}x the CPU per output token of native "
        "ones (`cpu_per_token_ratio`; {1.02}x to {1.10}x over the peaks,",
        "multi-model-cpu.json",
        (
            "cpu_per_token_ratio.1",
            lambda d: min(d["cpu_per_token_ratio"].values()),
            lambda d: max(d["cpu_per_token_ratio"].values()),
        ),
    ),
    Figure(
        "and their mean TTFT there was {1.15}x native's",
        "multi-model-cpu.json",
        "mean_ttft_speedup.1",
    ),
    Figure(
        "the kvcached models mapped up to {24} MiB each against native's static 10.7, yet the "
        "mean TTFT speed-up was {1.01}x and {0.79}x (P99 {0.79}x and {0.83}x; controls {0.56}x "
        "to {0.82}x, each configuration's second round slower than its first), and vLLM's mean "
        "queue time was {5.10} s and {8.89} s with kvcached against {5.60} s and {7.21} s "
        "natively.",
        "multi-model-cpu-kvheavy.json",
        (
            _max_kvcached_mib,
            "mean_ttft_speedup.2",
            "mean_ttft_speedup.3",
            "p99_ttft_speedup.2",
            "p99_ttft_speedup.3",
            lambda d: min(_controls(d)),
            lambda d: max(_controls(d)),
            "queue_s.kvcached.2.mean",
            "queue_s.kvcached.3.mean",
            "queue_s.native.2.mean",
            "queue_s.native.3.mean",
        ),
    ),
    Figure(
        "its servers spent {1.04}x and {1.12}x native's CPU per output token",
        "multi-model-cpu-kvheavy.json",
        ("cpu_per_token_ratio.2", "cpu_per_token_ratio.3"),
    ),
    Figure(
        "mean TTFT {1.00}x native, P99 {0.73}x;",
        "multi-model-cpu-flush.json",
        ("mean_ttft_speedup.2", "p99_ttft_speedup.2"),
    ),
    Figure(
        "mapped up to {24} MiB against native's 10.7, and vLLM's mean queue time at peak 2 fell "
        "to {0.28–0.36} s from {1.02–1.28} s natively; but TTFT did not follow (mean speed-up "
        "{1.10}x and {0.60}x at peaks 2 and 3, P99 {1.03}x and {0.76}x; controls {0.53}x to "
        "{1.60}x)",
        "multi-model-cpu-oneatatime.json",
        (
            _max_kvcached_mib,
            lambda d: [
                r["queue_s"]["mean"]
                for r in d["runs"]
                if r["config"] == "kvcached" and r["peak"] == 2.0
            ],
            lambda d: [
                r["queue_s"]["mean"]
                for r in d["runs"]
                if r["config"] == "native" and r["peak"] == 2.0
            ],
            "mean_ttft_speedup.2",
            "mean_ttft_speedup.3",
            "p99_ttft_speedup.2",
            "p99_ttft_speedup.3",
            lambda d: min(_controls(d)),
            lambda d: max(_controls(d)),
        ),
    ),
]

# The README's table of headline figures: each row is a figure of docs/benchmarks.md,
# checked against the same file.
HEADLINES: list[Figure] = [
    Figure(
        "{62.9} s in a fresh venv made by the two commands above ({41.8} CPU-seconds, load "
        "{0.92} at the start)",
        "dev-loop.json",
        ("wall_s", "cpu_s", lambda d: d["provenance"]["load_average_start"][0]),
    ),
    Figure(
        "{77.2} s with vllm-cpu installed ({56.8} CPU-seconds, load {0.54})",
        "dev-loop-vllm.json",
        ("wall_s", "cpu_s", lambda d: d["provenance"]["load_average_start"][0]),
    ),
    Figure(
        "throughput {0.988}x native (median of {11} rounds; the native control measured {1.060}x)",
        "vllm-cpu.json",
        ("throughput_ratio", "settings.rounds", "control.throughput_ratio"),
    ),
    Figure(
        "serving an 8B shape on an H100 with CUDA graphs at {0.9996}x native throughput and "
        "{0.9966}x its mean TTFT, against a second native server's {0.9835}x ({960} requests "
        "a side",
        GPU_WAIT_GRAPHS,
        (
            "throughput_ratio.median",
            "pooled.candidate.mean_ttft_ratio",
            "pooled.control.mean_ttft_ratio",
            "pooled.candidate.requests",
        ),
    ),
    Figure(
        "P99 TTFT {10.05}x faster at a peak of 4 req/s per model, mean {2.54}x at 3.5; at the "
        "lowest peak (0.5) mean {1.03}x and p50 {1.12}x, where no third runs short",
        H100_MULTI_MODEL,
        (
            lambda d: d["p99_ttft_speedup"]["4"],
            lambda d: d["mean_ttft_speedup"]["3.5"],
            lambda d: d["mean_ttft_speedup"]["0.5"],
            lambda d: d["p50_ttft_speedup"]["0.5"],
        ),
    ),
    Figure(
        "| 5 models within a 2 s P99 TTFT against static's {4} ({1.25}x; the asked 2x is not "
        "met: the {3} models that sleep at level 2 wake in {2.16–2.66} s), {8} (2x) within 5 s |",
        H100_LONG_TAIL,
        (
            "models_per_gpu.static",
            "ratio",
            lambda d: len(_lt_wakes(d, "kvcached-8", 2)),
            lambda d: _lt_wakes(d, "kvcached-8", 2),
            lambda d: d["models_per_gpu_by_slo_s"]["5"]["kvcached"],
        ),
    ),
    Figure(
        "kvcached adds {1.13} µs per `allocate_slots` call",
        "vllm-block-pool.json",
        "extra_us_per_allocate_slots",
    ),
    Figure(
        "mean TTFT speed-up {0.81–1.15}x over peaks 1 to 4, no gain beyond the noise "
        "(controls {0.58–1.75}x)",
        "multi-model-cpu.json",
        (
            lambda d: list(d["mean_ttft_speedup"].values()),
            lambda d: [v for c in d["control"].values() for v in c["mean_ttft_ratio"].values()],
        ),
    ),
    Figure(
        "throughput {1.003}x, {1.70} ms more TTFT; a sleeping model's first token {30.0} ms later",
        "serve-cpu.json",
        ("proxy_throughput_ratio", "proxy_ttft_p50_added_ms", "kv_wake_ms_p50"),
    ),
    Figure(
        "level-1 wake to first token {0.475} s, `kv` wake {37.7} ms, a weights sleep releasing "
        "{0.965} of the engine's memory, {0} failed requests",
        "h200/serve-gpu.json",
        (
            "l1_wake_to_first_token_s",
            "kv_wake_ms_p50",
            "weights_sleep_released_fraction",
            "failed_requests",
        ),
    ),
    Figure(
        "level-1 wake to first token {0.399} s, `kv` wake {23.6} ms, a weights sleep releasing "
        "{0.965} of the engine's memory, {0} failed requests; under pressure only the least "
        "recently used model slept",
        "h100/serve-gpu.json",
        (
            "l1_wake_to_first_token_s",
            "kv_wake_ms_p50",
            "weights_sleep_released_fraction",
            "failed_requests",
        ),
    ),
    Figure(
        "A 2 MiB page's driver calls on the H200, against raw ctypes | {0.96}x |",
        "driver-h200.json",
        "overhead_ratio",
    ),
    Figure(
        "Growing 64 MiB at a time on an H100 80GB, against a raw loop of 2 MiB handles | "
        "{19.2}x faster (one run of 60 rounds, after the hot-path fold) |",
        MEMORY_H100,
        "grow_ratio_coalesced_64mib",
    ),
    Figure(
        "zero CUDA out-of-memory errors, {94.9–95.0}% of the device filled",
        ("h200/run14/ledger-gpu-test-*.json", "h200/run15/ledger-gpu-test-*.json"),
        lambda d: [100 * r["peak_fill_of_total"] for r in d["runs"]],
    ),
]

UNMEASURED: list[Unmeasured] = [
    Unmeasured(
        "Result on the 2-core machine: no gain beyond the noise; the goal (P99 speed-up >= 2 "
        "and mean >= 1.5 at the peaks where the static split queues, mean >= 0.95 at every "
        "peak) is not met.",
        "issue #13's targets, quoted as targets",
    ),
    Unmeasured(
        "Upstream made contiguous the CUDA default yet measured it 31% slower in "
        "attention on one GPU",
        "upstream's own figure, quoted as theirs",
    ),
]


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: rf.normalize(f.text)[:60])
def test_each_figure_of_docs_benchmarks_is_what_its_file_says(figure):
    problems = rf.check(figure, BENCHMARKS, "docs/benchmarks.md")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("figure", HEADLINES, ids=lambda f: rf.normalize(f.text)[:60])
def test_each_headline_figure_of_the_readme_is_what_its_file_says(figure):
    problems = rf.check(figure, README, "README")
    assert not problems, "\n".join(problems)


# Each document this test reads, with the Figures that may cover its numbers. The
# README and docs/benchmarks.md quote measurements; docs/memory.md and docs/ledger.md
# describe the same code and must send figures to docs/benchmarks.md, not quote them.
DOCUMENTS = {
    "README.md": HEADLINES,
    "docs/benchmarks.md": FIGURES,
    "docs/memory.md": [],
    "docs/ledger.md": [],
}


@pytest.mark.parametrize("doc", sorted(DOCUMENTS))
def test_no_figure_goes_unchecked(doc):
    claims = [f.text for f in DOCUMENTS[doc]] + [u.text for u in UNMEASURED]
    left = rf.unclaimed((rf.ROOT / doc).read_text(), claims)
    assert not left, (
        f"{doc} quotes figures no Figure in tests/test_readme_figures.py checks "
        f"(add one, or an Unmeasured entry saying why): {left}"
    )


def test_every_unmeasured_number_is_still_quoted():
    texts = [rf.normalize((rf.ROOT / doc).read_text()) for doc in DOCUMENTS]
    gone = [u.text for u in UNMEASURED if not any(rf.normalize(u.text) in t for t in texts)]
    assert not gone, f"Unmeasured entries no document quotes any more (remove them): {gone}"


def test_the_readme_demo_output_is_the_committed_run():
    """The demo's output in the README is ``demo-host.json`` (``python benchmarks/demo.py``)
    rendered as the demo prints it."""
    from kvcached.cli.demo import Summary, render_summary

    path = rf.RESULTS / "demo-host.json"
    data = rf.load(path)
    assert not rf.provenance_problems(path, data)
    assert not data["provenance"].get("stale"), "re-run python benchmarks/demo.py"
    s = data["summary"]
    summary = Summary(
        **{
            k: s[k]
            for k in (
                "instances",
                "budget_bytes",
                "usable_bytes",
                "duration_s",
                "per_instance",
                "peak_total_bytes",
                "sum_of_peaks_bytes",
                "static_capacity_bytes",
            )
        }
    )
    shown = render_summary(summary).strip("\n")
    assert f"```text\n{shown}\n```" in README, (
        "the README's demo output is not demo-host.json's; paste this:\n" + shown
    )


def test_every_result_file_records_where_it_came_from():
    problems = []
    for path in sorted(rf.RESULTS.rglob("*.json")):
        problems += rf.provenance_problems(path, rf.load(path))
    assert not problems, "\n".join(problems)


# -- the mechanism itself, on files made here -------------------------------------------------
@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(rf, "RESULTS", tmp_path)
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    prov = {
        "commit": "abc",
        "command": "python benchmarks/x.py",
        "machine": {"cpus": 2},
        "load_average_start": [1, 1, 1],
    }

    def write(name: str, stale: bool = False, **values) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        block = dict(prov, **({"stale": "code changed"} if stale else {}))
        path.write_text(json.dumps({**values, "provenance": block}))
        return path

    return write


def test_a_value_off_by_more_than_its_precision_fails(results):
    results("a.json", ratio=0.9605)
    assert not rf.check(Figure("costs {0.96}x", "a.json", "ratio"), "it costs 0.96x here")
    assert not rf.check(Figure("costs {0.961}x", "a.json", "ratio"), "it costs 0.961x")
    wrong = rf.check(Figure("costs {0.95}x", "a.json", "ratio"), "it costs 0.95x")
    assert wrong and "0.9605" in wrong[0]


def test_a_range_must_reach_every_run_outliers_included(results):
    for i, v in enumerate((0.914, 0.87, 0.951)):
        results(f"run{i}/m.json", grow=v)
    readme = "at 0.87–0.95x over three runs, or 0.88–0.95x"
    assert not rf.check(Figure("at {0.87–0.95}x over {#three} runs", "run*/m.json", "grow"), readme)
    dropped = rf.check(Figure("or {0.88–0.95}x", "run*/m.json", "grow"), readme)
    assert dropped and "0.87..0.951" in dropped[0]
    miscount = rf.check(
        Figure("at {0.87–0.95}x over {#four} runs", "run*/m.json", "grow"),
        "at 0.87–0.95x over four runs",
    )
    assert miscount and "3 files" in miscount[0]


def test_a_stale_file_is_quoted_only_as_stale(results):
    results("old.json", stale=True, ratio=1.1)
    results("new.json", ratio=1.1)
    assert rf.check(Figure("takes {1.1}x", "old.json", "ratio"), "takes 1.1x")
    assert not rf.check(Figure("takes {1.1}x (stale)", "old.json", "ratio"), "takes 1.1x (stale)")
    assert rf.check(Figure("takes {1.1}x (stale)", "new.json", "ratio"), "takes 1.1x (stale)")


def test_text_missing_from_the_readme_and_files_without_provenance_fail(results, tmp_path):
    results("a.json", ratio=2.0)
    assert "not in README" in rf.check(Figure("is {2.0}x", "a.json", "ratio"), "is 3x")[0]
    (tmp_path / "bare.json").write_text(json.dumps({"ratio": 2.0}))
    assert any(
        "no provenance" in p for p in rf.check(Figure("is {2.0}x", "bare.json", "ratio"), "is 2.0x")
    )


def test_unclaimed_finds_ratios_microseconds_and_bold_numbers_outside_code():
    readme = (
        "Fast: **1.5x** and 3 µs, 40% of it.\n\n```\n9.9x in code\n```\n"
        "<!-- 7x hidden -->\nChecked: 2.0x here.\n"
    )
    assert rf.unclaimed(readme, ["Checked: {2.0}x here."]) == ["**1.5x**", "1.5x", "3 µs", "40%"]
