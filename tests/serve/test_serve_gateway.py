"""The gauges cluster routers read from serve's ``/metrics`` (kvcached/serve/gateway.py),
parsed with Prometheus' own parser."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvcached.control.view import InstanceRow
from kvcached.serve import gateway
from kvcached.serve.engines import ENGINE_KINDS, read_gauges
from kvcached.serve.gateway import GatewayReading
from kvcached.serve.metrics import render_metrics
from kvcached.serve.model import TTFT_BUCKETS
from kvcached.serve.state import FAILED, READY, WAKING
from kvcached.units import MIB


def test_usage_is_physical_use_over_what_the_instance_could_hold_now() -> None:
    r = GatewayReading(used_bytes=300 * MIB, headroom_bytes=700 * MIB)
    assert (r.mappable_bytes, r.usage_perc) == (700 * MIB, 0.3)
    r.limit_bytes = 400 * MIB  # the limit binds before the ledger does
    assert (r.mappable_bytes, r.usage_perc) == (100 * MIB, 0.75)
    r.headroom_bytes = 0  # another engine took the GPU: full, whatever the limit says
    assert (r.mappable_bytes, r.usage_perc) == (0, 1.0)
    assert GatewayReading(used_bytes=5).usage_perc is None  # no ledger read: not known


def test_a_model_not_awake_can_map_nothing_so_it_reads_full() -> None:
    """Asleep (its limit is one byte), stopped or failed, it maps only once woken:
    a picker prefers an awake replica and wakes this one when the awake ones queue."""
    r = GatewayReading(used_bytes=0, headroom_bytes=700 * MIB, awake=False)
    assert (r.mappable_bytes, r.usage_perc) == (0, 1.0)
    assert GatewayReading(awake=False).usage_perc == 1.0  # known without a ledger read


def test_read_gauges_sums_every_labelled_sample() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 4.0\n'
        "vllm:num_requests_waiting_by_reason 9.0\n"
    )
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:absent")
    got = read_gauges(text, names)
    assert got == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 4.0}


def test_kv_view_sums_an_instances_gpus_and_takes_the_least_headroom(monkeypatch) -> None:
    rows = [
        InstanceRow("a", "gpu0", used_bytes=10 * MIB, limit_bytes=50 * MIB),
        InstanceRow("a", "gpu1", used_bytes=20 * MIB, limit_bytes=50 * MIB),
        InstanceRow("b", "gpu1", used_bytes=4 * MIB),
        InstanceRow("c", "-"),  # a stopped model: no GPU, no row
    ]
    gpus = [
        SimpleNamespace(gpu="gpu0", headroom_bytes=900 * MIB),
        SimpleNamespace(gpu="gpu1", headroom_bytes=300 * MIB),
    ]
    monkeypatch.setattr("kvcached.control.view.gather", lambda **kw: (rows, gpus))
    assert gateway.kv_view(["a", "b", "c"]) == {
        "a": (30 * MIB, 100 * MIB, 300 * MIB),
        "b": (4 * MIB, None, 300 * MIB),
    }


def _model(name: str, served: list[str], port: int, state: str = READY, in_flight: int = 0):
    """The attributes of a ModelRuntime that /metrics reads."""
    session: dict = {}

    def client():
        import aiohttp

        if "s" not in session:
            session["s"] = aiohttp.ClientSession()
        return session["s"]

    counters = SimpleNamespace(
        requests=1, errors=0, sleeps=0, sleep_seconds=0.0, wakes=0, wake_seconds=0.0,
        starts=1, restarts=0, deaths=0, ttft_buckets=[0] * len(TTFT_BUCKETS), ttft_count=0,
        ttft_sum=0.0,
    )  # fmt: skip
    return SimpleNamespace(
        name=name,
        config=SimpleNamespace(served_names=served),
        kind=ENGINE_KINDS["vllm"],
        state=state,
        in_flight=in_flight,
        held_requests=in_flight if state != READY else 0,
        engine_reachable=state == READY,
        base_url=f"http://127.0.0.1:{port}",
        client=client,
        counters=counters,
        _session=session,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_carry_the_gateway_gauges_per_served_name(monkeypatch) -> None:
    """A ready model's gauges come from its engine's /metrics, a waking one's
    waiting count is the requests serve holds; kv_cache_usage_perc is the
    physical ratio. Prometheus' parser reads the whole exposition."""
    monkeypatch.setattr(
        gateway,
        "kv_view",
        lambda names: {"alpha": (300 * MIB, 400 * MIB, 700 * MIB), "beta": (0, None, 700 * MIB)},
    )
    port = _free_port()

    async def body() -> str:
        async def engine_metrics(_request: web.Request) -> web.Response:
            return web.Response(
                text='vllm:num_requests_running{model_name="alpha"} 3\n'
                'vllm:num_requests_waiting{model_name="alpha"} 2\n'
            )

        app = web.Application()
        app.router.add_get("/metrics", engine_metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        alpha = _model("alpha", ["alpha", "a"], port)
        beta = _model("beta", ["beta"], _free_port(), state=WAKING, in_flight=4)
        gamma = _model("gamma", ["gamma"], _free_port(), state=FAILED)
        try:
            readings = await gateway.readings([alpha, beta, gamma])
        finally:
            await alpha._session["s"].close()
            await runner.cleanup()
        return render_metrics([alpha, beta, gamma], readings)

    text = asyncio.run(body())
    samples = {
        (s.name, s.labels.get("model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "model_name" in s.labels
    }
    for served in ("alpha", "a"):
        assert samples[("vllm:num_requests_running", served)] == 3
        assert samples[("vllm:num_requests_waiting", served)] == 2
        assert samples[("vllm:kv_cache_usage_perc", served)] == pytest.approx(0.75)
        assert samples[("kvcached_serve_kv_limit_bytes", served)] == 400 * MIB
    assert samples[("vllm:num_requests_running", "beta")] == 0
    assert samples[("vllm:num_requests_waiting", "beta")] == 4  # held while it wakes
    assert samples[("vllm:kv_cache_usage_perc", "beta")] == 1.0  # maps nothing until awake
    assert ("kvcached_serve_kv_limit_bytes", "beta") not in samples  # no limit: absent
    awake = {n: samples[("kvcached_serve_awake", n)] for n in ("alpha", "a", "beta", "gamma")}
    assert awake == {"alpha": 1, "a": 1, "beta": 0, "gamma": 0}
    routable = {n: samples[("kvcached_serve_routable", n)] for n in ("alpha", "beta", "gamma")}
    assert routable == {"alpha": 1, "beta": 1, "gamma": 0}  # waking is routable, failed not
