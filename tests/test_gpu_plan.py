"""The GPU benchmarks' sizing from the card (benchmarks/gpu_plan.py, issue #33):
the H100 (81,559 MiB) and the H200 (143,771 MiB), checked against what the
H100's two multi-model calls measured (ledger budget 24.45 GiB; no queueing at
peak 2.0, native p99 TTFT 3.3 s at 2.5; three engines ready in 45-82 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpu_plan as gp

GIB = 1 << 30
#: the ledger's budget of three 8B engines on the H100 (results/h100/multi-model-*)
H100_LEDGER_BUDGET = 26_255_346_893


def test_the_card_is_read_from_nvidia_smi_and_named_by_its_folder():
    card = gp.parse_card("NVIDIA H100 80GB HBM3, 81559\n")
    assert card == gp.Card("NVIDIA H100 80GB HBM3", 81559) and card.folder == "h100"
    assert gp.parse_card("NVIDIA H200, 143771") == gp.H200 and gp.H200.folder == "h200"
    assert gp.card_folder("NVIDIA H100 PCIe") == "h100"
    assert gp.card_folder("NVIDIA A100-SXM4-80GB") == "a100"
    assert gp.card_folder("Some Card") == "gpu"
    assert gp.parse_card("") is None and gp.parse_card("No devices were found") is None
    root = Path("/repo")
    assert gp.results_dir(root, gp.H100) == root / "benchmarks/results/h100"
    assert gp.results_dir(root, gp.H200) == root / "benchmarks/results/h200"
    assert gp.results_dir(root, None) == root / "benchmarks/results/gpu"
    with pytest.raises(SystemExit, match="no GPU found"):
        gp.require_card(None, "x")


def test_the_kv_budget_is_the_cards_share_less_three_engines():
    # H100: 79.65 GiB x 0.95 - 3 x (14.96 + 2) GiB; the ledger granted 24.45 GiB
    h100 = gp.kv_budget_bytes(gp.H100.total_bytes, 3)
    assert abs(h100 - H100_LEDGER_BUDGET) < 0.5 * GIB
    assert 82 * GIB < gp.kv_budget_bytes(gp.H200.total_bytes, 3) < 83 * GIB
    assert gp.engines_fit(gp.H100.total_bytes) == 4 and gp.engines_fit(gp.H200.total_bytes) == 7


def test_in_flight_is_the_busiest_window_of_the_no_hold_ramp():
    # 0 -> P -> 1 at 1 req/s per second: (P - 1)^2 + W in a W-second window
    # (where the trace is long enough: peak 1's 15.5 s holds 14.9)
    for peak in (2.0, 3.0, 4.0):
        spec = gp.gpu_trace_spec(peak)
        assert gp.busiest_in_flight(spec, 15.0) == pytest.approx((peak - 1) ** 2 + 15, abs=0.1)
    # a peak below the low rate is flat at the peak
    assert gp.gpu_trace_spec(0.5).low == 0.5
    assert gp.busiest_in_flight(gp.gpu_trace_spec(0.5), 15.0) == pytest.approx(6.2, abs=0.1)
    # and the trace's length and requests as the H100 runs had them (15.5 s and 39 at peak 1)
    assert gp.gpu_trace_spec(1.0).duration_s == 15.5
    assert gp.expected_requests(gp.gpu_trace_spec(1.0)) == pytest.approx(38.2, abs=0.3)
    with pytest.raises(ValueError, match="window_s"):
        gp.busiest_in_flight(gp.gpu_trace_spec(1.0), 0)


def test_the_h100_sweep_holds_the_measured_knee():
    plan = gp.multi_model_plan(gp.H100.total_bytes)
    assert plan["engines"] == 3 and plan["share_requests"] == pytest.approx(24.0, abs=0.2)
    # measured: nothing short at 2.0, the static share short at 2.5
    assert 1.8 < plan["knee_peak"] < 2.5
    # steps of 0.5 from well below the knee: a block of eight (to 4.0) would still fit
    # one call, but the sweep's four calls would then take ~1,808 s, past a session
    assert plan["peaks"] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    traces = [p["trace_s"] for p in plan["per_peak"]]
    assert sum(c["estimate_s"] for c in gp.sweep_calls(traces)) <= gp.SWEEP_SESSION_S
    below = [p for p in plan["peaks"] if p <= plan["knee_peak"]]
    assert len(below) >= 3 and len(plan["peaks"]) - len(below) >= 2
    # kvcached's whole budget holds every peak of the sweep
    assert plan["kvcached_knee_peak"] > max(plan["peaks"])
    over = {p["peak"]: p for p in plan["per_peak"]}
    assert over[0.5]["over_share_burst"] < 0.6 and over[3.0]["over_share_burst"] > 1.1
    assert all(p["over_budget_burst"] < 1 for p in plan["per_peak"])
    # with the ledger's measured budget the knee moves a little, the same way
    measured = gp.multi_model_plan(gp.H100.total_bytes, budget_bytes=H100_LEDGER_BUDGET)
    assert measured["kv_budget_source"] == "ledger"
    assert measured["knee_peak"] <= plan["knee_peak"]


def test_the_h200_sweep_is_sized_to_its_larger_thirds():
    plan = gp.multi_model_plan(gp.H200.total_bytes)
    assert plan["share_gib"] == pytest.approx(27.5, abs=0.1)
    assert 7.0 < plan["knee_peak"] < 9.0
    assert len(plan["peaks"]) == 6 and plan["peaks"][0] < plan["knee_peak"] < plan["peaks"][-1]
    assert plan["peaks"] == [round(plan["peaks"][0] * i, 2) for i in range(1, 7)]
    # the old default (1..6) would not reach the knee there
    at_6 = gp.multi_model_plan(gp.H200.total_bytes, peaks=[6.0])["per_peak"][0]
    assert at_6["over_share_burst"] < 1.0 and plan["peaks"][-1] > 6.0


def test_given_peaks_are_kept_and_a_card_too_small_is_refused():
    plan = gp.multi_model_plan(gp.H100.total_bytes, peaks=[1.0, 8.0])
    assert plan["peaks"] == [1.0, 8.0] and plan["peaks_from"] == "given"
    assert [p["peak"] for p in plan["per_peak"]] == [1.0, 8.0]
    with pytest.raises(ValueError, match="do not fit"):
        gp.multi_model_plan(40 * GIB)
    assert gp.sweep_peaks(2.06) == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    six = gp.sweep_peaks(2.06)
    assert gp.extend_sweep(six, None, lambda p: 20.0) == six  # no ceiling: no more
    unbound = {"session_s": 1e9}
    assert gp.extend_sweep(six, 3.9, lambda p: 20.0, **unbound) == [*six, 3.5]  # the ceiling
    assert gp.extend_sweep(six, 9.0, lambda p: 20.0, most=7, **unbound) == [*six, 3.5]
    # traces so long that a call holds one run: the six stay six
    assert gp.extend_sweep(six, 9.0, lambda p: 200.0) == six
    # a peak more only while the whole sweep fits a session's command time
    assert len(gp.extend_sweep(six, 9.0, lambda p: 20.0, **unbound)) > 7  # to the call's limit
    four_calls = sum(c["estimate_s"] for c in gp.sweep_calls([20.0] * 7))
    assert gp.extend_sweep(six, 9.0, lambda p: 20.0, session_s=four_calls) == [*six, 3.5]
    assert gp.extend_sweep(six, 9.0, lambda p: 20.0, session_s=four_calls - 1) == six
    assert gp.sweep_peaks(0.1) == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]
    with pytest.raises(ValueError, match="at least 2"):
        gp.sweep_peaks(2.0, 1)


def test_the_sweep_takes_calls_of_at_most_the_deadline():
    plan = gp.multi_model_plan(gp.H100.total_bytes)
    traces = [p["trace_s"] for p in plan["per_peak"]]
    calls = gp.sweep_calls(traces, rounds=2, deadline_s=540)
    runs = [r for c in calls for r in c["runs"]]
    assert len(runs) == 2 * 2 * 6 and len(set(runs)) == len(runs)  # every run once
    assert all(c["estimate_s"] <= 540 for c in calls)
    # on the H100 a call holds one configuration's block of six: four calls
    assert len(calls) == 4 and calls[0]["runs"] == [f"kvcached r0 #{i}" for i in range(6)]
    assert runs[-1] == "kvcached r1 #5"  # round 1 runs the other way round
    # a longer call holds more; nothing fits a call too short for one start and trace
    assert len(gp.sweep_calls(traces, deadline_s=1200)) < len(calls)
    with pytest.raises(ValueError, match="no run fits"):
        gp.sweep_calls(traces, deadline_s=120)


def test_models_per_gpu_on_an_h100_and_an_h200():
    h100 = gp.long_tail_plan(gp.H100.total_bytes)
    # static: floor(79.65 / (14.96 + 2 + 2)) = 4; kvcached at 2x and the most up to 3x
    # that a call holds: 12 (four waves and a 168 s trace) is estimated past a call
    assert h100["static_fit"] == 4 and h100["kvcached_ns"] == [8, 9] and h100["aim_n"] == 12
    assert h100["per_n"]["12"]["first_of_call_s"] > h100["call_limit_s"]
    assert all(h100["per_n"][str(n)]["first_of_call_s"] <= 575 for n in h100["kvcached_ns"])
    # two lanes would have 4 awake (75.8 GiB) beside the sleepers' residue: one lane
    assert h100["lanes"] == 1 and h100["wave"] == 3
    n8 = h100["per_n"]["8"]
    assert n8["trace_s"] == 112.0 and n8["waves"] == 3
    # level 1 fits floor((128 - 16 - 4 x 8) / 14.96) = 5 of 8 in host memory
    assert (n8["l1_models"], n8["l2_models"]) == (5, 3)
    assert n8["awake_gib"] < 0.95 * 79.65 and n8["host_l1_gib"] <= 128 - 16
    h200 = gp.long_tail_plan(gp.H200.total_bytes)
    assert h200["static_fit"] == 7 and h200["lanes"] == 2 and h200["wave"] == 5
    assert h200["kvcached_ns"][0] == 14 and h200["per_n"]["14"]["l1_models"] == 3
    assert gp.lanes_fit(gp.H100.total_bytes, 0, 10 * GIB) == 2  # small engines: the default
    # a longer call holds the 3x step
    assert gp.long_tail_plan(gp.H100.total_bytes, call_s=650)["kvcached_ns"] == [8, 12]


SERVE_PHASES = [
    ("kv", ("kv",)),
    ("weights_l1", ("w1",)),
    ("weights_l2", ("w2",)),
    ("pressure", ("kv", "stop", "grow")),
    ("stop", ("stop",)),
]


def serve_footprints(native_kv: int) -> dict[str, int]:
    engine = gp.WEIGHTS_8B_BYTES + gp.ENGINE_OVERHEAD_BYTES
    kvcached = engine + 2 * GIB  # its reserve and first pages
    return {"kv": kvcached, "w1": engine + native_kv, "w2": engine + native_kv,
            "stop": kvcached, "grow": kvcached}  # fmt: skip


LEVELS = {"kv": None, "w1": 1, "w2": 2, "stop": None, "grow": None}


def test_serve_at_8b_starts_what_fits_and_the_rest_lazily():
    plan = gp.serve_plan(gp.H100.total_bytes, SERVE_PHASES, serve_footprints(8 * GIB), LEVELS)
    # 75.7 GiB of room: kv (19 GiB) and w1, w2 (25 GiB each) from the start
    assert plan["eager"] == ["kv", "w1", "w2"] and plan["lazy"] == ["stop", "grow"]
    assert plan["awake_fit"] == 3  # of five 8B engines: the point of sleeping them
    assert plan["sleep_after_phase"] == {"weights_l1": ["w1"], "weights_l2": ["w2"]}
    assert plan["fits"] and all(p["gpu_gib"] <= plan["room_gib"] for p in plan["per_phase"])
    pressure = next(p for p in plan["per_phase"] if p["phase"] == "pressure")
    assert pressure["awake"] == ["grow", "kv", "stop"]
    assert plan["level_1_fits_host"]  # one level-1 model: 15 GiB of 128
    # the H200 starts all five at once, as before
    h200 = gp.serve_plan(gp.H200.total_bytes, SERVE_PHASES, serve_footprints(8 * GIB), LEVELS)
    assert h200["eager"] == ["kv", "w1", "w2", "stop", "grow"] and h200["lazy"] == []
    assert h200["awake_fit"] == 5
    # a card that holds no phase's models says so
    small = gp.serve_plan(40 * GIB, SERVE_PHASES, serve_footprints(8 * GIB), LEVELS)
    assert not small["fits"]


def test_level_1_is_used_only_where_host_memory_holds_it():
    many = {f"m{i}": 1 for i in range(8)}
    plan = gp.serve_plan(gp.H200.total_bytes, [("a", ("m0",))], {"m0": GIB}, many)
    assert not plan["level_1_fits_host"]  # 8 x 14.96 GiB + engines + reserve > 128
    assert gp.l1_models(8, 128 * GIB, gp.WEIGHTS_8B_BYTES) == 5
    assert gp.l1_models(3, 128 * GIB, 0) == 3
