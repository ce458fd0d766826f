"""The SGLang runner's ``serve`` case without a GPU: its config is one serve
accepts, SGLang's metrics read as serve's engine table expects, and each verdict
fails on the record that should fail it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvcached.serve.config import parse_config
from tests.gpu.sglang_e2e import serve_case as sc

#: SGLang 0.5.17's exposition of the four series serve reads (labels as SGLang writes them).
SGLANG_METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 0.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 0.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 31424.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 17.0
"""


def args() -> argparse.Namespace:
    return argparse.Namespace(model="qwen2.5-0.5b", kv_fraction=0.8, max_running=32,
                              graphs=False, ready_s=240.0)  # fmt: skip


def test_config_is_one_serve_accepts_with_sglang_kvcached_and_kv_sleep(tmp_path: Path) -> None:
    cfg = parse_config(sc.serve_config(args(), tmp_path / "m", 30140, 30141, tmp_path / "state"))
    (model,) = cfg.models
    assert (model.kind.name, model.kvcached, model.sleep.level) == ("sglang", True, "kv")
    argv = model.argv("127.0.0.1", 30141, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert "--enable-metrics" in argv and "--attention-backend" in argv
    assert argv[argv.index("--served-model-name") + 1] == sc.SERVE_NAME
    env = model.environment({})
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == sc.SERVE_NAME


def test_sglang_metrics_give_serve_a_reading() -> None:
    got = sc.engine_reading(SGLANG_METRICS)
    assert all(got["present"].values())
    assert got["reading"] == (0.0, 31424.0 + 17.0)  # the counters summed
    missing = sc.engine_reading(SGLANG_METRICS.replace("sglang:num_queue_reqs", "other"))
    assert missing["present"]["sglang:num_queue_reqs"] is False


def good_record() -> dict:
    reply = {"status": 200, "tokens": ["a", "b"]}
    return {
        "ready_s": 50.0,
        "list": [{"name": sc.SERVE_NAME, "engine": "sglang"}],
        "first": reply,
        "fill_ok": True,
        "charged_loaded": 2 << 20,
        "metrics": sc.engine_reading(SGLANG_METRICS),
        "slept_after_s": 9.0,
        "charged_asleep": 0,
        "woken": dict(reply),
        "state_after_wake": "ready",
        "exit_s": 3.0,
        "exit_code": 0,
        "engine_left": False,
        "gpu_pids_loaded": [123],
        "gpu_left": [],
    }


def test_a_good_record_passes_every_check() -> None:
    checks = sc.serve_checks(good_record())
    assert checks and all(checks.values()), checks


@pytest.mark.parametrize(
    ("change", "fails"),
    [
        ({"ready_s": None}, "serve_ready"),
        ({"list": [{"name": sc.SERVE_NAME, "engine": "vllm"}]}, "kvctl_lists_it_as_sglang"),
        ({"charged_asleep": 2 << 20}, "sleep_holds_0_bytes"),
        ({"slept_after_s": None}, "slept_when_idle"),
        ({"woken": {"status": 200, "tokens": ["a", "c"]}}, "wake_on_request_same_tokens"),
        ({"woken": {"status": 503}}, "wake_on_request_same_tokens"),
        ({"metrics": {}}, "engine_metrics_read"),
        ({"exit_code": 1}, "clean_exit_within_90s"),
        ({"gpu_left": [123]}, "no_gpu_process_left"),
        ({"engine_left": True}, "no_engine_process_left"),
    ],
)
def test_each_check_fails_on_its_fault(change: dict, fails: str) -> None:
    checks = sc.serve_checks({**good_record(), **change})
    assert [k for k, v in checks.items() if not v] == [fails]


def test_steps_record_what_the_checks_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case's steps on stand-ins of the router, kvctl and serve's state: the
    record they leave passes every check of :func:`serve_checks` it feeds."""
    states = iter(["ready", "sleeping", "ready"])
    charges = iter([3 << 20, 0])

    class Router:
        def complete(self, prompt: str, max_tokens: int) -> dict:
            return {"status": 200, "tokens": ["x"] * max_tokens}

        def complete_all(self, prompts: list[str], max_tokens: int, concurrent: bool) -> list:
            return [{"status": 200, "completion_tokens": max_tokens} for _ in prompts]

    monkeypatch.setattr(sc, "kvctl", lambda *a: [{"name": sc.SERVE_NAME, "engine": "sglang"}])
    monkeypatch.setattr(sc, "charged", lambda name: next(charges))
    monkeypatch.setattr(sc, "gpu_pids", lambda: {4242})
    monkeypatch.setattr(sc, "_state", lambda port: {"state": next(states)})
    monkeypatch.setattr(sc, "get", lambda url, timeout: (200, SGLANG_METRICS.encode()))
    monkeypatch.setattr(sc.time, "sleep", lambda s: None)
    rec: dict = {"ready_s": 40.0}
    sc._steps(Router(), 1, 2, rec, "word-level")
    rec.update(exit_s=1.0, exit_code=0, engine_left=False, gpu_left=[])
    checks = sc.serve_checks(rec)
    assert all(checks.values()), checks
    assert rec["gpu_pids_loaded"] == [4242] and rec["charged_asleep"] == 0
