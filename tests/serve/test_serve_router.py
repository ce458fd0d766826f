"""The router, the state machine and the supervisor against a small real HTTP
engine (``fake_engine.py``, aiohttp on loopback): routing, pass-through,
streaming, the wake lock, idle time, sleep levels' endpoint shapes, restarts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from kvcached.serve.app import Serve
from tests.serve.serve_helpers import Client, calls, config, fake_model, run, until


def test_routing_pass_through_and_openai_errors(tmp_path):
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    cfg = config(tmp_path, [fake_model("alpha", log_a, aliases=["a"]), fake_model("beta", log_b)])

    async def body() -> None:
        async with Serve(cfg) as serve:
            c = Client(serve.port)
            try:
                await until(lambda: all(m.state == "ready" for m in serve.models), what="ready")
                status, models = await c.get("/v1/models")
                assert status == 200 and models["object"] == "list"
                assert [(m["id"], m["root"], m["object"]) for m in models["data"]] == [
                    ("alpha", "alpha", "model"),
                    ("a", "alpha", "model"),
                    ("beta", "beta", "model"),
                ]
                assert (await c.get("/v1/models/a"))[1]["root"] == "alpha"
                status, doc, headers = await c.post(
                    "/v1/completions", {"model": "a", "prompt": "hi"}
                )
                assert status == 200 and doc["echo"] == {"model": "alpha", "prompt": "hi"}
                assert headers["X-Fake"] == "1"
                status, doc, _ = await c.post(
                    "/v1/chat/completions", {"model": "beta", "messages": []}
                )
                assert status == 200 and doc["echo"]["model"] == "beta"
                assert [x["path"] for x in calls(log_a)] == ["/v1/completions"]
                # the engine's own error: status, body and headers unchanged
                status, doc, headers = await c.post(
                    "/v1/completions", {"model": "beta", "fail": 418}
                )
                assert status == 418 and doc == {
                    "object": "error",
                    "message": "asked to fail",
                    "type": "BadRequestError",
                    "code": 418,
                }
                assert headers["X-Fake"] == "1"
                status, doc, _ = await c.post("/v1/completions", {"model": "gamma"})
                assert status == 404 and doc["error"]["code"] == "model_not_found"
                assert "alpha, a, beta" in doc["error"]["message"]
                status, doc, _ = await c.post("/v1/completions", raw=b"{not json")
                assert status == 400 and doc["error"]["type"] == "invalid_request_error"
                status, doc, _ = await c.post("/v1/completions", [1, 2])
                assert status == 400
                assert (await c.get("/health"))[0] == 200
                status, ready = await c.get("/ready")
                assert status == 200 and ready["models"] == {"alpha": "ready", "beta": "ready"}
                status, text = await c.get("/metrics")
                assert 'kvcached_serve_requests_total{model="beta"} 2' in text
                assert 'kvcached_serve_errors_total{model="beta"} 1' in text
                assert 'kvcached_serve_state{model="alpha",state="ready"} 1' in text
                assert 'kvcached_serve_ttft_seconds_count{model="alpha"} 1' in text
                # one client session per model for its probes, reused, never one per probe
                session = serve.find("alpha")._session
                assert session is not None and await serve.find("alpha")._healthy()
                assert serve.find("alpha")._session is session
            finally:
                await c.close()

    run(body())


def _stream(tmp_path, request: dict) -> tuple[int, str, list[tuple[float, bytes]]]:
    """POST ``request`` (streamed) through a router over the fake engine: status,
    content type and each piece of the body with its arrival time."""
    cfg = config(tmp_path, [fake_model("alpha", tmp_path / "a.log")])

    async def body() -> tuple[int, str, list[tuple[float, bytes]]]:
        async with Serve(cfg) as serve:
            await until(lambda: serve.models[0].state == "ready", what="ready")
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    f"http://127.0.0.1:{serve.port}/v1/completions",
                    json={"model": "alpha", "stream": True, **request},
                ) as r,
            ):
                start = time.monotonic()
                arrivals = []
                async for chunk in r.content.iter_any():
                    arrivals.append((time.monotonic() - start, chunk))
                return r.status, r.headers["Content-Type"], arrivals

    return run(body())


def test_streams_pass_chunk_by_chunk(tmp_path):
    status, kind, arrivals = _stream(tmp_path, {"chunk_delay": 0.5})
    assert status == 200 and kind == "text/event-stream"
    data = b"".join(c for _, c in arrivals)
    assert data.count(b"data: ") == 4 and data.endswith(b"data: [DONE]\n\n")
    # the first chunk came long before the last: nothing buffered the stream
    assert arrivals[0][0] < 0.4 and arrivals[-1][0] > 1.0, arrivals


def test_a_long_stream_passes_whole_and_in_order(tmp_path):
    """500 chunks written back to back (they reach the router coalesced): the
    client gets every one, once, in order, and the stream's end."""
    status, _, arrivals = _stream(tmp_path, {"chunks": 500})
    events = [e for e in b"".join(c for _, c in arrivals).split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"data: [DONE]"
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(500))


