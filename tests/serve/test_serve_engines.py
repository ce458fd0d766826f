"""The engine table: one row per engine kind, and what serve reads from an
engine's own metrics to see clients that bypass the router."""

from __future__ import annotations

import pytest

from kvcached.serve.config import parse_config
from kvcached.serve.engines import ENGINE_KINDS, engine_kind, read_activity

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="m"} 40.0
"""


def test_vllm_activity_is_its_running_and_waiting_gauges_and_request_counters():
    busy, total = read_activity(VLLM_METRICS, engine_kind("vllm"))
    assert busy == 1.0 and total == 7.0 + 2.0 + 40.0  # *_created is not a counter
    idle = VLLM_METRICS.replace('running{engine="0",model_name="m"} 1.0', "running{} 0")
    assert read_activity(idle, engine_kind("vllm"))[0] == 0.0
    assert read_activity("# nothing\nother_metric 3\n", engine_kind("vllm")) is None
    assert not engine_kind("command").watches_activity


def test_every_engine_row_launches_and_only_rows_with_an_api_sleep_at_weights():
    for name, kind in ENGINE_KINDS.items():
        doc = {"name": "m", "engine": name, "sleep": {"level": "weights"}}
        doc.update({"model": "/x"} if kind.module else {"command": ["srv", "{port}"]})
        if kind.weights_sleep is None:
            with pytest.raises(ValueError, match="sleep level weights needs an engine"):
                parse_config({"models": [doc]})
            continue
        m = parse_config({"models": [doc]}).models[0]
        assert m.ready_path == kind.health_path
        argv = m.argv("127.0.0.1", 9)
        assert argv[1:3] == ["-m", kind.module] and kind.weights_flag in argv
        assert m.environment({}).items() >= dict(kind.weights_env).items()
    assert engine_kind("vllm").sleep_call(2) == ("POST", "/sleep?level=2", None)
    assert engine_kind("vllm").wake_calls(1) == (("POST", "/wake_up", None),)
    assert [c[1] for c in engine_kind("vllm").wake_calls(2)] == [
        "/wake_up?tags=weights",
        "/collective_rpc",
        "/wake_up?tags=kv_cache",
    ]
    assert engine_kind("sglang").wake_calls(2) == (("POST", "/resume_memory_occupation", {}),)
    with pytest.raises(ValueError, match="'tgi' is not a known engine: vllm, sglang, command"):
        engine_kind("tgi")


def test_engine_activity_can_be_turned_off():
    doc = {"name": "m", "model": "/x", "sleep": {"level": "kv", "engine_activity": False}}
    assert parse_config({"models": [doc]}).models[0].sleep.engine_activity is False


@pytest.mark.parametrize("form", [["--load-format", "dummy"], ["--load-format=dummy"]])
def test_a_level_2_weights_sleep_needs_weights_it_can_reload(form):
    """vLLM's reload_weights reads the model's files: the dummy loader has none,
    so the first wake would fail; the config says so before anything starts."""
    doc = {"name": "m", "model": "/x", "args": ["--enforce-eager", *form]}
    doc["sleep"] = {"level": "weights", "weights_level": 2}
    with pytest.raises(ValueError, match="weights_level 2 discards the weights"):
        parse_config({"models": [doc]})
    doc["sleep"] = {"level": "weights", "weights_level": 1}
    assert parse_config({"models": [doc]}).models[0].sleep.weights_level == 1
    doc["args"] = ["--load-format", "safetensors"]
    doc["sleep"] = {"level": "weights", "weights_level": 2}
    assert parse_config({"models": [doc]}).models[0].sleep.weights_level == 2
