"""Engines that cannot start, as a user meets them: ``--check`` finds what it
can before anything starts; at run time serve's terminal says which model
failed, with its engine's first output lines and its log's path, and serve
exits non-zero past the restart policy unless ``on_model_failure:
keep-serving``; a failing model answers in OpenAI's error schema."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.serve.app import Serve
from kvcached.serve.state import STATES, TRANSITIONS, IllegalTransition, check_transition
from tests.engines import require_installed
from tests.serve.serve_helpers import FAKE, Client, config, fake_model, run, until


def serve_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def write_config(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def test_check_finds_what_would_stop_the_engines_before_anything_starts(tmp_path):
    router, taken = listening(), listening()
    router_port, taken_port = router.getsockname()[1], taken.getsockname()[1]
    state = tmp_path / "state"
    models: list[dict[str, Any]] = [
        {"name": "gone", "model": str(tmp_path / "no-such-model")},
        {"name": "noprog", "engine": "command", "command": [str(tmp_path / "serve.sh"), "{port}"]},
        {
            "name": "busy",
            "engine": "command",
            "command": [sys.executable, FAKE, "{port}", "x"],
            "port": taken_port,
        },
    ]
    other = shutil.which("python3", path="/usr/bin:/bin")
    probe = subprocess.run([other or "false", "-c", "import vllm"], capture_output=True)
    if other and probe.returncode != 0:  # a Python without vLLM: serve's check must see it
        models.append(
            {
                "name": "novllm",
                "command": [other, "-m", "vllm.entrypoints.openai.api_server", "--port", "{port}"],
            }
        )
    path = write_config(
        tmp_path,
        {"port": router_port, "state_dir": str(state), "models": models},
    )
    try:
        out = serve_cli("--check", str(path))
    finally:
        router.close()
        taken.close()
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr
    assert f"port: 127.0.0.1:{router_port} is in use by another program" in err
    assert f"models[0].model (gone): {tmp_path / 'no-such-model'} does not exist" in err
    assert f"models[1] (noprog): the program {tmp_path / 'serve.sh'} does not exist" in err
    assert f"models[2].port (busy): 127.0.0.1:{taken_port} is in use by another program" in err
    if len(models) == 4:
        assert f"models[3] (novllm): {other} cannot import vllm" in err
    problems = len(models) + 1
    if importlib.util.find_spec("vllm") is None:  # "gone" is a vLLM model: that is one more
        assert f"models[0] (gone): {sys.executable} cannot import vllm" in err
        problems += 1
    assert len(err.strip().splitlines()) == problems, err  # one line per problem
    assert "model    gone" in out.stdout  # the plan is printed too
    assert not state.exists()  # --check created nothing


def test_check_passes_and_a_plain_run_refuses_the_same_problems(tmp_path):
    require_installed("vllm")  # the check passes only where the engine is there
    (tmp_path / "m").mkdir()
    path = write_config(
        tmp_path,
        {
            "port": 0,
            "state_dir": str(tmp_path / "state"),
            "models": [{"name": "ok", "model": str(tmp_path / "m")}],
        },
    )
    out = serve_cli("--check", str(path))
    assert out.returncode == 0, out.stderr
    assert "checks passed" in out.stdout
    shutil.rmtree(tmp_path / "m")
    started = time.monotonic()
    out = serve_cli(str(path))
    assert out.returncode == 2 and "models[0].model" in out.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "state").exists()


def test_a_failing_start_is_shown_on_serves_terminal_and_serve_exits_naming_it(tmp_path):
    """Past restart.max_restarts serve stops with status 1: the model, the cause,
    the engine's own first lines and the log's path are on its terminal."""
    cfg = {
        "port": 0,
        "state_dir": str(tmp_path / "state"),
        "idle_check_s": 0.05,
        "models": [
            fake_model("fine", tmp_path / "f.log"),
            fake_model(
                "broken",
                tmp_path / "b.log",
                extra=["--fail-start", "3", "--warnings", "20"],
                restart={"max_restarts": 1, "backoff_s": 0.1},
            ),
        ],
    }
    out = serve_cli(str(write_config(tmp_path, cfg)))
    assert out.returncode == 1, out.stderr
    log = tmp_path / "state" / "broken.log"
    err = out.stderr
    cause = "fake engine: error: the model cannot be loaded (asked to fail)"
    header = f"model broken: engine exited with 3 while starting: {cause}; from its log ({log}):"
    lines = err.splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(header))
    # the error leads the report, not the engine's first lines (its deprecation warnings)
    assert lines[at + 1 : at + 3] == ["    its error:", f"      {cause}"], err
    assert lines[at + 3] == "    the last 15 lines of its output:"
    assert err.strip().splitlines()[-1].endswith("stopped; exit status 1: model broken failed")
    assert "model broken failed and will not be restarted" in err
    assert "it failed 2 times within restart.window_s=600 s (restart.max_restarts=1)" in err
    assert "on_model_failure: exit" in err
    assert err.count("restarting in") == 1
    assert log.exists()  # a failed model's log is kept, and named at exit
    assert not (tmp_path / "state" / "fine.log").exists()


def test_a_command_that_cannot_be_run_fails_at_once_eager_or_lazy(tmp_path):
    """The eager-start bug: Popen raising left the model ``stopped`` with no word.
    Now it is ``failed`` with the reason; a lazy one answers OpenAI's schema."""
    missing = str(tmp_path / "no-such-engine")
    cfg = config(
        tmp_path,
        [
            fake_model("fine", tmp_path / "f.log"),
            {"name": "eager", "engine": "command", "command": [missing, "{port}"]},
            {"name": "lazy", "engine": "command", "command": [missing, "{port}"], "start": "lazy"},
        ],
        on_model_failure="keep-serving",
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            eager = serve.find("eager")
            await until(lambda: eager.state == "failed", 30, "the eager model failed")
            assert f"cannot run {missing!r}: No such file or directory" in eager.failure
            assert eager.given_up and eager.counters.restarts == 0  # no restart can mend it
            c = Client(serve.port)
            try:
                status, doc, headers = await c.post("/v1/completions", {"model": "lazy"})
                assert status == 503, doc
                assert set(doc["error"]) == {"message", "type", "param", "code"}
                assert "cannot run" in doc["error"]["message"]
                await until(lambda: serve.find("fine").state == "ready", 60, "fine ready")
                status, doc, _ = await c.post("/v1/completions", {"model": "fine"})
                assert status == 200  # keep-serving: the others serve
                status, doc = await c.get("/no/such/route")
                assert status == 404 and doc["error"]["type"] == "invalid_request_error"
            finally:
                await c.close()
            assert serve.exit_code == 0

    run(body())


def test_on_model_failure_exit_is_the_default_and_sets_the_exit_code(tmp_path):
    cfg = config(tmp_path, [{"name": "eager", "engine": "command", "command": ["/nonexistent"]}])
    assert cfg.on_model_failure == "exit"

    async def body() -> None:
        async with Serve(cfg) as serve:
            await until(serve._stop_requested.is_set, 30, "serve asked to stop")
            assert serve.exit_code == 1

    run(body())


def test_every_transition_outside_the_table_is_refused():
    for old in STATES:
        for new in STATES:
            if new == old or new in TRANSITIONS[old]:
                check_transition("m", old, new)
            else:
                with pytest.raises(IllegalTransition, match=f"m: {old} -> {new} is not"):
                    check_transition("m", old, new)
    with pytest.raises(IllegalTransition, match="'dozing' is not a state"):
        check_transition("m", "ready", "dozing")
    assert "waking" not in TRANSITIONS["stopped"] and "ready" not in TRANSITIONS["sleeping"]


def test_a_model_refuses_an_illegal_transition(tmp_path):
    from kvcached.serve.model import ModelRuntime
    from kvcached.serve.state import StatePublisher, StateStore

    cfg = config(tmp_path, [fake_model("m", tmp_path / "m.log")])
    pub = StatePublisher()
    try:
        m = ModelRuntime(cfg.models[0], cfg, StateStore(str(tmp_path / "s")), pub)
        with pytest.raises(IllegalTransition, match="stopped -> waking"):
            m.set_state("waking")
        assert m.state == "stopped"
        m.set_state("starting")
        with pytest.raises(IllegalTransition, match="starting -> sleeping"):
            m.set_state("sleeping")
    finally:
        pub.close()


def test_a_failed_model_waiting_for_its_restart_is_restarted_after_adoption(tmp_path):
    """The router was killed between a failure and its restart: the next one
    adopts the model as failed, with the reason, then restarts it as planned;
    the failure is remembered, so its log is kept at the stop."""
    from kvcached.serve.state import ModelRecord, StateStore

    cfg = config(tmp_path, [fake_model("m", tmp_path / "m.log", restart={"backoff_s": 0.5})])
    store = StateStore(cfg.resolved_state_dir())
    store.write(
        ModelRecord(name="m", state="failed", failure="engine pid 7 died (exit -9)", failures=1)
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            m = serve.find("m")
            assert m.state == "failed" and m.failure == "engine pid 7 died (exit -9)"
            assert not m.given_up and m.counters.starts == 0
            await until(lambda: m.state == "ready", 60, "the restart")
            assert m.counters.restarts == 1 and m.failure == "" and m.failures == 1

    run(body())
    assert (tmp_path / "state" / "m.log").exists()  # it failed: its log stays


def test_a_failed_model_whose_launch_changed_since_starts_afresh(tmp_path):
    """Given up on under the killed router, but its config was fixed before
    this one started (another argv): it starts; its old failure keeps its log."""
    from kvcached.serve.state import ModelRecord, StateStore

    cfg = config(tmp_path, [fake_model("m", tmp_path / "m.log")])
    StateStore(cfg.resolved_state_dir()).write(
        ModelRecord(
            name="m", state="failed", failure="bad args", given_up=True, failures=1, launch="0" * 16
        )
    )

    async def body() -> None:
        async with Serve(cfg) as serve:
            m = serve.find("m")
            await until(lambda: m.state == "ready", 60, "a fresh start")
            assert m.counters.starts == 1 and not m.given_up and serve.exit_code == 0

    run(body())
    assert (tmp_path / "state" / "m.log").exists()
