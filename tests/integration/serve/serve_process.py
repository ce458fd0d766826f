"""A ``kvcached serve`` process for the serve tests: a free port, the environment
it runs in, its start and its stop, and plain JSON over HTTP to it (no engine
imported here, no client needed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_env(work: Path) -> dict[str, str]:
    """This process' environment with the ledger in ``work``, vLLM offline and
    quiet, and no ledger name inherited from the test run."""
    env = dict(os.environ)
    env.update(
        {
            "KVCACHED_LEDGER_DIR": str(work),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("KVCACHED_IPC_NAME", None)
    return env


def start_serve(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``kvcached serve CONFIG`` in a session of its own, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvcached", "serve", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop_serve(proc: subprocess.Popen[bytes], grace_s: float = 120) -> None:
    """Ctrl-C, as a user stops it; killed if it has not exited after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def http_json(
    port: int,
    path: str,
    body: object = None,
    *,
    key: str | None = None,
    timeout_s: float = 30,
) -> tuple[int, Any]:  # noqa: ANN401
    """``GET`` (no ``body``) or ``POST`` of ``body`` as JSON on loopback, with a
    bearer ``key`` if given: the status and the JSON answer (its text if not
    JSON), error statuses included."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def http_get(port: int, path: str, timeout_s: float = 30) -> tuple[int, Any]:  # noqa: ANN401
    return http_json(port, path, timeout_s=timeout_s)


def http_post(port: int, path: str, body: object, timeout_s: float = 30) -> tuple[int, Any]:  # noqa: ANN401
    return http_json(port, path, {} if body is None else body, timeout_s=timeout_s)
