"""One vLLM OpenAI server in its own process group, and a stdlib client for it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .cpus import pinned_argv

# The CPU tests' server harness reads process groups from /proc the same way.
from .vllm_server import group_stats

#: What a log must not contain (case-sensitive), whatever the case.
BAD_LINES = ("Traceback (most recent call last)", "CUDA error", "RuntimeError: CUDA")
#: kvcached's own failure lines (patch failures, switched off).
KVCACHED_BAD = ("kvcached is off in this process", "stays native", "failed and was undone")
#: kvcached's lines that prove it serves: the workers' KV allocation and the engine core's pool.
KVCACHED_ACTIVE = ("KV allocation patched", "engine core: block pool")


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on ``port``, logging to ``log``."""

    def __init__(
        self,
        name: str,
        port: int,
        model: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
        cpus: list[int] | None = None,
    ) -> None:
        self.name, self.port, self.model, self.log = name, port, model, log
        #: CPUs the server and its children run on (``cpus.pinned_argv``); None: any
        self.cpus = cpus
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--port",
            str(port),
            "--model",
            model,
            "--served-model-name",
            name,
            *args,
        ]
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        #: The log's size when the stop signal went out: what the server wrote
        #: before it (an engine that prints no shutdown line of its own).
        self.log_bytes_at_stop: int | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("w")
        out.write(
            " ".join(self.argv)
            + "\n"
            + json.dumps(
                {
                    k: v
                    for k, v in self.env.items()
                    if k.startswith(("KVCACHED", "ENABLE_KV", "VLLM_"))
                }
            )
            + "\n"
            + (f"cpus {self.cpus}\n" if self.cpus is not None else "")
        )
        out.flush()
        self.started = time.time()
        self.proc = subprocess.Popen(
            self.argv if self.cpus is None else pinned_argv(self.argv, self.cpus),
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> float | None:
        """Seconds until /health answered 200; ``None`` if it died or timed out."""
        while time.time() - self.started < timeout:
            if self.proc.poll() is not None:
                return None
            try:
                if get(self.url("/health"), 2)[0] == 200:
                    return time.time() - self.started
            except Exception:
                pass
            time.sleep(0.5)
        return None

    def alive(self) -> bool:
        try:
            return self.proc.poll() is None and get(self.url("/health"), 5)[0] == 200
        except Exception:
            return False

    def stop(self, grace: float = 90.0) -> float | None:
        """SIGINT to the process group; seconds until every member left, ``None``
        if it had to be killed."""
        if self.proc is None:
            return 0.0
        t = time.time()
        with contextlib.suppress(OSError):
            self.log_bytes_at_stop = self.log.stat().st_size
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            return 0.0
        while time.time() - t < grace:
            if self.proc.poll() is not None and not group_alive(self.proc.pid):
                return time.time() - t
            time.sleep(0.25)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 5,
        }
        t = time.time()
        status, data = post(self.url("/v1/completions"), body)
        out: dict[str, Any] = {"status": status, "latency_s": round(time.time() - t, 3)}
        if status != 200:
            out["error"] = data[:500].decode(errors="replace")
            return out
        reply = json.loads(data)
        choice = reply["choices"][0]
        lp = choice.get("logprobs") or {}
        out["text"] = choice["text"]
        out["tokens"] = lp.get("tokens") or []
        out["top"] = lp.get("top_logprobs") or []
        usage = reply.get("usage") or {}
        out["completion_tokens"] = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        out["cached_tokens"] = details.get("cached_tokens")
        return out

    def complete_all(self, prompts: list[str], max_tokens: int, concurrent: bool) -> list[dict]:
        if not concurrent:
            return [self.complete(p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def reset_prefix_cache(self) -> int:
        return post(self.url("/reset_prefix_cache"), None)[0]


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def post(url: str, body: Any, timeout: float = 600) -> tuple[int, bytes]:
    data = b"" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:  # connection refused or reset: the server died
        return 0, repr(e).encode()


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` is left."""
    return any(fields[0] != "Z" for _, fields in group_stats(pgid))


def gpu_pids() -> set[int]:
    """Processes nvidia-smi lists as holding GPU memory."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except Exception:
        return set()
    return {int(x) for x in out.split() if x.strip().isdigit()}


#: vLLM 0.26 answers SIGINT by killing its engine core at once ("mode=abort
#: timeout=0s", then "force killing remaining processes", native servers too), and
#: the API server may then log the dead engine's EngineDeadError: a traceback of the
#: stop itself, reported apart (``shutdown_tracebacks``), not a failure of the run.
SHUTDOWN_MARK = "[shutdown]"


def error_lines(before: str, shutdown: str = "") -> list[str]:
    """The error signatures in a server's log: any of :data:`BAD_LINES` in what
    it wrote before its shutdown; in what it wrote after, only a CUDA error (a
    child's traceback on the stop signal is shutdown noise)."""
    return [b for b in BAD_LINES if b in before] + [b for b in BAD_LINES[1:] if b in shutdown]


def log_findings(log: Path, kvcached: bool) -> dict[str, Any]:
    full = log.read_text(errors="replace") if log.exists() else ""
    cut = full.find(SHUTDOWN_MARK)
    text, tail = (full, "") if cut < 0 else (full[:cut], full[cut:])
    bad = error_lines(text, tail)
    kv_lines = [ln for ln in full.splitlines() if "[kvcached]" in ln]
    kv_bad = [b for b in KVCACHED_BAD if b in full]
    active = all(any(a in ln for ln in kv_lines) for a in KVCACHED_ACTIVE)
    return {
        "no_traceback_or_cuda_error": not bad,
        "bad": bad + kv_bad,
        "kvcached_active" if kvcached else "no_kvcached_line": (active and not kv_bad)
        if kvcached
        else not kv_lines,
        "kvcached_lines": kv_lines[:12],
        "shutdown_tracebacks": tail.count(BAD_LINES[0]),
    }


def log_verdicts(found: Iterable[dict[str, Any]]) -> dict[str, bool]:
    """The two log checks of a case's kvcached servers, from each log's findings
    (this module's :func:`log_findings` or an engine's own): no traceback, CUDA
    error or kvcached failure in any, and kvcached active in every one."""
    found = list(found)
    return {
        "no_traceback_cuda_error_or_patch_failure": all(
            f["no_traceback_or_cuda_error"] and not f["bad"] for f in found
        ),
        "kvcached_active": all(f["kvcached_active"] for f in found),
    }


def finish_case(rec: dict[str, Any], checks: dict[str, bool], logs: list[Path], case: str,
                out: Path) -> int:  # fmt: skip
    """A single-case runner's end: the kvcached log checks of every server, then
    ``out/summary.json`` (``rec`` with ``cases: {case: checks}``) and one JSON
    line; the exit status (1: a check failed or the run broke off)."""
    found = {p.name: log_findings(p, True) for p in logs}
    checks.update(log_verdicts(found.values()))
    rec["log"] = found
    rec["cases"] = {case: checks}
    (out / "summary.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    failed = [k for k, v in checks.items() if not v]
    print(json.dumps({"checks": checks, "failed": failed, "error": rec.get("error")}), flush=True)
    return 1 if failed or "error" in rec else 0
