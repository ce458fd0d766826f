"""``kvcached serve`` as a user meets it, with real vLLM CPU engines: an engine
that cannot start stops serve with its own error on serve's terminal; clients
that talk to the engine directly keep it awake; the probes need no API key;
Ctrl-C leaves nothing in /dev/shm but what docs/serve.md lists.

One vLLM engine at a time (two cores); each test starts its own serve.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engines import require_engine_version

require_engine_version("vllm")  # in a child: importing vLLM rewrites os.environ
pytest.importorskip("aiohttp", reason='kvcached serve needs aiohttp: pip install ".[serve]"')

from tests.integration.serve.serve_models import dummy_vllm_args, words, write_model  # noqa: E402
from tests.integration.serve.serve_process import free_port, http_json, start_serve  # noqa: E402
from tests.integration.serve.serve_process import serve_env as process_env  # noqa: E402

pytestmark = pytest.mark.slow

START_S = 600.0


VLLM_ARGS = dummy_vllm_args(max_model_len=512, max_num_seqs=4)


def serve_env(work: Path) -> dict[str, str]:
    env = process_env(work)
    env.pop("XDG_RUNTIME_DIR", None)  # the default state directory: /dev/shm
    return env


def request(
    port: int, path: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, Any]:  # noqa: ANN401
    return http_json(port, path, body, key=key, timeout_s=300)


def test_a_vllm_that_cannot_start_stops_serve_with_its_own_error(tmp_path):
    model = write_model(tmp_path / "tiny", "alpha")
    tag = f"{os.getpid() % 100000}"
    cfg = {
        "port": free_port(),
        "state_dir": str(tmp_path / "state"),
        "models": [
            {
                "name": f"broken-{tag}",
                "model": str(model),
                "args": [*VLLM_ARGS, "--no-such-flag"],
                "restart": {"max_restarts": 0},
                "startup_timeout": START_S,
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(cfg))
    assert (
        subprocess.run(
            [sys.executable, "-m", "kvcached", "serve", "--check", str(path)],
            env=serve_env(tmp_path),
            capture_output=True,
            timeout=120,
        ).returncode
        == 0
    )  # nothing --check can see: the flag is vLLM's to refuse
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", str(path)],
        env=serve_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert out.returncode == 1, out.stderr
    log = tmp_path / "state" / f"broken-{tag}.log"
    # vLLM's own error leads serve's report (its first lines are deprecation warnings)
    cause = "api_server.py: error: unrecognized arguments: --no-such-flag"
    lines = out.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "; from its log (" in line)
    assert lines[at].endswith(
        f"model broken-{tag}: engine exited with 2 while starting: {cause}; from its log ({log}):"
    ), out.stderr
    assert lines[at + 1 : at + 3] == ["    its error:", f"      {cause}"], out.stderr
    assert f"model broken-{tag} failed and will not be restarted" in out.stderr
    assert "--no-such-flag" in log.read_text()


def _shm(tag: str, port: int) -> set[str]:
    """This test's entries in /dev/shm: its models' snapshot segments, its state dir."""
    return {e for e in os.listdir("/dev/shm") if tag in e or e == f"kvcached-serve-{port}"}


def _group_alive(marker: str) -> bool:
    from kvcached.serve.engine import marked_groups

    return bool(marked_groups(marker))


def test_direct_clients_keep_it_awake_probes_are_open_and_ctrl_c_leaves_nothing(tmp_path):
    model = write_model(tmp_path / "tiny", "alpha")
    tag = f"u{os.getpid() % 100000}"
    name = f"tiny-{tag}"
    port = free_port()
    cfg = {
        "port": port,
        "api_key": "sekrit",
        "idle_check_s": 0.1,
        "models": [
            {
                "name": name,
                "model": str(model),
                "args": VLLM_ARGS,
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                "sleep": {"level": "kv", "idle_after": 4},
                "startup_timeout": START_S,
                "wake_timeout": START_S,
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(cfg))
    before = _shm(tag, port)
    assert not before
    log = tmp_path / "serve.log"
    proc = start_serve(path, serve_env(tmp_path), log)
    state_dir = f"/dev/shm/kvcached-serve-{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError):
                if request(port, "/ready")[0] == 200:  # no key: the probe is open
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert request(port, "/health")[0] == 200
        assert request(port, "/metrics")[0] == 401  # public_metrics: false
        status, text = request(port, "/metrics", key="sekrit")
        assert status == 200 and "kvcached_serve_state" in text
        status, doc = request(port, f"/v1/models/{name}/state", key="sekrit")
        engine_port = doc["port"]
        # a client of the engine itself, for twice idle_after: the model stays awake
        until = time.monotonic() + 10
        while time.monotonic() < until:
            status, _ = request(
                engine_port,
                "/v1/completions",
                {"model": name, "prompt": words(5, 6, 7), "max_tokens": 2},
            )
            assert status == 200
            state = request(port, f"/v1/models/{name}/state", key="sekrit")[1]
            assert state["state"] == "ready", state
            time.sleep(1.0)
        deadline = time.monotonic() + 60  # then, left alone, it sleeps
        while request(port, f"/v1/models/{name}/state", key="sekrit")[1]["state"] != "sleeping":
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        status, doc = request(
            port,
            "/v1/completions",
            {"model": name, "prompt": words(5, 6), "max_tokens": 2},
            "sekrit",
        )
        assert status == 200, doc
        during = _shm(tag, port)
        assert f"kvcached-serve-{port}" in during
        assert any(e.startswith(f"kvcached.snap.{name}.") for e in during), during
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(180)
    assert code == 0, log.read_text()
    assert not _group_alive(f"{state_dir}/{name}")
    assert _shm(tag, port) == before, "left in /dev/shm after Ctrl-C"
    # vLLM's shutdown SIGKILLs its worker, pool open: serve retires it, as routine
    from kvcached.serve.sleep import read_kv

    assert read_kv(name, str(tmp_path)) is None
    text = log.read_text()
    assert "dead process" not in text
    faults = [
        line
        for line in text.splitlines()
        if line.startswith(("[kvcached] WARNING", "[kvcached] ERROR"))
    ]
    assert not faults, text
    # the ledger file stays (docs/serve.md says so): it is the GPU's, not serve's
    assert list(tmp_path.glob("kvcached-ledger-*"))


def test_a_router_killed_while_its_vllm_starts_adopts_it_and_starts_no_second(tmp_path):
    """SIGKILL the router while its vLLM engine is still starting: the next router
    adopts that engine (same pid, no start of its own) and waits for it; Ctrl-C
    then leaves none of its processes."""
    from kvcached.serve.engine import marked_groups

    model = write_model(tmp_path / "tiny", "alpha")
    name = f"adopt-{os.getpid() % 100000}"
    port = free_port()
    state_dir = tmp_path / "state"
    cfg = {
        "port": port,
        "state_dir": str(state_dir),
        "models": [
            {
                "name": name,
                "model": str(model),
                "args": VLLM_ARGS,
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                "startup_timeout": START_S,
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(cfg))
    log = tmp_path / "serve.log"

    def start() -> subprocess.Popen[bytes]:
        return start_serve(path, serve_env(tmp_path), log)

    def model_state() -> dict[str, Any]:
        return request(port, f"/v1/models/{name}/state")[1]

    first = start()
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(OSError):
            doc = model_state()
            if doc["state"] == "starting" and doc["pid"]:
                break
        assert first.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    pid = doc["pid"]
    first.kill()
    first.wait(30)
    second = start()
    try:
        deadline = time.monotonic() + START_S
        while True:
            with contextlib.suppress(OSError):
                if request(port, "/ready")[0] == 200:
                    break
            assert second.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        doc = model_state()
        assert doc["pid"] == pid and doc["starts"] == 0 and doc["state"] == "ready", doc
        assert set(marked_groups(f"{state_dir}/{name}")) == {pid}  # one engine, not two
        status, out = request(
            port, "/v1/completions", {"model": name, "prompt": words(5, 6), "max_tokens": 2}
        )
        assert status == 200, out
    finally:
        second.send_signal(signal.SIGINT)
        code = second.wait(180)
    assert code == 0, log.read_text()
    assert not marked_groups(f"{state_dir}/{name}")
