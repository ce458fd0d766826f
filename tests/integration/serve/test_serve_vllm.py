"""``kvcached serve`` for real: the CLI on loopback in front of two real vLLM CPU
servers (tiny Llamas of different shapes), driven by the ``openai`` client.

One serve runs for the whole module (engine starts cost 15-45 s each on two
cores); the tests run in file order and each leaves the serve as the next one
expects: ``alpha`` (eager, ``kv`` sleep) and ``beta`` (lazy, ``stop`` sleep).
Engine starts in all: alpha twice (the SIGKILL restart), beta twice (lazy,
then after its stop).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.engines import require_engine_version

openai = pytest.importorskip("openai", reason="the client: vLLM brings it (pip install openai)")
require_engine_version("vllm")  # in a child: importing vLLM rewrites os.environ
pytest.importorskip("aiohttp", reason='kvcached serve needs aiohttp: pip install ".[serve]"')

from tests.integration.serve.serve_models import words, write_model  # noqa: E402
from tests.integration.serve.serve_process import free_port, start_serve  # noqa: E402
from tests.integration.serve.served import (  # noqa: E402
    START_S,
    Served,
    serving,
    vllm_args,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("serve")
    tag = f"{os.getpid() % 100000}"
    alpha, beta = write_model(work / "alpha", "alpha"), write_model(work / "beta", "beta")
    port = free_port()
    cfg = {
        "port": port,
        "state_dir": str(work / "state"),
        "idle_check_s": 0.1,
        "models": [
            {
                "name": f"alpha-{tag}",
                "aliases": [f"a-{tag}"],
                "model": str(alpha),
                "args": vllm_args(),
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                "sleep": {"level": "kv", "idle_after": 6},
                "restart": {"policy": "on-failure", "backoff_s": 1},
                "startup_timeout": START_S,
                "wake_timeout": START_S,
            },
            {
                "name": f"beta-{tag}",
                "model": str(beta),
                "args": vllm_args(),
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                "start": "lazy",
                "sleep": {"level": "stop", "idle_after": 2, "stop_after": 2},
                "startup_timeout": START_S,
                "wake_timeout": START_S,
            },
        ],
    }
    with serving(work, cfg, tag) as s:
        yield s


def greedy(client: openai.OpenAI, model: str, prompt: str, n: int = 8) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return out.choices[0].text


def test_models_are_listed_with_aliases(served):
    ids = [m.id for m in served.client().models.list().data]
    assert ids == [served.name("alpha"), f"a-{served.tag}", served.name("beta")]


def test_probes_for_cluster_routers(served):
    """/health, /ready, the router's /metrics, and each engine's own /metrics."""
    assert served.get("/health")[0] == 200 and served.get("/ready")[0] == 200
    status, text = served.get(f"/v1/models/{served.name('alpha')}/metrics")
    assert status == 200 and "vllm:num_requests_waiting" in text
    status, text = served.get("/metrics")
    assert f'kvcached_serve_state{{model="{served.name("beta")}",state="stopped"}} 1' in text


def test_outputs_equal_the_engines_own(served):
    """Chat and completions, streamed and not, through the router and straight
    to the engine: the same text."""
    router, name = served.client(), served.name("alpha")
    prompt = words(5, 17, 42, 99, 7, 300)
    messages = [{"role": "user", "content": words(11, 12, 13)}]
    for _ in range(2):  # the router's call first: it wakes alpha if it slept
        via = greedy(router, f"a-{served.tag}", prompt)
        direct = greedy(served.engine_client("alpha"), name, prompt)
        assert via == direct and via
        chunks = router.completions.create(
            model=name, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        streamed = [c.choices[0].text for c in chunks if c.choices]
        assert len(streamed) >= 2 and "".join(streamed) == direct
        chat = router.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0
        )
        chat_direct = served.engine_client("alpha").chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.content == chat_direct.choices[0].message.content
        stream = router.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == chat_direct.choices[0].message.content


def test_unknown_model_is_a_404_naming_the_models(served):
    with pytest.raises(openai.NotFoundError) as err:
        served.client().completions.create(model="nope", prompt="w5", max_tokens=2)
    assert served.name("alpha") in str(err.value) and served.name("beta") in str(err.value)


def test_an_engines_400_passes_through_unchanged(served):
    body = {"model": served.name("alpha"), "prompt": words(5, 6), "max_tokens": 5000}
    via = served.post("/v1/completions", body)
    direct = served.post("/v1/completions", body, port=int(served.state("alpha")["port"]))
    assert via[0] == direct[0] == 400
    assert via[1] == direct[1]


def test_idle_model_sleeps_at_kv_level_with_no_memory_then_wakes_with_the_same_output(served):
    name = served.name("alpha")
    prompt = words(*range(20, 120))  # three blocks and more: memory to release
    before = greedy(served.client(), name, prompt, 12)
    rows = [r for r in served.kvctl("list") if r["name"] == name]
    assert rows and rows[0]["used_bytes"] > 0
    served.wait_state("alpha", "sleeping", 120)
    deadline = time.monotonic() + 30
    while True:
        row = next(r for r in served.kvctl("list") if r["name"] == name)
        if row["used_bytes"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert row["serve_state"] == "sleeping"
    assert row["used_bytes"] == 0, row
    assert row["reserved_bytes"] == 0 and row["prefix_cache_bytes"] == 0
    assert greedy(served.client(), name, prompt, 12) == before
    assert served.state("alpha")["state"] == "ready"


def test_sixteen_requests_to_a_sleeping_model_cause_one_wake(served):
    name = served.name("alpha")
    served.wait_state("alpha", "sleeping", 120)
    wakes = served.state("alpha")["wakes"]

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{served.port}/v1",
            api_key="none",
            timeout=600,
            max_retries=0,
        )
        try:
            outs = await asyncio.gather(
                *[
                    client.completions.create(
                        model=name, prompt=words(5, 6, i + 3), max_tokens=4, temperature=0
                    )
                    for i in range(16)
                ]
            )
        finally:
            await client.close()
        return [o.choices[0].text for o in outs]

    texts = asyncio.run(burst())
    assert len(texts) == 16 and all(texts)
    assert served.state("alpha")["wakes"] == wakes + 1


def test_stop_level_then_lazy_start(served):
    name = served.name("beta")
    first = served.state("beta")
    assert first["state"] == "stopped" and first["starts"] == 0  # lazy: not started yet
    out = greedy(served.client(), name, words(9, 8, 7))
    doc = served.state("beta")
    assert doc["starts"] == 1 and doc["state"] == "ready"
    pid = int(doc["pid"])
    served.wait_state("beta", "stopped", 120)
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)
    assert greedy(served.client(), name, words(9, 8, 7)) == out
    assert served.state("beta")["starts"] == 2


def test_an_engine_killed_with_sigkill_is_restarted(served):
    doc = served.state("alpha")
    old = int(doc["pid"])
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + START_S
    while True:
        doc = served.state("alpha")
        if doc["restarts"] >= 1 and doc["state"] == "ready" and doc["pid"] != old:
            break
        assert time.monotonic() < deadline, f"not restarted: {doc}\n{served.log_tail()}"
        time.sleep(0.5)
    assert greedy(served.client(), served.name("alpha"), words(5, 6, 7))


def test_a_router_killed_with_sigkill_is_replaced_and_adopts_the_running_engines(served):
    pid = int(served.state("alpha")["pid"])
    served.proc.kill()
    served.proc.wait(30)
    assert _alive(pid)  # the engine outlives its router
    served.proc = start_serve(served.config, served.env, served.log)
    wait_ready(served, 120)
    doc = served.state("alpha")
    assert int(doc["pid"]) == pid and doc["starts"] == 0, doc  # adopted, not restarted
    assert doc["state"] in ("ready", "sleeping")
    assert greedy(served.client(), served.name("alpha"), words(5, 6, 7))


def test_ctrl_c_leaves_nothing_behind(served):
    from kvcached.control.snapshot import read_snapshots
    from kvcached.ledger.file import list_ledgers
    from kvcached.ledger.ledger import Ledger

    pids = [int(served.state(m)["pid"]) for m in ("alpha", "beta")]
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(180) == 0
    for pid in pids:
        if pid:
            assert not _group_alive(pid), f"engine group {pid} outlived serve"
    names = {served.name("alpha"), served.name("beta")}
    assert not [s for s in read_snapshots() if s.instance in names and s.alive]
    assert not list((served.workdir / "state").glob("*.json"))
    for path in list_ledgers(str(served.workdir)):
        led = Ledger.open_existing(path)
        try:
            snap = led.snapshot()
        finally:
            led.close()
        assert not [p for p in snap.pools if p.alive and p.instance in names]
        assert sum(i.charged for i in snap.instances if i.name in names) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False