def test_api_key(tmp_path):
    cfg = config(tmp_path, [fake_model("alpha", tmp_path / "a.log")], api_key="k1")

    async def body() -> None:
        async with Serve(cfg) as serve:
            await until(lambda: serve.models[0].state == "ready", what="ready")
            anon, good = Client(serve.port), Client(serve.port, "k1")
            bad = Client(serve.port, "k2")
            try:
                assert (await anon.get("/health"))[0] == 200
                status, doc = await anon.get("/v1/models")
                assert status == 401 and doc["error"]["code"] == "invalid_api_key"
                assert (await bad.post("/v1/completions", {"model": "alpha"}))[0] == 401
                assert (await good.post("/v1/completions", {"model": "alpha"}))[0] == 200
                # the probes an orchestrator calls need no key; /metrics does by default
                assert (await anon.get("/ready"))[0] == 200
                assert (await anon.get("/metrics"))[0] == 401
                assert (await anon.get("/v1/models/alpha/state"))[0] == 401
                assert (await good.get("/metrics"))[0] == 200
            finally:
                for c in (anon, good, bad):
                    await c.close()

    run(body())
    public = config(
        tmp_path, [fake_model("alpha", tmp_path / "a.log")], api_key="k1", public_metrics=True
    )

    async def open_metrics() -> None:
        async with Serve(public) as serve:
            anon = Client(serve.port)
            try:
                status, text = await anon.get("/metrics")
                assert status == 200 and "kvcached_serve_requests_total" in text
                assert (await anon.get("/v1/models"))[0] == 401
            finally:
                await anon.close()

    run(open_metrics())


