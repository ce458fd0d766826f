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

#: vLLM 0.26's exposition of the four series serve reads.
VLLM_METRICS = """vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 17.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 31424.0
"""


def args() -> argparse.Namespace:
    return argparse.Namespace(model="qwen2.5-0.5b", kv_fraction=0.8, max_running=32,
                              graphs=False, ready_s=240.0, utilization="0.12")  # fmt: skip


def test_config_is_one_serve_accepts_with_sglang_kvcached_and_kv_sleep(tmp_path: Path) -> None:
    ports = {sc.SERVE_NAME: 30141}
    cfg = parse_config(sc.serve_config(args(), tmp_path / "m", 30140, ports, tmp_path / "state"))
    (model,) = cfg.models
    assert (model.kind.name, model.kvcached, model.sleep.level) == ("sglang", True, "kv")
    argv = model.argv("127.0.0.1", 30141, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert "--enable-metrics" in argv and "--attention-backend" in argv
    assert argv[argv.index("--served-model-name") + 1] == sc.SERVE_NAME
    env = model.environment({})
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == sc.SERVE_NAME
    assert "KVCACHED_GPU_UTILIZATION" not in env  # alone on the card: kvcached's default


def test_with_gpu_vllms_site_a_vllm_model_runs_beside_on_its_own_python_path(
    tmp_path: Path,
) -> None:
    ports = {sc.SERVE_NAME: 30141, sc.VLLM_NAME: 30142}
    site = {"PYTHONPATH": "/tmp/site", "PATH": "/tmp/site/bin"}
    doc = sc.serve_config(args(), tmp_path / "m", 30140, ports, tmp_path / "state", site)
    sglang, vllm = parse_config(doc).models
    assert (vllm.kind.name, vllm.kvcached, vllm.sleep.level, vllm.port) == (
        "vllm",
        True,
        "kv",
        30142,
    )
    argv = vllm.argv("127.0.0.1", 30142, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in argv and "--attention-backend" not in argv
    env = vllm.environment({})
    assert env["PYTHONPATH"] == "/tmp/site" and env["KVCACHED_IPC_NAME"] == sc.VLLM_NAME
    for m in (sglang, vllm):  # two engines on one card: each the small budget of mixed
        assert m.environment({})["KVCACHED_GPU_UTILIZATION"] == "0.12"
    assert "PYTHONPATH" not in sglang.environment({})


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
        "models": {
            sc.SERVE_NAME: {
                "first": reply,
                "fill_ok": True,
                "charged_loaded": 2 << 20,
                "metrics": sc.engine_reading(SGLANG_METRICS),
                "slept_after_s": 9.0,
                "charged_asleep": 0,
                "woken": dict(reply),
                "state_after_wake": "ready",
            }
        },
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
        ({"exit_code": 1}, "clean_exit_within_90s"),
        ({"gpu_left": [123]}, "no_gpu_process_left"),
        ({"engine_left": True}, "no_engine_process_left"),
    ],
)
def test_each_serve_wide_check_fails_on_its_fault(change: dict, fails: str) -> None:
    checks = sc.serve_checks({**good_record(), **change})
    assert [k for k, v in checks.items() if not v] == [fails]


@pytest.mark.parametrize(
    ("change", "fails"),
    [
        ({"charged_asleep": 2 << 20}, "sleep_holds_0_bytes"),
        ({"slept_after_s": None}, "slept_when_idle"),
        ({"woken": {"status": 200, "tokens": ["a", "c"]}}, "wake_on_request_same_tokens"),
        ({"woken": {"status": 503}}, "wake_on_request_same_tokens"),
        ({"metrics": {}}, "engine_metrics_read"),
        ({"fill_ok": False}, "fill_every_request_ok"),
        ({"charged_loaded": 0}, "grew_under_load"),
    ],
)
def test_each_model_check_fails_on_its_fault(change: dict, fails: str) -> None:
    rec = good_record()
    rec["models"][sc.SERVE_NAME].update(change)
    checks = sc.serve_checks(rec)
    assert [k for k, v in checks.items() if not v] == [fails]


def test_a_model_with_no_record_fails_its_own_checks() -> None:
    checks = sc.serve_checks(good_record(), sc.VLLM_NAME)
    assert not checks["kvctl_lists_it_as_vllm"] and not checks["first_request_tokens"]
    assert checks["serve_ready"]


def test_steps_record_what_the_checks_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case's steps on stand-ins of the router, kvctl and serve's state, with a
    vLLM model beside: the record they leave passes every check of each model."""
    states = {sc.SERVE_NAME: iter(["ready", "sleeping", "ready"]),
              sc.VLLM_NAME: iter(["sleeping", "ready"])}  # fmt: skip
    charges = {sc.SERVE_NAME: iter([3 << 20, 0]), sc.VLLM_NAME: iter([5 << 20, 0])}
    metrics = {"30141": SGLANG_METRICS, "30142": VLLM_METRICS}

    def complete(self: sc.Server, prompt: str, max_tokens: int) -> dict:
        return {"status": 200, "tokens": [self.name] * max_tokens}

    def complete_all(self: sc.Server, prompts: list, max_tokens: int, concurrent: bool) -> list:
        return [{"status": 200, "completion_tokens": max_tokens} for _ in prompts]

    listed = [{"name": sc.SERVE_NAME, "engine": "sglang"}, {"name": sc.VLLM_NAME, "engine": "vllm"}]
    monkeypatch.setattr(sc.Server, "complete", complete)
    monkeypatch.setattr(sc.Server, "complete_all", complete_all)
    monkeypatch.setattr(sc, "kvctl", lambda *a: listed)
    monkeypatch.setattr(sc, "charged", lambda name: next(charges[name]))
    monkeypatch.setattr(sc, "gpu_pids", lambda: {4242})
    monkeypatch.setattr(sc, "_state", lambda port, name: {"state": next(states[name])})
    monkeypatch.setattr(
        sc, "get", lambda url, timeout: (200, metrics[url.split(":")[2].split("/")[0]].encode())
    )
    monkeypatch.setattr(sc.time, "sleep", lambda s: None)
    rec: dict = {"ready_s": 40.0}
    sc._steps(1, {sc.SERVE_NAME: 30141, sc.VLLM_NAME: 30142}, rec, "word-level")
    rec.update(exit_s=1.0, exit_code=0, engine_left=False, gpu_left=[])
    for name in (sc.SERVE_NAME, sc.VLLM_NAME):
        checks = sc.serve_checks(rec, name)
        assert all(checks.values()), (name, checks)
    assert rec["gpu_pids_loaded"] == [4242]
    assert rec["models"][sc.VLLM_NAME]["charged_asleep"] == 0
