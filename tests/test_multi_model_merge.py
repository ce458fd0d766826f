"""Merging multi-model results of separate sweeps (benchmarks/multi_model_merge.py):
the H100's two partial runs (peaks 1 and 1.5, 2 and 2.5) drawn as one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import multi_model as mm
import multi_model_merge as mmm
import multi_model_plot as mmp
from multi_model_trace import TraceSpec, write_traces

GIB = 1 << 30


def part(directory: Path, name: str, peak: float, ttft: dict[str, float], seed: int = 5,
         kv_total: int = 3 * GIB, measured: str = "c0ffee") -> Path:  # fmt: skip
    """A result of one peak, both configurations, one round: every request's TTFT ``ttft[config]``."""
    out = directory / f"{name}.json"
    trace = out.with_name(f"{name}-trace.json")
    write_traces(trace, [TraceSpec(peak=peak, models=3)], seed)
    runs, requests = [], []
    for config in ("kvcached", "native"):
        runs.append({"config": config, "round": 0, "peak": peak, "trace_seed": seed,
                     "wall_s": 10.0, "cpu_s": [1.0, 1.0, 1.0], "samples": [], "drain_s": 60.0})  # fmt: skip
        reqs = [{"ok": True, "ttft_s": ttft[config], "e2e_s": 1.0, "tokens": 4, "late_s": 0.0}]
        requests.append({"config": config, "round": 0, "peak": peak, "requests": reqs * 3})
    doc = {
        "benchmark": "multi_model",
        "device": "gpu",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559},
        "commit": name,
        "complete": True,
        "rounds": 1,
        "peaks": [str(peak)],
        "trace": {"sha256": mm.file_sha256(trace)},
        "setup": {"kv_total_bytes": kv_total, "models": ["mm-a", "mm-b", "mm-c"]},
        "blocks": [{"config": "kvcached", "tag": "kvcached-r0"}],
        "runs": runs,
        "provenance": {
            "commit": measured,
            "tree_dirty": False,
            "command": f"python benchmarks/multi_model.py --peaks {peak:g}",
            "machine": {"host": "vm"},
            "load_average_start": [1.0, 1.0, 1.0],
            "load_average_end": [2.0, 2.0, 2.0],
        },
    }
    out.write_text(json.dumps(doc))
    out.with_name(f"{name}-requests.json").write_text(json.dumps(requests))
    return out


def test_two_sweeps_merge_into_one_result_that_sums_up_as_each_did(tmp_path):
    low = part(tmp_path, "low", 1.0, {"kvcached": 0.2, "native": 0.2})
    knee = part(tmp_path, "knee", 2.5, {"kvcached": 0.25, "native": 1.0}, seed=6)
    out = tmp_path / "merged" / "multi-model-gpu-both.json"
    report = mmm.merge([low, knee], out)
    assert report["peaks"] == ["1", "2.5"] and len(report["runs"]) == 4
    assert report["mean_ttft_speedup"] == pytest.approx({"1": 1.0, "2.5": 4.0})
    assert [s["file"] for s in report["merged_from"]] == ["low.json", "knee.json"]
    assert report["commit"] == ["knee", "low"] and report["complete"]
    prov = report["provenance"]
    assert prov["commit"] == "c0ffee" and prov["merged_from"] == ["low.json", "knee.json"]
    assert "--peaks 1 ; " in prov["command"] and prov["command"].endswith("--peaks 2.5")
    # the merged result reads back as a part of its own (it can be resumed)
    back = mm.read_previous(out)
    assert sorted((r.config, r.peak) for r in back.runs) == [
        ("kvcached", 1.0),
        ("kvcached", 2.5),
        ("native", 1.0),
        ("native", 2.5),
    ]
    assert [b["part"] for b in back.blocks] == ["low.json", "knee.json"]
    # each part's calls (here: parts from before calls were kept, their last call)
    assert [c["part"] for c in back.calls] == ["low.json", "knee.json"]
    assert [c["command"] for c in back.calls] == [
        "python benchmarks/multi_model.py --peaks 1",
        "python benchmarks/multi_model.py --peaks 2.5",
    ]


