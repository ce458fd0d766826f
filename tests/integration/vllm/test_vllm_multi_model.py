"""benchmarks/multi_model.py --short end to end on the real vLLM CPU engine:
three kvcached servers sharing one host budget and three native servers with
static thirds replay one small peak of the seeded trace. Checks that both
configurations ran every request and that the result JSON is complete; nothing
about speed (CI's 2 cores are shared)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.integrations.patching import release
from tests.engines import require_engine_version

VLLM_VERSION = require_engine_version("vllm")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MODELS = ["mm-a", "mm-b", "mm-c"]


@pytest.fixture(scope="module")
def short_run(vllm_workdir: Path) -> tuple[dict, Path]:
    workdir = vllm_workdir / "multi-model"
    out = workdir / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "multi_model.py"),
            "--short",
            "--workdir",
            str(workdir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text()), workdir


def test_both_configurations_ran_every_request(short_run):
    report, _ = short_run
    assert report["short"] is True and report["peaks"] == ["1"]
    runs = {r["config"]: r for r in report["runs"]}
    assert set(runs) == {"kvcached", "native"} and len(report["runs"]) == 2
    for config, run in runs.items():
        assert run["requests"] > 10, config
        assert run["failed"] == 0, config
        assert run["ttft_s"]["n"] == run["requests"], config
        assert run["queue_s"]["n"] == run["requests"], config  # vLLM's per-request queue time
        assert len(run["cpu_s"]) == 3 and all(c > 0 for c in run["cpu_s"]), config
        # os.getloadavg()'s, read before and after: three servers just ran here, so the
        # load at the end is above zero (an unset 0.0 default, or None, fails)
        start, end = run["loadavg_1m_start"], run["loadavg_1m_end"]
        assert type(start) is float and math.isfinite(start), (config, start)
        assert type(end) is float and math.isfinite(end) and end > 0, (config, end)


def test_memory_was_sampled_per_model_in_both(short_run):
    report, _ = short_run
    budget = report["setup"]["budget_bytes"]
    for run in report["runs"]:
        samples = run["samples"]
        assert len(samples) >= 5, run["config"]
        peaks = {}
        for model in MODELS:
            seen = [s[model]["kv_bytes"] for s in samples if s[model]["kv_bytes"] is not None]
            assert seen, (run["config"], model)
            assert max(seen) <= budget, (run["config"], model)
            peaks[model] = max(seen)
        if run["config"] == "kvcached":  # mapped pages: never zero while a server runs
            assert all(peak > 0 for peak in peaks.values()), peaks
        else:  # KV in use by running requests: a short one may fall between two samples
            assert any(peak > 0 for peak in peaks.values()), peaks
        if run["config"] == "native":
            assert all(
                s[m]["kv_bytes"] <= report["setup"]["static_bytes"]
                for s in samples
                for m in MODELS
                if s[m]["kv_bytes"] is not None
            )


def test_the_json_is_complete(short_run):
    report, workdir = short_run
    for key in (
        "commit",
        "command",
        "date",
        "machine",
        "vllm",
        "trace",
        "setup",
        "ttft_s",
        "e2e_s",
        "queue_s",
        "control",
    ):
        assert key in report, key
    assert len(report["commit"]) == 40
    load = report["machine"]["loadavg_1m_at_start"]
    assert type(load) is float and math.isfinite(load), load
    assert report["trace"]["seed"] == 13
    assert release(report["vllm"]) == release(VLLM_VERSION)  # the engine these tests run
    for config in ("kvcached", "native"):
        entry = report["ttft_s"][config]["1"]
        assert entry["n"] > 10
        assert 0 < entry["p50"] <= entry["p99"], config
        assert entry["mean"] > 0, config
    for key in ("mean_ttft_speedup", "p99_ttft_speedup", "cpu_per_token_ratio"):
        assert set(report[key]) == {"1"}, key
        assert math.isfinite(report[key]["1"]) and report[key]["1"] > 0, key
    trace = Path(report["trace"]["file"])
    trace = trace if trace.is_absolute() else ROOT / trace
    assert trace.is_file()
    raw = json.loads((workdir / "result-requests.json").read_text())
    assert sum(len(r["requests"]) for r in raw) == sum(r["requests"] for r in report["runs"])
