"""The H100 sweep in device calls (issue #33): ``multi_model.main`` on the GPU path
with the servers, the runs and the clock faked at this session's H100 timings
(three 8B engines ready in 82 s; a run its trace's arrivals plus 14 s), so that
its own deadline and ``--resume`` decide what each call runs. Calls of at most
540 s run the sized sweep (six peaks, two rounds, both configurations): three
here, where the fakes spend nothing before the first start, four where a call's
set-up takes the ~45 s measured (gpu_plan.sweep_calls' default), within one
session's command time either way."""

from __future__ import annotations

import json
import time
import types

import pytest

import gpu_plan
import multi_model as mm
from multi_model_client import Run, Target

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
START_S, RUN_TAIL_S = 82.0, 14.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    clock = Clock()
    fake_time = types.SimpleNamespace(monotonic=clock.monotonic, strftime=time.strftime)
    monkeypatch.setattr(mm, "time", fake_time)
    monkeypatch.setattr(gpu_plan, "read_card", lambda: gpu_plan.H100)
    monkeypatch.setattr(mm, "gpu_device", lambda: {"name": gpu_plan.H100.name})
    monkeypatch.setattr(mm, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(mm, "warm_up", lambda targets: None)
    monkeypatch.setattr(mm, "wait_idle", lambda targets: None)

    class FakeConfiguration:
        def __init__(self, args, config, workdir, tag, **device) -> None:
            self.config, self.tag, self.record = config, tag, {"config": config, "tag": tag}
            self.share = device.get("kv_share_bytes")

        def start(self) -> list[Target]:
            assert self.config == "kvcached" or self.share, "native needs its third"
            clock.now += START_S
            self.record["start_s"] = START_S
            return [Target(n, n, 8600 + i, 8600 + i, 1) for i, n in enumerate(mm.MODELS)]

        def kv_budget_bytes(self) -> int:
            return 26_255_346_893

        def close(self) -> None:
            clock.now += 1.0

    def fake_run(config, rnd, targets, trace, ledger, sample_s, share, drain_s=None):
        clock.now += trace["duration_s"] + RUN_TAIL_S
        n = len(trace["requests"])
        ttft = 0.2 if config == "kvcached" else 0.3
        reqs = [{"ok": True, "ttft_s": ttft, "e2e_s": 15.0, "tokens": 512, "late_s": 0.0}] * n
        return Run(config, rnd, float(trace["spec"]["peak"]), trace["seed"], cpu_s=[1.0] * 3,
                   requests=reqs, drain_s=drain_s)  # fmt: skip

    monkeypatch.setattr(mm, "Configuration", FakeConfiguration)
    monkeypatch.setattr(mm, "run_trace", fake_run)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    return clock, model


def test_the_sized_sweep_runs_in_resumed_calls_of_at_most_the_deadline(fake_gpu, tmp_path):
    clock, model = fake_gpu
    common = ["--device", "gpu", "--no-plot", "--model-dir", str(model)]
    results = tmp_path / "results"  # what is committed between calls
    calls, done = [], None
    for call in range(1, 7):
        out = tmp_path / f"call{call}" / "multi-model-gpu.json"
        began = clock.now
        argv = [*common, "--workdir", str(tmp_path / f"work{call}"), "--out", str(out)]
        if done is not None:
            argv += ["--resume", str(done)]
        assert mm.main(argv) == 0
        calls.append(clock.now - began)
        result = json.loads(out.read_text())
        done = results / out.name
        results.mkdir(exist_ok=True)
        for f in out.parent.glob("multi-model-gpu*.json"):
            (results / f.name).write_text(f.read_text())
        if result["complete"]:
            break
    assert result["complete"] and len(calls) == 3
    assert max(calls) <= 540  # the default deadline: inside a 10-minute call
    assert sum(calls) + len(calls) * gpu_plan.MEASURED_CALL_SETUP_S <= gpu_plan.SWEEP_SESSION_S
    assert result["peaks"] == ["0.5", "1", "1.5", "2", "2.5", "3"]
    assert len(result["runs"]) == 2 * 2 * 6
    # the configurations' blocks in the harness's order, a block split where a call ended
    tags = [b["tag"] for b in result["blocks"]]
    assert list(dict.fromkeys(tags)) == ["kvcached-r0", "native-r0", "native-r1", "kvcached-r1"]
    # with both rounds, the controls are there; the plan carries the ledger's budget
    assert set(result["control"]["native"]["mean_ttft_ratio"]) == set(result["peaks"])
    assert result["plan"]["kv_budget_source"] == "ledger"
    assert result["plan"]["card"]["folder"] == "h100"
    # and gpu_plan's estimate of the calls, timed as the fakes are, says the same
    traces = [p["trace_s"] for p in result["plan"]["per_peak"]]
    estimate = gpu_plan.sweep_calls(traces, start_s=START_S - 5, tail_s=RUN_TAIL_S - 2, setup_s=0)
    assert [len(e["runs"]) for e in estimate] == [8, 8, 8]
    assert [len(e["runs"]) for e in gpu_plan.sweep_calls(traces)] == [6, 6, 6, 6]
    assert all(abs(e["estimate_s"] - c) < 5 for e, c in zip(estimate, calls, strict=True))
    # each call is on record with the runs it added, every run once: a sweep resumed
    # over several sessions says which commit and card measured which run
    recorded = result["calls"]
    assert len(recorded) == 3
    assert [len(c["runs"]) for c in recorded] == [8, 8, 8]
    ran = [r for c in recorded for r in c["runs"]]
    assert sorted(ran) == sorted(
        f"{r['config']} r{r['round']} {mm.peak_key(r['peak'])}" for r in result["runs"]
    )
    assert all(c["gpu"] == gpu_plan.H100.name and c["command"] and c["commit"] for c in recorded)
    assert "--resume" not in recorded[0]["command"] and "--resume" in recorded[2]["command"]


def test_a_result_from_before_calls_were_kept_resumes_with_its_last_call_known(tmp_path):
    prov = {"commit": "62574e1", "tree_dirty": None, "command": "python benchmarks/x.py",
            "started_utc": "2026-12-07T07:41:43+00:00", "machine": {"host": "vm"}}  # fmt: skip
    [call] = mm.calls_of({"provenance": prov, "runs": []})
    assert call["commit"] == "62574e1" and call["runs"] is None
    assert "last call only" in call["known"]
    kept = [{"commit": "a", "runs": ["kvcached r0 1"]}, {"commit": "b", "runs": []}]
    assert mm.calls_of({"calls": kept, "provenance": prov}) == kept
    assert mm.calls_of({}) == []


def test_the_harness_and_the_estimate_share_their_rules():
    defaults = mm.DEFAULTS["gpu"]
    assert mm.START_S["gpu"] == 120.0 and mm.STOP_S["gpu"] == 20.0
    assert (defaults["deadline_s"], defaults["drain_s"]) == (540.0, 60.0)
    import inspect

    sig = inspect.signature(gpu_plan.sweep_calls).parameters
    assert sig["start_need_s"].default == mm.START_S["gpu"]
    assert sig["stop_need_s"].default == mm.STOP_S["gpu"]
    assert sig["deadline_s"].default == defaults["deadline_s"]
    assert sig["drain_s"].default == defaults["drain_s"]


def test_peaks_pick_the_runs_of_a_replayed_trace_and_a_missing_one_is_named(fake_gpu, tmp_path):
    """#34's low-load figure re-measured on a new page path: the committed sweep's
    trace replayed at its lowest peaks only, same arrivals, and its other peaks
    left alone (before, ``--peaks`` was silently ignored beside ``--trace``)."""
    _, model = fake_gpu
    trace = mm.ROOT / "benchmarks/results/h100/multi-model-gpu-trace.json"
    common = ["--device", "gpu", "--no-plot", "--model-dir", str(model), "--trace", str(trace)]
    done = None
    for call in range(1, 4):  # the deadline splits it; --resume keeps the pick
        out = tmp_path / f"call{call}" / "multi-model-gpu-low.json"
        argv = [*common, "--peaks", "0.5", "1", "--out", str(out)]
        assert mm.main([*argv, *(["--resume", str(done)] if done else [])]) == 0
        result, done = json.loads(out.read_text()), out
        if result["complete"]:
            break
    assert result["complete"] and call == 2 and result["peaks"] == ["0.5", "1"]
    assert {(r["config"], r["peak"]) for r in result["runs"]} == {
        (c, p) for c in ("kvcached", "native") for p in (0.5, 1.0)
    }
    whole = json.loads(trace.read_text())["traces"]
    seeds = {float(t["spec"]["peak"]): t["seed"] for t in whole}
    assert all(r["trace_seed"] == seeds[r["peak"]] for r in result["runs"])
    # the trace travels beside each call's result (what --resume reads), unchanged
    assert result["trace"]["sha256"] == mm.file_sha256(trace)
    assert (out.parent / "multi-model-gpu-low-trace.json").read_bytes() == trace.read_bytes()
    with pytest.raises(SystemExit, match=r"--peaks 0\.75: not in the trace .*0\.5 1 1\.5"):
        mm.main([*common, "--peaks", "0.75", "--out", str(tmp_path / "x.json")])
