"""A running ``kvcached serve`` for the serve tests that drive real engines: the
:class:`Served` handle (HTTP, the ``openai`` client, ``kvctl``, its log), the
``serving`` context that starts one from a config and cleans up after it, and the
engine arguments those tests give their tiny vLLM models.

``openai`` is imported where a client is made, so that importing this module needs
no engine and no client (the tests take their own skips first)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.integration.serve.serve_models import dummy_vllm_args
from tests.integration.serve.serve_process import (
    http_get,
    http_post,
    serve_env,
    start_serve,
    stop_serve,
)

if TYPE_CHECKING:
    import openai

START_S = 900.0  # an engine start on a loaded two-core machine


def vllm_args() -> list[str]:
    return [
        *dummy_vllm_args(max_model_len=1024, max_num_seqs=16),
        "--seed",
        "0",
        "--enable-prefix-caching",
    ]


@dataclass
class Served:
    """The serve under test: its process, where it listens, its files."""

    proc: subprocess.Popen[bytes]
    port: int
    config: Path
    env: dict[str, str]
    workdir: Path
    log: Path
    tag: str

    def name(self, model: str) -> str:
        return f"{model}-{self.tag}"

    def client(self) -> openai.OpenAI:
        import openai

        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=600, max_retries=0
        )

    def engine_client(self, model: str) -> openai.OpenAI:
        import openai

        port = self.state(model)["port"]
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0
        )

    def get(self, path: str) -> tuple[int, object]:
        return http_get(self.port, path)

    def post(
        self, path: str, body: dict[str, object], port: int | None = None
    ) -> tuple[int, object]:
        return http_post(port or self.port, path, body, timeout_s=600)

    def state(self, model: str) -> dict[str, object]:
        status, doc = self.get(f"/v1/models/{self.name(model)}/state")
        assert status == 200, doc
        return doc  # type: ignore[return-value]

    def wait_state(self, model: str, state: str, timeout_s: float = START_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"serve exited; log:\n{self.log_tail()}"
            doc = self.state(model)
            if doc["state"] == state:
                return doc
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{model} is {doc['state']}, not {state}, after "
                    f"{timeout_s:g} s; log:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def kvctl(self, *args: str) -> object:
        out = subprocess.run(
            [sys.executable, "-m", "kvcached.cli.kvctl", *args, "--json"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def wait_ready(served: Served, timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert served.proc.poll() is None, f"serve exited; log:\n{served.log_tail()}"
        try:
            status, _ = served.get("/ready")
        except OSError:
            status = 0
        if status == 200:
            return
        time.sleep(0.5)
    raise AssertionError(f"serve not ready in {timeout_s:g} s; log:\n{served.log_tail()}")


@contextlib.contextmanager
def serving(work: Path, cfg: dict[str, Any], tag: str) -> Iterator[Served]:
    """``kvcached serve`` of ``cfg`` (written to ``work/serve.yaml``; its ``port``,
    ``state_dir`` and ``models``), ready; on exit Ctrl-C, then SIGKILL to the
    process group of every vLLM engine a failed test left running."""
    config = work / "serve.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    env = serve_env(work)
    log = work / "serve.log"
    s = Served(start_serve(config, env, log), cfg["port"], config, env, work, log, tag)
    try:
        wait_ready(s)
        yield s
    finally:
        stop_serve(s.proc)
        for model in cfg["models"]:
            record = Path(cfg["state_dir"]) / f"{model['name']}.json"
            if model.get("engine", "vllm") == "vllm" and record.exists():
                pid = json.loads(record.read_text()).get("pid")
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
