"""The series a gateway's endpoint picker reads (deploy/kubernetes/overlays/inference-pool),
scraped from a real ``kvcached serve`` in front of a real vLLM CPU engine and parsed
with Prometheus' own parser: each is there per served model, with its type and range,
and moves as docs/kubernetes.md says while a model serves, sleeps, wakes or fails.

One serve for the module (tests/integration/serve/served.py):
``alpha`` (vLLM, eager, alias ``a-``), ``beta`` (vLLM, lazy: never started here) and
``gamma`` (a command that exits at once, never restarted: failed, with
``on_model_failure: keep-serving``). One engine start in all.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvcached.serve import podlabels
from tests.engines import require_engine_version

pytest.importorskip("openai", reason="the client: vLLM brings it (pip install openai)")
require_engine_version("vllm")
pytest.importorskip("aiohttp", reason='kvcached serve needs aiohttp: pip install ".[serve]"')
prometheus = pytest.importorskip("prometheus_client.parser", reason='pip install -e ".[test]"')

from tests.integration.serve.serve_models import words, write_model  # noqa: E402
from tests.integration.serve.serve_process import free_port  # noqa: E402
from tests.integration.serve.served import (  # noqa: E402
    START_S,
    Served,
    serving,
    vllm_args,
)

pytestmark = pytest.mark.slow

#: The series each model's picker reads (its EndpointPickerConfig), with what they must be.
PICKER = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
STATE = ("kvcached_serve_awake", "kvcached_serve_routable")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("metrics")
    tag = f"{os.getpid() % 100000}"
    alpha, beta = write_model(work / "alpha", "alpha"), write_model(work / "beta", "beta")
    port = free_port()
    engine = {
        "args": vllm_args(),
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "startup_timeout": START_S,
        "wake_timeout": START_S,
    }
    cfg = {
        "port": port,
        "state_dir": str(work / "state"),
        "idle_check_s": 0.1,
        "public_metrics": True,
        "on_model_failure": "keep-serving",
        "models": [
            {"name": f"alpha-{tag}", "aliases": [f"a-{tag}"], "model": str(alpha), **engine,
             "sleep": {"level": "kv", "idle_after": 3600}},
            {"name": f"beta-{tag}", "model": str(beta), "start": "lazy", **engine},
            {"name": f"gamma-{tag}", "engine": "command", "kvcached": False,
             "command": [sys.executable, "-c", "import sys; sys.exit(3)"],
             "restart": {"policy": "never"}},
        ],
    }  # fmt: skip
    with serving(work, cfg, tag) as s:
        yield s


def scrape(served: Served) -> dict[str, dict[str, tuple[str, float]]]:
    """``{series: {model_name: (family type, value)}}`` of serve's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict[str, tuple[str, float]]] = {}
    for family in prometheus.text_string_to_metric_families(text):
        for s in family.samples:
            if "model_name" in s.labels:
                out.setdefault(s.name, {})[s.labels["model_name"]] = (family.type, s.value)
    return out


def served_names(served: Served) -> list[str]:
    t = served.tag
    return [f"alpha-{t}", f"a-{t}", f"beta-{t}", f"gamma-{t}"]


def test_every_picker_series_is_a_gauge_per_served_name_in_range(served):
    got = scrape(served)
    for series in (*PICKER, *STATE):
        assert set(got[series]) == set(served_names(served)), series
        for name, (kind, value) in got[series].items():
            assert kind == "gauge", (series, name)
            if series == "vllm:kv_cache_usage_perc":
                assert 0.0 <= value <= 1.0, (name, value)
            elif series in STATE:
                assert value in (0.0, 1.0), (series, name, value)
            else:
                assert value >= 0 and value == int(value), (series, name, value)


def test_a_ready_model_is_awake_a_lazy_one_routable_a_failed_one_not(served):
    t = served.tag
    got = scrape(served)
    for name in (f"alpha-{t}", f"a-{t}"):  # an alias is a series of its own, same values
        assert got["kvcached_serve_awake"][name][1] == 1
        assert got["kvcached_serve_routable"][name][1] == 1
    assert got["kvcached_serve_awake"][f"beta-{t}"][1] == 0  # lazy, not started
    assert got["kvcached_serve_routable"][f"beta-{t}"][1] == 1  # its request starts it
    assert got["vllm:kv_cache_usage_perc"][f"beta-{t}"][1] == 1.0  # maps nothing yet
    assert got["kvcached_serve_routable"][f"gamma-{t}"][1] == 0
    assert served.state("gamma")["state"] == "failed"
    # The pod labels the inference-pool overlay's sidecar would publish from /ready.
    labels = podlabels.desired_labels(podlabels.read_ready(f"http://127.0.0.1:{served.port}/ready"))
    assert labels == {
        f"model.kvcached.io/alpha-{t}": "routable",
        f"model.kvcached.io/beta-{t}": "routable",
        f"model.kvcached.io/gamma-{t}": "failed",
    }


def test_a_request_in_flight_is_running_and_its_kv_memory_in_use(served):
    name = served.name("alpha")
    body = {
        "model": name,
        "prompt": words(*range(20, 120)),
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{served.port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    seen: list[tuple[float, float]] = []

    def watch() -> None:
        for _ in range(40):  # vLLM updates its gauges every step
            got = scrape(served)
            seen.append(
                (
                    got["vllm:num_requests_running"][name][1],
                    got["vllm:kv_cache_usage_perc"][name][1],
                )
            )
            if seen[-1][0] == 1:
                return
            time.sleep(0.05)

    def stream() -> None:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                # Scraped by the reading thread at its first token: a waiter woken by
                # an event came only after the last token once, on a loaded 2-core
                # machine, and saw nothing running.
                if line.startswith(b"data:") and not seen:
                    watch()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    thread.join(600)
    assert seen, served.log_tail()
    assert any(r == 1 for r, _ in seen), f"never saw the request running: {seen}"
    running_usage = next(u for r, u in seen if r == 1)
    assert 0.0 < running_usage < 1.0  # mapped pages over what it could still map
    deadline = time.monotonic() + 30  # the gauges follow the engine's steps
    while scrape(served)["vllm:num_requests_running"][name][1] != 0:
        assert time.monotonic() < deadline, "the finished request still reads running"
        time.sleep(0.1)


def test_a_sleeping_model_reads_asleep_full_and_routable_then_wakes_on_a_request(served):
    t, name = served.tag, served.name("alpha")
    status, _ = served.post(f"/admin/models/{name}/sleep", {})
    assert status == 200
    served.wait_state("alpha", "sleeping", 120)
    got = scrape(served)
    for served_name in (name, f"a-{t}"):
        assert got["kvcached_serve_awake"][served_name][1] == 0
        assert got["kvcached_serve_routable"][served_name][1] == 1
        assert got["vllm:kv_cache_usage_perc"][served_name][1] == 1.0
        assert got["vllm:num_requests_running"][served_name][1] == 0
        assert got["vllm:num_requests_waiting"][served_name][1] == 0
    status, doc = served.post(
        "/v1/completions", {"model": f"a-{t}", "prompt": words(5, 6, 7), "max_tokens": 4}
    )
    assert status == 200 and doc["choices"], doc  # held while it woke, then answered
    got = scrape(served)
    assert got["kvcached_serve_awake"][name][1] == 1
    assert got["vllm:kv_cache_usage_perc"][name][1] < 1.0