def test_idle_counts_from_the_end_of_the_last_request_and_one_wake_serves_all(tmp_path):
    """A stream longer than idle_after is not put to sleep under it; 16 requests to a
    sleeping model join one wake and all succeed."""
    cfg = config(
        tmp_path,
        [fake_model("alpha", tmp_path / "a.log", sleep={"level": "kv", "idle_after": 0.6})],
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            m = serve.models[0]
            c = Client(serve.port)
            try:
                await until(lambda: m.state == "ready", what="ready")
                await until(lambda: m.state == "sleeping", what="first sleep")
                status, _, _ = await c.post(
                    "/v1/completions", {"model": "alpha", "stream": True, "chunk_delay": 0.5}
                )  # 1.5 s of stream
                assert status == 200
                assert m.counters.sleeps == 1 and m.counters.wakes == 1
                assert m.state == "ready"  # not slept during the stream
                await until(lambda: m.state == "sleeping", what="sleep after the stream")
                assert time.monotonic() - m.last_end >= 0.6
                wakes = m.counters.wakes
                results = await asyncio.gather(
                    *[c.post("/v1/completions", {"model": "alpha", "n": i}) for i in range(16)]
                )
                assert [r[0] for r in results] == [200] * 16
                assert m.counters.wakes == wakes + 1
                assert (await c.state("alpha"))["wakes"] == wakes + 1
            finally:
                await c.close()

    run(body())


def test_weights_level_uses_each_engines_documented_endpoints(tmp_path):
    """vLLM reads the sleep level from the query string; SGLang has its own pair."""
    log_v, log_s = tmp_path / "v.log", tmp_path / "s.log"
    cfg = config(
        tmp_path,
        [
            fake_model(
                "v",
                log_v,
                engine="vllm",
                sleep={"level": "weights", "idle_after": 3600, "weights_level": 2},
            ),
            fake_model("s", log_s, engine="sglang", sleep={"level": "weights", "idle_after": 3600}),
        ],
    )
    assert "VLLM_SERVER_DEV_MODE" in cfg.models[0].environment({})

    async def body() -> None:
        async with Serve(cfg) as serve:
            c = Client(serve.port)
            try:
                await until(lambda: all(m.state == "ready" for m in serve.models), what="ready")
                for name in ("v", "s"):
                    status, doc, _ = await c.post(f"/admin/models/{name}/sleep")
                    assert status == 200 and doc["state"] == "sleeping", doc
                    assert doc["sleep_level"] == "weights"
                    assert (await c.get(f"/is_sleeping?model={name}"))[1]["is_sleeping"]
                    assert (await c.post("/v1/completions", {"model": name}))[0] == 200
                    state = await c.state(name)
                    assert state["last_sleep_s"] > 0 and state["last_wake_s"] > 0, state
            finally:
                await c.close()
        v = [(x["method"], x["path"], x["query"], x["body"]) for x in calls(log_v)]
        # level 2 discarded the weights: weights mapped, reloaded, then the KV cache
        assert v[:4] == [
            ("POST", "/sleep", "level=2", ""),
            ("POST", "/wake_up", "tags=weights", ""),
            ("POST", "/collective_rpc", "", '{"method": "reload_weights"}'),
            ("POST", "/wake_up", "tags=kv_cache", ""),
        ]
        s = [(x["method"], x["path"], x["body"]) for x in calls(log_s)]
        assert s[:2] == [
            ("POST", "/release_memory_occupation", "{}"),
            ("POST", "/resume_memory_occupation", "{}"),
        ]

    run(body())


def test_a_level_2_wake_whose_reload_fails_fails_the_model_not_a_request_on_garbage(tmp_path):
    """After the failed reload no KV-cache wake is sent (vLLM would resume
    scheduling on discarded weights): the engine is stopped, the waiting request
    gets 503 naming the call, and the model is failed."""
    log = tmp_path / "v.log"
    cfg = config(
        tmp_path,
        [
            fake_model(
                "v",
                log,
                engine="vllm",
                extra=["--fail-reload"],
                sleep={"level": "weights", "idle_after": 3600, "weights_level": 2},
                restart={"policy": "never"},
            )
        ],
        on_model_failure="keep-serving",
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            c = Client(serve.port)
            try:
                m = serve.models[0]
                await until(lambda: m.state == "ready", what="ready")
                assert (await c.post("/admin/models/v/sleep"))[0] == 200
                status, doc, _ = await c.post("/v1/completions", {"model": "v"})
                assert status == 503, doc
                assert "POST /collective_rpc answered 500" in doc["error"]["message"]
                assert m.state == "failed" and m.process is None
            finally:
                await c.close()
        paths = [(x["path"], x["query"]) for x in calls(log)]
        assert paths[-2:] == [("/wake_up", "tags=weights"), ("/collective_rpc", "")]

    run(body())


def test_stop_level_and_lazy_start(tmp_path):
    cfg = config(
        tmp_path,
        [
            fake_model(
                "alpha",
                tmp_path / "a.log",
                start="lazy",
                sleep={"level": "stop", "idle_after": 0.3, "stop_after": 0.3},
            )
        ],
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            m = serve.models[0]
            c = Client(serve.port)
            try:
                await asyncio.sleep(0.5)
                assert m.state == "stopped" and m.counters.starts == 0
                assert (await c.get("/ready"))[0] == 200  # a lazy model is up as configured
                assert (await c.post("/v1/completions", {"model": "alpha"}))[0] == 200
                first = m.record.pid
                assert m.counters.starts == 1 and first
                await until(lambda: m.state == "stopped", what="stopped after its sleep")
                assert m.process is None and not _exists(first)
                assert (await c.post("/v1/completions", {"model": "alpha"}))[0] == 200
                assert m.counters.starts == 2 and m.record.pid != first
            finally:
                await c.close()

    run(body())


def test_a_killed_engine_is_seen_and_restarted_with_backoff(tmp_path):
    cfg = config(
        tmp_path,
        [
            fake_model(
                "alpha",
                tmp_path / "a.log",
                restart={"policy": "on-failure", "backoff_s": 0.2, "max_restarts": 1},
            )
        ],
        on_model_failure="keep-serving",
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            m = serve.models[0]
            await until(lambda: m.state == "ready", what="ready")
            first = m.record.pid
            os.kill(first, signal.SIGKILL)
            await until(lambda: m.counters.deaths == 1, what="the death noticed")
            await until(lambda: m.state == "ready" and m.record.pid != first, what="restart")
            assert m.counters.restarts == 1
            os.kill(m.record.pid, signal.SIGKILL)  # past max_restarts: stays failed
            await until(lambda: m.counters.deaths == 2, what="the second death")
            await asyncio.sleep(0.6)
            assert m.state == "failed" and "failed 2 times" in m.failure and m.given_up
            assert not serve._stop_requested.is_set()  # keep-serving: serve goes on
            c = Client(serve.port)
            try:
                status, doc, headers = await c.post("/v1/completions", {"model": "alpha"})
                assert status == 503 and "Retry-After" in headers
                assert doc["error"]["code"] == "model_unavailable"
                # keep-serving: a model given up on does not hold /ready back
                status, ready = await c.get("/ready")
                assert status == 200 and ready["failed"] == ["alpha"]
                assert ready["models"] == {"alpha": "failed"}
            finally:
                await c.close()

    run(body())


def slow_lazy_config(tmp_path):
    """One lazy model whose start (2 s) outlasts its wake_timeout (0.3 s)."""
    return config(
        tmp_path,
        [
            fake_model(
                "alpha",
                tmp_path / "a.log",
                start="lazy",
                wake_timeout=0.3,
                extra=["--slow-start", "2"],
            )
        ],
    )


def test_wake_timeout_is_a_503_with_retry_after_then_it_serves(tmp_path):
    cfg = slow_lazy_config(tmp_path)

    async def body() -> None:
        async with Serve(cfg) as serve:
            c = Client(serve.port)
            try:
                status, doc, headers = await c.post("/v1/completions", {"model": "alpha"})
                assert status == 503 and int(headers["Retry-After"]) > 0
                assert "wake_timeout=0.3" in doc["error"]["message"]
                await until(lambda: serve.models[0].state == "ready", what="the slow start")
                assert (await c.post("/v1/completions", {"model": "alpha"}))[0] == 200
                assert serve.models[0].counters.starts == 1  # the 503 did not start a second
            finally:
                await c.close()

    run(body())


def test_an_admin_wake_that_times_out_is_the_same_503(tmp_path):
    """``POST /admin/models/M/wake`` answers a model that misses its wake_timeout
    as a request for it does: 503, ``model_unavailable``, ``Retry-After``."""
    cfg = slow_lazy_config(tmp_path)

    async def body() -> None:
        async with Serve(cfg) as serve:
            c = Client(serve.port)
            try:
                status, doc, headers = await c.post("/admin/models/alpha/wake")
                assert status == 503 and int(headers["Retry-After"]) > 0
                assert doc["error"]["code"] == "model_unavailable"
                assert "wake_timeout=0.3" in doc["error"]["message"]
                await until(lambda: serve.models[0].state == "ready", what="the slow start")
                assert (await c.post("/admin/models/alpha/wake"))[0] == 200
            finally:
                await c.close()

    run(body())


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pressure_counts_a_page_short_when_a_page_is_more_than_32_blocks():
    from kvcached.control.yielding import growth_unit

    mib = 1 << 20
    # an 8B Llama: 2 MiB blocks, 128 MiB pages (64 blocks): 100 MiB of headroom grows nothing
    assert growth_unit(1024 * 2 * mib, 1024, 128 * mib) == 128 * mib
    # small blocks in small pages: 32 blocks is the larger
    assert growth_unit(1024 * mib, 1024, 8 * mib) == 32 * mib
    assert growth_unit(1024 * mib, 1024, 0) == 32 * mib  # no page mapped yet


def test_pressure_sleeps_the_least_recently_used_idle_model_on_that_gpu(tmp_path, monkeypatch):
    """The decision, from a ledger reading: a busy model whose misses grow on a GPU
    with no headroom makes the LRU idle model there sleep (not one on another GPU)."""
    from kvcached.serve import app as app_module

    models = [fake_model(n, tmp_path / f"{n}.log") for n in ("busy", "old", "new", "elsewhere")]
    cfg = config(tmp_path, models, pressure="sleep-lru", idle_check_s=3600)
    reading = {
        "busy": (0, ("gpu0",), 0, 1 << 20),
        "old": (0, ("gpu0",), 0, 1 << 20),
        "new": (0, ("gpu0",), 0, 1 << 20),
        "elsewhere": (0, ("gpu1",), 1 << 30, 1 << 20),
    }
    monkeypatch.setattr(app_module, "_pressure_view", lambda names: dict(reading))

    async def body() -> None:
        async with Serve(cfg) as serve:
            busy, old, new, elsewhere = serve.models
            await until(lambda: all(m.state == "ready" for m in serve.models), what="ready")
            old.last_used, new.last_used, elsewhere.last_used = 1.0, 2.0, 0.5
            await serve.policy_pass()  # first reading: nothing grew yet
            busy.begin()
            try:
                reading["busy"] = (3, ("gpu0",), 0, 1 << 20)  # misses grew, no headroom
                await serve.policy_pass()
            finally:
                busy.end()
            assert [m.state for m in serve.models] == ["ready", "sleeping", "ready", "ready"]

    run(body())
