"""One serve per port and per config, adoption after SIGKILL, nothing left
behind: ``kvcached serve`` as a process (the CLI), over fake engines that are
real HTTP servers in processes of their own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.serve.engine import MARKER, marked_groups
from tests.integration.serve.serve_process import free_port, http_get, http_post
from tests.serve.serve_helpers import FAKE, fake_model


class Cli:
    """One ``kvcached serve`` process."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcached", "serve", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def get(port: int, path: str) -> tuple[int, Any]:  # noqa: ANN401
    return http_get(port, path, timeout_s=10)


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:  # noqa: ANN401
    return http_post(port, path, body)


def wait_for(check: Any, timeout_s: float, what: str, cli: Cli | None = None) -> Any:  # noqa: ANN401
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            got = check()
            if got:
                return got
        if cli is not None and cli.proc.poll() is not None:
            raise AssertionError(
                f"serve exited ({cli.proc.returncode}) waiting for {what}:\n{cli.text()}"
            )
        if time.monotonic() > deadline:
            extra = f"\n{cli.text()}" if cli else ""
            raise AssertionError(f"timed out waiting for {what}{extra}")
        time.sleep(0.1)


def state(port: int, model: str) -> dict[str, Any]:
    return get(port, f"/v1/models/{model}/state")[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.fixture
def kill_marked(tmp_path: Path) -> Iterator[None]:
    """Whatever a failed test left running under tmp_path's state dirs."""
    yield
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{entry}/environ").read_bytes()
            if f"{MARKER}={tmp_path}".encode() in env:
                os.killpg(os.getpgid(int(entry)), signal.SIGKILL)


def write(tmp_path: Path, doc: dict[str, Any], name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_a_second_serve_is_refused_in_one_line_touching_nothing_of_the_first(tmp_path, kill_marked):
    port = free_port()
    state_dir = tmp_path / "state"
    cfg = write(
        tmp_path,
        {
            "port": port,
            "state_dir": str(state_dir),
            "models": [fake_model("alpha", tmp_path / "a.log")],
        },
    )
    first = Cli(cfg, tmp_path / "first.log")
    try:
        wait_for(lambda: get(port, "/ready")[0] == 200, 60, "the first serve", first)
        record = state_dir / "alpha.json"
        before = (record.read_bytes(), record.stat().st_mtime_ns)
        pid = state(port, "alpha")["pid"]
        # the same config; then the same port (state dir) from another file
        other = write(tmp_path, json.loads(cfg.read_text()), "copy.yaml")
        for path in (cfg, other):
            out = subprocess.run(
                [sys.executable, "-m", "kvcached", "serve", str(path)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1, out.stderr
            expected = (
                f"another kvcached serve (pid {first.proc.pid}, router port {port}) already "
                f"runs with config {cfg}; stop it first"
                if path == cfg
                else f"another kvcached serve (pid {first.proc.pid}, router port {port}, config "
                f"{cfg}) already runs with state directory {state_dir}; stop it first"
            )
            assert expected in lines[0], lines[0]
        assert (record.read_bytes(), record.stat().st_mtime_ns) == before
        assert state(port, "alpha")["pid"] == pid and alive(pid)
        # another port, but the config's state_dir: the same lock
        out = subprocess.run(
            [sys.executable, "-m", "kvcached", "serve", str(cfg), "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and "already runs" in out.stderr
        assert post(port, "/v1/completions", {"model": "alpha"})[0] == 200
    finally:
        assert first.stop() == 0


def test_the_same_config_on_another_port_is_refused_naming_the_running_serve(
    tmp_path, kill_marked, monkeypatch
):
    """Default state dirs (per port): the second serve finds the first by its
    config, and says so first and alone, naming its pid and port, though the
    first one's engine runs a kvcached instance of the model's name (a foreign
    instance to a serve of another state directory). A serve of another config
    file with that model name is told whose engine that instance is."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    port = free_port()
    name = f"alpha-{os.getpid()}"  # snapshots are machine-wide: a name of this run's own
    model = fake_model(name, tmp_path / "a.log", extra=["--kvcached"])
    cfg = write(tmp_path, {"port": port, "models": [model]})
    first = Cli(cfg, tmp_path / "first.log")
    try:
        wait_for(lambda: get(port, "/ready")[0] == 200, 60, "the first serve", first)
        expected = (
            f"kvcached serve: {cfg}: another kvcached serve (pid {first.proc.pid}, router port "
            f"{port}) already runs with config {cfg}; stop it first"
        )
        for check in ([], ["--check"]):
            out = subprocess.run(
                [sys.executable, "-m", "kvcached", "serve", *check, str(cfg)]
                + ["--port", str(free_port())],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().count("\n") == 0, out.stderr
            assert out.stderr.startswith(expected), out.stderr
        other = write(tmp_path, {"port": free_port(), "models": [model]}, "other.yaml")
        out = subprocess.run(
            [sys.executable, "-m", "kvcached", "serve", "--check", str(other)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert (
            f"models[0].name ({name}): a kvcached instance named {name!r} already runs (pid "
            f"{state(port, name)['pid']}), model {name} of another kvcached serve (pid "
            f"{first.proc.pid}, router port {port}, config {cfg}); stop that serve, or rename "
            "the model" in out.stderr
        ), out.stderr
    finally:
        assert first.stop(signal.SIGTERM) == 0
    assert not list(tmp_path.glob("kvcached-serve-*"))  # SIGTERM too: its state dir went
    assert not marked_groups(f"{tmp_path}/kvcached-serve-{port}/{name}")


def test_a_router_on_port_0_tells_a_second_serve_the_port_it_took(tmp_path):
    import asyncio

    from kvcached.serve.app import Serve
    from kvcached.serve.preflight import running_serve
    from kvcached.serve.state import lock_holder
    from tests.serve.serve_helpers import config

    cfg = config(tmp_path, [fake_model("a", tmp_path / "a.log", start="lazy")])

    async def body() -> None:
        async with Serve(cfg) as serve:
            assert serve.port != 0
            holder = lock_holder(cfg.resolved_state_dir())
            assert holder is not None and holder["port"] == serve.port
            assert f"router port {serve.port}" in (running_serve(cfg) or "")

    asyncio.run(body())


def test_a_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        cfg = write(
            tmp_path,
            {
                "port": port,
                "state_dir": str(tmp_path / "state"),
                "models": [fake_model("alpha", tmp_path / "a.log")],
            },
        )
        out = subprocess.run(
            [sys.executable, "-m", "kvcached", "serve", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"kvcached serve: {cfg}: port: 127.0.0.1:{port} is in use by another program; "
        f"choose another port (port: in {cfg}, or --port)"
    )


def test_the_router_itself_refuses_a_taken_port_in_one_line(tmp_path):
    """Past the pre-flight check (a port taken between check and bind)."""
    import asyncio
    import socket

    from kvcached.serve.app import Serve
    from kvcached.serve.state import ServeError
    from tests.serve.serve_helpers import config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        cfg = config(tmp_path, [fake_model("a", tmp_path / "a.log")], port=sock.getsockname()[1])

        async def body() -> None:
            serve = Serve(cfg)
            with pytest.raises(ServeError, match=r"is in use \(another kvcached serve or another"):
                await serve.start()
            await serve.stop()  # touches nothing: it never held the state directory

        asyncio.run(body())
    assert not (tmp_path / "state" / "serve.lock").exists()
    assert not (tmp_path / "state" / "a.json").exists()


@pytest.mark.slow
def test_a_router_killed_adopts_exactly_its_engines_whatever_their_state(tmp_path, kill_marked):
    """SIGKILL the router with one engine ready, one asleep, one still starting;
    plant a stray engine carrying alpha's mark and lose gamma's state file. The
    next router adopts the three it started (same pids, no new start), stops the
    stray, and for gamma stops the old engine before it starts one. Ctrl-C then
    leaves no marked process."""
    port = free_port()
    state_dir = tmp_path / "state"
    doc = {
        "port": port,
        "state_dir": str(state_dir),
        "idle_check_s": 0.05,
        "models": [
            fake_model("alpha", tmp_path / "a.log"),
            fake_model("beta", tmp_path / "b.log", sleep={"level": "kv", "idle_after": 600}),
            fake_model("slow", tmp_path / "s.log", extra=["--slow-start", "6"]),
            fake_model("gamma", tmp_path / "g.log"),
        ],
    }
    cfg = write(tmp_path, doc)
    first = Cli(cfg, tmp_path / "first.log")
    wait_for(
        lambda: all(state(port, m)["state"] == "ready" for m in ("alpha", "beta", "gamma")),
        60,
        "three ready",
        first,
    )
    assert post(port, "/admin/models/beta/sleep", {})[0] == 200
    before = {m: state(port, m) for m in ("alpha", "beta", "slow", "gamma")}
    assert before["beta"]["state"] == "sleeping" and before["slow"]["state"] == "starting"
    first.proc.kill()
    first.proc.wait(30)
    pids = {m: d["pid"] for m, d in before.items()}
    assert all(alive(p) for p in pids.values())  # engines outlive their router
    stray_port = free_port()
    stray = subprocess.Popen(
        [sys.executable, FAKE, str(stray_port), str(tmp_path / "stray.log")],
        env={**os.environ, MARKER: f"{state_dir}/alpha"},
        start_new_session=True,
    )
    (state_dir / "gamma.json").unlink()

    second = Cli(cfg, tmp_path / "second.log")
    try:
        wait_for(lambda: get(port, "/ready")[0] == 200, 60, "the second router", second)
        after = {m: state(port, m) for m in ("alpha", "beta", "slow", "gamma")}
        for m in ("alpha", "beta", "slow"):
            assert after[m]["pid"] == pids[m] and after[m]["starts"] == 0, after[m]
        assert after["alpha"]["state"] == "ready" and after["beta"]["state"] == "sleeping"
        assert after["slow"]["state"] == "ready"
        assert stray.wait(30) is not None  # the stray was stopped
        assert not alive(pids["gamma"])  # its old engine went before the new one started
        assert after["gamma"]["starts"] == 1 and after["gamma"]["pid"] != pids["gamma"]
        assert set(marked_groups(f"{state_dir}/gamma")) == {after["gamma"]["pid"]}
        assert post(port, "/v1/completions", {"model": "beta"})[0] == 200  # wakes
        assert "stopping engine process group" in second.text()
    finally:
        assert second.stop() == 0
    for m in ("alpha", "beta", "slow", "gamma"):
        assert not marked_groups(f"{state_dir}/{m}"), m
    assert not state_dir.exists()  # lock, state files and logs gone; nothing failed


def test_a_router_killed_keeps_a_failed_model_failed_with_its_reason_and_log(tmp_path, kill_marked):
    """A model given up on (keep-serving), then the router SIGKILLed: the next
    router shows it ``failed`` with the same reason, starts no engine for it,
    and its clean stop keeps the log and names it."""
    port = free_port()
    state_dir = tmp_path / "state"
    doc = {
        "port": port,
        "state_dir": str(state_dir),
        "idle_check_s": 0.05,
        "on_model_failure": "keep-serving",
        "models": [
            fake_model("fine", tmp_path / "f.log"),
            fake_model(
                "broken",
                tmp_path / "b.log",
                extra=["--fail-traceback"],
                restart={"max_restarts": 0},
            ),
        ],
    }
    cfg = write(tmp_path, doc)
    first = Cli(cfg, tmp_path / "first.log")
    wait_for(lambda: state(port, "broken")["given_up"], 60, "broken given up", first)
    wait_for(lambda: get(port, "/ready")[0] == 200, 60, "fine ready", first)
    before = state(port, "broken")
    assert before["state"] == "failed" and "ValueError: max_model_len (100000)" in before["failure"]
    fine_pid = state(port, "fine")["pid"]
    first.proc.kill()
    first.proc.wait(30)

    second = Cli(cfg, tmp_path / "second.log")
    try:
        wait_for(lambda: get(port, "/ready")[0] == 200, 60, "the second router", second)
        after = state(port, "broken")
        assert after["state"] == "failed" and after["given_up"], after
        assert after["failure"] == before["failure"]
        assert after["starts"] == 0 and after["pid"] == 0  # no engine started for it
        assert get(port, "/ready")[1]["failed"] == ["broken"]
        status, doc = post(port, "/v1/completions", {"model": "broken"})
        assert status == 503 and "ValueError: max_model_len (100000)" in doc["error"]["message"]
        assert state(port, "fine")["pid"] == fine_pid  # adopted as ever
        assert "model broken failed and will not be restarted" in second.text()
    finally:
        assert second.stop() == 0
    log = state_dir / "broken.log"
    assert log.exists() and "ValueError: max_model_len (100000)" in log.read_text()
    assert f"model broken failed; its log stays: {log}" in second.text()
    assert not (state_dir / "fine.log").exists()


def test_a_clean_stop_returns_its_engines_pools_to_the_ledger_without_a_word_of_fault(
    tmp_path, kill_marked
):
    """The engine ends on SIGINT with its kvcached pool still open (vLLM's
    shutdown SIGKILLs its workers): serve retires the pool, its charge leaves
    the ledger, and serve's terminal reads as a clean stop: no warning, no
    error, no "dead process"."""
    from kvcached.serve.sleep import read_kv

    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    name = f"kvpool-{os.getpid()}"  # snapshots are machine-wide: a name of this run's own
    port = free_port()
    cfg = write(
        tmp_path,
        {
            "port": port,
            "state_dir": str(tmp_path / "state"),
            "models": [fake_model(name, tmp_path / "a.log", extra=["--kvcached"])],
        },
    )
    cli = Cli(cfg, tmp_path / "serve.log", env={**os.environ, "KVCACHED_LEDGER_DIR": str(ledgers)})
    try:
        wait_for(lambda: get(port, "/ready")[0] == 200, 60, "serve ready", cli)
        held = read_kv(name, str(ledgers))
        assert held is not None and held.charged_bytes == 8 << 20
    finally:
        assert cli.stop() == 0
    assert read_kv(name, str(ledgers)) is None  # no pool of it is left, dead or alive
    text = cli.text()
    assert "kvcached serve: stopped" in text
    assert "dead process" not in text
    assert not [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]


def test_a_second_serve_lock_is_refused_naming_the_holder(tmp_path):
    """The lock file tells a second serve (and ``lock_holder``) who holds it;
    a holder that wrote something other than a JSON object is named with ``?``."""
    from kvcached.serve.state import ServeError, ServeLock, lock_holder

    state_dir = str(tmp_path / "state")
    first = ServeLock(state_dir)
    first.acquire({"port": 8123, "config": "a.yaml"})
    try:
        holder = {"pid": os.getpid(), "port": 8123, "config": "a.yaml"}
        assert lock_holder(state_dir) == holder
        with pytest.raises(
            ServeError, match=rf"pid {os.getpid()}, router port 8123, config a\.yaml"
        ):
            ServeLock(state_dir).acquire({"port": 1})
        os.pwrite(first._fd, b"[1]" + b" " * 80, 0)
        assert lock_holder(state_dir) == {}
        with pytest.raises(ServeError, match=r"pid \?, router port \?, config \?"):
            ServeLock(state_dir).acquire({"port": 1})
    finally:
        first.release()
    assert lock_holder(state_dir) is None