def test_the_merge_carries_the_long_tail_beside_it_not_the_parts_older_copy(tmp_path):
    low = part(tmp_path, "low", 1.0, {"kvcached": 0.2, "native": 0.2})
    knee = part(tmp_path, "knee", 2.5, {"kvcached": 0.25, "native": 1.0}, seed=6)
    out = tmp_path / "multi-model-gpu.json"
    assert mmm.merge([low, knee], out)["models_per_gpu"] is None  # none beside it, none in parts
    done = {"benchmark": "long-tail", "complete": True, "commit": "abc",
            "models_per_gpu": {"kvcached": 8, "static": 4}}  # fmt: skip
    out.with_name("long-tail-gpu.json").write_text(json.dumps(done))
    report = mmm.merge([low, knee], out)
    assert report["models_per_gpu"] == {"kvcached": 8, "static": 4}
    assert report["long_tail"]["source"] == "long-tail-gpu.json"
    assert report["long_tail"]["complete"] and report["long_tail"]["commit"] == "abc"


def test_parts_that_do_not_agree_are_refused(tmp_path):
    low = part(tmp_path, "low", 1.0, {"kvcached": 0.2, "native": 0.2})
    other = part(tmp_path, "other", 2.0, {"kvcached": 0.2, "native": 0.2}, kv_total=4 * GIB)
    with pytest.raises(ValueError, match="setup.kv_total_bytes"):
        mmm.merge([low, other], tmp_path / "m.json")
    again = part(tmp_path, "again", 1.0, {"kvcached": 0.3, "native": 0.3})
    with pytest.raises(ValueError, match="twice"):
        mmm.merge([low, again], tmp_path / "m.json")
    reseeded = part(tmp_path, "reseeded", 1.0, {"kvcached": 0.3, "native": 0.3}, seed=9)
    with pytest.raises(ValueError, match="another trace"):
        mmm.merge([low, reseeded], tmp_path / "m.json")
    later = part(tmp_path, "later", 3.0, {"kvcached": 0.2, "native": 0.2}, measured="beef")
    with pytest.raises(ValueError, match="different commits"):
        mmm.merge([low, later], tmp_path / "m.json")
    with pytest.raises(ValueError, match="two results or more"):
        mmm.merge([low], tmp_path / "m.json")


def test_the_plots_are_named_and_titled_by_device_and_card():
    assert mmp.tag_of(Path("multi-model-cpu.json")) == ""
    assert mmp.tag_of(Path("multi-model-cpu-flush.json")) == "flush"
    assert mmp.tag_of(Path("multi-model-gpu.json")) == "gpu"
    assert mmp.tag_of(Path("multi-model-gpu-lowload-knee.json")) == "gpu-lowload-knee"
    gpu = {"device": "gpu", "gpu": {"name": "NVIDIA H100 80GB HBM3"}, "rounds": 1}
    assert "H100" in mmp.title_of(gpu) and "no control" in mmp.title_of(gpu)
    assert "2 rounds" in mmp.title_of({**gpu, "rounds": 2})
    assert "CPU" in mmp.title_of({"device": "cpu"})


def test_parts_merge_across_commits_only_where_the_measured_code_is_the_same(tmp_path, monkeypatch):
    import subprocess

    import _provenance

    repo = tmp_path / "repo"
    (repo / "kvcached").mkdir(parents=True)

    def commit(path: str, text: str) -> str:
        (repo / path).write_text(text)
        git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", path], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    measured = commit("kvcached/pages.py", "v1\n")
    results_only = commit("README.md", "the sweep's first blocks\n")
    code_changed = commit("kvcached/pages.py", "v2\n")
    monkeypatch.setattr(_provenance, "ROOT", repo)
    low = part(tmp_path, "low", 1.0, {"kvcached": 0.2, "native": 0.2}, measured=measured)
    high = part(tmp_path, "high", 2.5, {"kvcached": 0.25, "native": 1.0}, seed=6,
                measured=results_only)  # fmt: skip
    prov = mmm.merge([low, high], tmp_path / "m.json")["provenance"]
    assert prov["commit"] == results_only and prov["commits"] == [measured, results_only]
    assert "kvcached" in prov["same_code"]
    later = part(tmp_path, "later", 3.0, {"kvcached": 0.2, "native": 0.2}, seed=7,
                 measured=code_changed)  # fmt: skip
    with pytest.raises(ValueError, match="kvcached/pages.py changed"):
        mmm.merge([low, later], tmp_path / "m2.json")
    # a part resumed over sessions: its last call at a results-only commit, an
    # earlier one at changed code, which its provenance alone would not show
    resumed = part(tmp_path, "resumed", 4.0, {"kvcached": 0.2, "native": 0.2}, seed=8,
                   measured=results_only)  # fmt: skip
    doc = json.loads(resumed.read_text())
    doc["calls"] = [{"commit": code_changed, "runs": ["kvcached r0 4"]},
                    {"commit": results_only, "runs": ["native r0 4"]}]  # fmt: skip
    resumed.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="kvcached/pages.py changed"):
        mmm.merge([low, resumed], tmp_path / "m3.json")
