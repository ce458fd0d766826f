"""A ``kvcached serve`` process for the serve tests: a free port, the environment
it runs in, its start and its stop (no engine imported here, no client needed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


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
