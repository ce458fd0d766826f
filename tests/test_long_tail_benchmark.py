"""The long-tail benchmark's pure pieces (benchmarks/long_tail.py): its trace, the SLO
arithmetic, models per GPU, the memory arithmetic, resume and its serve configs. The run
itself needs servers (``--cpu`` on vLLM's CPU build, or the H200)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

import long_tail as lt
import serve_gpu
from kvcached.serve.config import parse_config

GIB = 1 << 30
WEIGHTS_8B = 16_060_000_000  # Llama-3.1-8B's bf16 safetensors (serve_gpu's docstring)


def _busy_share(trace: dict, model: int) -> float:
    return (
        sum(b["end"] - b["start"] for b in trace["bursts"] if b["model"] == model)
        / (trace["duration_s"])
    )


def test_the_trace_is_seeded_and_written_the_same_each_time():
    spec = lt.TraceSpec()
    a, b = lt.make_trace(spec, 14, 24), lt.make_trace(spec, 14, 24)
    assert a == b and a["sha256"] == b["sha256"]
    other = lt.make_trace(spec, 14, 25)
    assert other["sha256"] != a["sha256"] and other["requests"] != a["requests"]
    # another N is another trace, not a prefix of this one
    assert lt.make_trace(spec, 13, 24)["sha256"] != a["sha256"]


def test_the_trace_is_long_tailed_and_every_model_bursts():
    spec = lt.TraceSpec(bursts_per_model=4)
    trace = lt.make_trace(spec, 20, 7)
    bursts = Counter(b["model"] for b in trace["bursts"])
    assert set(bursts) == set(range(20))  # every model is really served
    assert sum(bursts.values()) == 4 * 20
    head = bursts[0] + bursts[1]
    tail = sum(bursts[m] for m in range(10, 20))
    assert head > 0.25 * sum(bursts.values()) and tail < 0.4 * sum(bursts.values())
    # most models idle most of the time
    idle = [m for m in range(20) if _busy_share(trace, m) < 0.2]
    assert len(idle) >= 15
    # and Zipf's head is really more popular than its tail over many seeds
    totals: Counter[int] = Counter()
    for seed in range(20):
        totals.update(b["model"] for b in lt.make_trace(spec, 20, seed)["bursts"])
    assert totals[0] > 3 * totals[19]


def test_bursts_move_from_model_to_model_on_at_most_lanes_at_once():
    spec = lt.TraceSpec(lanes=2, burst_s=6.0, gap_s=1.0)
    trace = lt.make_trace(spec, 12, 3)
    edges = sorted(
        [(b["start"], 1) for b in trace["bursts"]] + [(b["end"], -1) for b in trace["bursts"]]
    )
    live = peak = 0
    for _, d in edges:
        live += d
        peak = max(peak, live)
    assert peak <= 2
    by_model: dict[int, list] = {}
    for b in trace["bursts"]:
        by_model.setdefault(b["model"], []).append((b["start"], b["end"]))
    for spans in by_model.values():  # a model is never in two bursts at once
        spans.sort()
        assert all(s2 >= e1 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False))
    for r in trace["requests"]:  # every request inside a burst of its model
        assert any(s <= r["t"] < e for s, e in by_model[r["model"]])
        assert spec.prompt_min <= r["prompt_len"] <= spec.prompt_max
    # the trace's length: bursts * (burst + gap) / lanes, give or take a burst
    expect = 2 * 12 * (spec.burst_s + spec.gap_s) / 2
    assert abs(trace["duration_s"] - expect) <= spec.burst_s + spec.gap_s


def test_the_trace_spec_refuses_nonsense():
    with pytest.raises(ValueError):
        lt.TraceSpec(lanes=0)
    with pytest.raises(ValueError):
        lt.TraceSpec(prompt_min=10, prompt_max=5)


def _req(ttft: float, ok: bool = True) -> dict:
    return {"ttft_s": ttft if ok else -1.0, "ok": ok}


def test_slo_is_p99_ttft_and_nothing_failed():
    fast = [_req(0.1)] * 99
    assert lt.slo_check([*fast, _req(5.0)], 2.0)["met"]  # 1 slow of 100: the P99 is 0.1
    two = lt.slo_check([*fast[:98], _req(5.0), _req(5.0)], 2.0)
    assert not two["met"] and two["ttft_p99_s"] == 5.0 and two["slow"] == 2
    failed = lt.slo_check([*fast, _req(0, ok=False)], 2.0)
    assert not failed["met"] and failed["failed"] == 1 and failed["ttft_p99_s"] == 0.1
    assert not lt.slo_check([], 2.0)["met"]
    assert lt.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and lt.percentile([], 0.99) is None
    assert lt.percentile([1.0, math.inf], 0.99) == math.inf


def _step(config: str, n: int, met: bool, status: str = "done") -> dict:
    return {"config": config, "n": n, "status": status, "slo": {"met": met}}


def test_models_per_gpu_is_the_largest_n_met_with_every_smaller_one():
    steps = {
        "static-7": _step("static", 7, True),
        "kvcached-8": _step("kvcached", 8, True),
        "kvcached-14": _step("kvcached", 14, True),
        "kvcached-17": _step("kvcached", 17, False),
    }
    assert lt.models_per_gpu(steps, "static") == 7
    assert lt.models_per_gpu(steps, "kvcached") == 14
    steps["kvcached-11"] = _step("kvcached", 11, False)  # a miss below ends the count
    assert lt.models_per_gpu(steps, "kvcached") == 8
    steps["kvcached-5"] = _step("kvcached", 5, True, status="error: x")  # not measured
    assert lt.models_per_gpu(steps, "kvcached") == 8
    assert lt.models_per_gpu({}, "static") is None
    head = lt.headline({"steps": {k: {**v, "wakes": []} for k, v in steps.items()}})
    assert head["models_per_gpu"] == {"static": 7, "kvcached": 8}
    assert head["goal"]["met"] is False and head["ratio"] == pytest.approx(8 / 7)
    steps["kvcached-16"] = _step("kvcached", 16, True)
    steps.pop("kvcached-11")
    both = {"steps": {k: {**v, "wakes": []} for k, v in steps.items()}}
    assert lt.headline(both)["goal"]["met"] is True  # 16 of 7
    assert lt.headline({**both, "harness_check_only": "cpu"})["goal"]["met"] is None
    # a step that raised is recorded without wakes: the figures still come out
    both["steps"]["kvcached-20"] = _step("kvcached", 20, False, status="error: serve died")
    assert lt.headline(both)["models_per_gpu"] == {"static": 7, "kvcached": 16}


def test_memory_arithmetic_of_the_docstring():
    h200 = 143_771 << 20
    assert lt.static_fit(h200, WEIGHTS_8B, 2 * GIB, lt.ENGINE_OVERHEAD_BYTES) == 7
    assert lt.static_fit(h200, WEIGHTS_8B, 16 * GIB, lt.ENGINE_OVERHEAD_BYTES) == 4
    host = 128 * GIB
    assert lt.l1_models(14, host, WEIGHTS_8B) == 3
    assert lt.l1_models(8, host, WEIGHTS_8B) == 5
    assert lt.l1_models(40, host, WEIGHTS_8B) == 0
    assert lt.l1_models(2, 1 << 50, WEIGHTS_8B) == 2  # never more than the models
    assert lt.l1_models(3, host, 0) == 3


def test_resume_keeps_done_steps_and_skips_past_a_miss():
    plan = lt.plan_steps([7], [14, 8, 11])
    assert plan == [("static", 7), ("kvcached", 8), ("kvcached", 11), ("kvcached", 14)]
    old = {
        "steps": {
            "static-7": _step("static", 7, True),
            "kvcached-8": _step("kvcached", 8, True),
            "kvcached-11": _step("kvcached", 11, True, status="error: died"),
            "kvcached-20": _step("kvcached", 20, True),  # not in this plan
        }
    }
    kept = lt.merge_resumed(old, plan)
    assert sorted(kept) == ["kvcached-8", "static-7"]
    todo, skipped = lt.pending(plan, kept)
    assert todo == [("kvcached", 11), ("kvcached", 14)] and skipped == {}
    kept["kvcached-11"] = _step("kvcached", 11, False)
    todo, skipped = lt.pending(plan, kept)
    assert todo == [] and list(skipped) == ["kvcached-14"]
    assert lt.merge_resumed(None, plan) == {}


def test_a_kvcached_miss_falls_back_to_the_most_models_that_all_sleep_at_level_1():
    host = 128 * GIB
    # the H100's plan: static fits 4, kvcached at 8 and 9; 5 models all fit level 1, 6 do not
    assert lt.l1_models(5, host, WEIGHTS_8B) == 5 and lt.l1_models(6, host, WEIGHTS_8B) < 6
    assert lt.fallback_n([8, 9], 4, host, WEIGHTS_8B) == 5
    assert lt.fallback_n([5, 6], 4, host, WEIGHTS_8B) is None  # nothing between 4 and 5
    assert lt.fallback_n([8], 4, 1 << 50, WEIGHTS_8B) == 7  # a big host: level 1 for all
    plan = lt.plan_steps([4], [8, 9])
    steps = {"static-4": _step("static", 4, True)}
    assert lt.pending(plan, steps, 5) == ([("kvcached", 8), ("kvcached", 9)], {})
    steps["kvcached-8"] = _step("kvcached", 8, True)
    assert lt.pending(plan, steps, 5) == ([("kvcached", 9)], {})  # met: no fallback
    steps["kvcached-8"] = _step("kvcached", 8, False)
    todo, skipped = lt.pending(plan, steps, 5)
    assert todo == [("kvcached", 5)] and list(skipped) == ["kvcached-9"]
    steps["kvcached-5"] = _step("kvcached", 5, True)
    assert lt.pending(plan, steps, 5)[0] == []  # done: the sweep is complete
    assert lt.models_per_gpu(steps, "kvcached") == 5  # the count a miss at 8 still leaves
    assert lt.pending(plan, steps)[0] == []  # without a fallback nothing changes


def test_a_step_is_estimated_from_its_waves_and_trace():
    assert lt.step_estimate_s(14, 5, 150.0, 98.0) == 3 * 150 + 98 + 30
    assert lt.step_estimate_s(0, 5, 150.0, 56.0) == 56 + 30


def test_the_gpu_configs_sleep_at_weights_levels_and_split_statically():
    names = lt.model_names("kvcached", 4)
    doc = lt.serve_config(
        "kvcached", names, "/m", 9000, "/tmp/s", cpu=False, kv_bytes=2 * GIB,
        weights_levels=[1, 1, 2, 2], idle_after=3.0,
    )  # fmt: skip
    cfg = parse_config(doc)
    assert cfg.pressure == "sleep-lru" and [m.name for m in cfg.models] == names
    for m, level in zip(cfg.models, [1, 1, 2, 2], strict=True):
        assert m.start == "lazy" and m.sleep.level == "weights"
        assert m.sleep.weights_level == level and m.sleep.idle_after == 3.0
        argv = m.argv("h", 1)
        assert "--enable-sleep-mode" in argv and not m.kvcached
        assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == 2 * GIB
    static = parse_config(
        lt.serve_config(
            "static", lt.model_names("static", 3), "/m", 9000, "/tmp/s", cpu=False,
            kv_bytes=2 * GIB, weights_levels=[], idle_after=3.0,
        )
    )  # fmt: skip
    for m in static.models:
        argv = m.argv("h", 1)
        assert m.start == "eager" and m.sleep.level == "none" and not m.kvcached
        assert "--enable-sleep-mode" not in argv
        assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == 2 * GIB


def test_the_cpu_configs_use_kvcached_and_the_kv_level():
    cfg = parse_config(
        lt.serve_config(
            "kvcached", lt.model_names("kvcached", 2), "/tiny", 9000, "/tmp/s", cpu=True,
            kv_bytes=GIB, weights_levels=[], idle_after=1.0,
        )
    )  # fmt: skip
    for m in cfg.models:
        assert m.kvcached and m.sleep.level == "kv" and m.start == "lazy"
        assert m.environment({}).get("ENABLE_KVCACHED") == "true"
    static = parse_config(
        lt.serve_config(
            "static", ["s00"], "/tiny", 9000, "/tmp/s", cpu=True, kv_bytes=GIB,
            weights_levels=[], idle_after=1.0,
        )
    )  # fmt: skip
    assert not static.models[0].kvcached and static.models[0].sleep.level == "none"


def test_a_wave_is_the_slowest_start_measured_so_far():
    assert lt.measured_start_s({}) is None
    steps = {
        "static-7": _step("static", 7, True),
        "kvcached-8": {
            **_step("kvcached", 8, True),
            "bring_up": {"engines": [{"start_s": 95.0}, {"start_s": 121.5}, {"error": "x"}]},
        },
    }
    assert lt.measured_start_s(steps) == 121.5


def test_a_step_no_call_could_hold_is_begun_first_in_a_call():
    # 14 engines in 3 waves of 120 s and the 100.5 s trace: more than a 540 s call holds
    need = lt.step_estimate_s(14, 5, 120.0, 100.5)
    assert lt.first_of_call_anyway(need, 540.0)
    # 8 engines in 2 waves and 58.5 s fit a fresh call: wait for one instead
    assert not lt.first_of_call_anyway(lt.step_estimate_s(8, 5, 120.0, 58.5), 540.0)


def test_models_are_also_counted_at_looser_slo_bounds_from_the_same_requests():
    fast, slow = _req(0.5), _req(4.0)
    steps = {
        "static-7": {**_step("static", 7, True), "requests": [fast] * 100},
        "kvcached-8": {**_step("kvcached", 8, False), "requests": [fast] * 97 + [slow] * 3},
    }
    assert lt.models_per_gpu_at(steps, "kvcached", 2.0) is None
    assert lt.models_per_gpu_at(steps, "kvcached", 5.0) == 8
    head = lt.headline({"steps": steps})["models_per_gpu_by_slo_s"]
    assert head["2"] == {"static": 7, "kvcached": None}
    assert head["5"] == {"static": 7, "kvcached": 8}


def test_the_gpu_result_goes_under_its_cards_folder_and_the_cpu_one_beside():
    import gpu_plan

    results = lt.ROOT / "benchmarks" / "results"
    assert lt.default_out(False, gpu_plan.H100) == results / "h100" / "long-tail-gpu.json"
    assert lt.default_out(False, gpu_plan.H200) == results / "h200" / "long-tail-gpu.json"
    assert lt.default_out(True, None) == results / "long-tail-cpu.json"
    assert lt.card_plan(True, 128 << 30, 2 << 30) == (None, {})  # the CPU run sizes nothing


def test_the_h100_plan_runs_each_kvcached_step_in_a_call_of_its_own():
    """With gpu_plan's H100 counts (static 4, kvcached 8 and 9, waves of 3), the
    harness's own rules: kvcached-8 (no start measured yet: 120 s a wave) is begun
    as the first step of its call; kvcached-9, with the waves measured at ~75 s,
    fits a call of its own; the 3x step (12) would not, which is why it is not planned."""
    import gpu_plan

    plan = gpu_plan.long_tail_plan(gpu_plan.H100.total_bytes)
    lanes, wave = plan["lanes"], plan["wave"]
    spec = lt.TraceSpec(lanes=lanes)
    trace = {n: lt.make_trace(spec, n, 24)["duration_s"] for n in (8, 9, 12)}
    assert trace[8] == pytest.approx(plan["per_n"]["8"]["trace_s"], abs=2)
    left = 540 - 60  # a call's deadline less its set-up
    guessed = lt.step_estimate_s(8, wave, 120.0, trace[8])
    assert left < guessed + lt.SHUTDOWN_RESERVE_S and lt.first_of_call_anyway(guessed, 540)
    measured = lt.step_estimate_s(9, wave, 75.0, trace[9])
    assert measured + lt.SHUTDOWN_RESERVE_S <= left
    assert lt.step_estimate_s(12, wave, 75.0, trace[12]) + 60 + lt.SHUTDOWN_RESERVE_S > 575


def test_the_model_step_it_shares_with_serve_gpu_has_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The H200 call at 5a82f52 broke off at 0.0 s: serve_gpu.prepare_model read
    # args.shape, which long_tail's parser did not define.
    made = []
    monkeypatch.setattr(serve_gpu, "make_model", lambda shape, path, script: made.append(shape))
    monkeypatch.setattr(serve_gpu, "safetensors_bytes", lambda path: 16 << 30)
    args = lt.parser().parse_args(["--models-dir", str(tmp_path)])
    run = SimpleNamespace(args=args, result={}, work=tmp_path)
    assert serve_gpu.prepare_model(run) == str(tmp_path / "llama-3.1-8b")
    assert made == ["llama-3.1-8b"] and run.result["model"]["weights_bytes"] == 16 << 30
