"""Real kvcached instances in subprocesses, and kvctl run against them."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("instance_child.py")
KVCTL = [sys.executable, "-m", "kvcached.cli.kvctl"]


def unique_index() -> int:
    """A host device index no other test uses (the host backend counts every
    process' memory of an index across the machine)."""
    return random.randrange(20_000, 60_000)


def child_env(ledger_dir: str, name: str | None, driver: str = "host") -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVCACHED_IPC_NAME", None)
    if name is not None:
        env["KVCACHED_IPC_NAME"] = name
    env.update(
        {
            "KVCACHED_LEDGER_DIR": ledger_dir,
            "KVCACHED_DRIVER": driver,
            "KVCACHED_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        }
    )
    return env


class Child:
    """One instance process (see ``instance_child.py``)."""

    def __init__(
        self,
        ledger_dir: str,
        index: int | str,
        name: str | None = None,
        engine: str = "test",
        capacity: int = 256 << 20,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(index), str(capacity), engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(ledger_dir, name, "cuda" if index == "cuda" else "host"),
        )
        self.ready = self._read(timeout=120)
        assert self.ready.get("ready"), self.ready
        self.name: str = self.ready["name"]
        self.page_bytes: int = self.ready["page_bytes"]
        self.blocks_per_page: int = self.ready["blocks_per_page"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, timeout: float) -> dict:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"instance process {self.proc.pid} did not answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"instance process exited with {self.proc.wait(5)}")
        return json.loads(line)

    def cmd(self, line: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError, ValueError):
                self.cmd("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def run_kvctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """``python -m kvcached.cli.kvctl ARGS`` from the repository root."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    return subprocess.run(
        [*KVCTL, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO
    )


def wait_until(pred, timeout: float = 5.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
