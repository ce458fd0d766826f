"""A real vLLM OpenAI server on loopback, for integration tests and benchmarks.

The server is ``python -m vllm.entrypoints.openai.api_server`` serving the tiny
Llama of :mod:`vllm_model` with ``--skip-tokenizer-init``: prompts are token-id
lists and answers are token ids. It runs in a process group of its own, so a
stop signal reaches the API server, the engine core and the workers together, as
a user's Ctrl-C would.

Nothing here imports vLLM: the server runs under the interpreter running this
code, which must be able to import vLLM. Only the standard library is used, so
the module also serves ``benchmarks/``.

A kvcached server is the same server with ``ServerOptions(kvcached=True)``: the
``vllm.general_plugins`` entry point of the installed kvcached applies the patch
in every vLLM process when ``ENABLE_KVCACHED=true``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.integrations.amx import cpu_has_amx

SERVED_MODEL_NAME = "tiny-llama"
#: On a CPU with AMX, native servers start with this folder on PYTHONPATH, whose
#: sitecustomize asks Linux for AMX tile data (kvcached/integrations/amx.py says why).
AMX_SHIM = str(Path(__file__).resolve().parents[2] / "tests" / "amx_permission")
STOP_GRACE_S = 90.0

#: kvcached variables a developer's shell may carry: every server gets them from
#: its ServerOptions only, so a native server is native whatever the shell says.
_OWNED_ENV_PREFIXES = ("KVCACHED_", "ENABLE_KVCACHED")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` CPU workers its
    own CPUs ("0|1" on two cores), or "nobind" when there are too few."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return "nobind"
    share = len(cpus) // ranks
    return "|".join(
        ",".join(str(c) for c in cpus[r * share : (r + 1) * share]) for r in range(ranks)
    )


def completion_chunks(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent-event stream, up to ``[DONE]``
    (lines that are not ``data:`` events are skipped)."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def chunk_token_ids(chunk: Mapping[str, Any]) -> list[int]:
    """The token ids a completion chunk carries (vLLM's ``return_token_ids``), all choices."""
    return [t for choice in chunk.get("choices") or [] for t in choice.get("token_ids") or []]


@dataclass(frozen=True)
class ServerOptions:
    """How one server is started. Two servers with equal options (and seed)
    give the same greedy tokens for the same prompts."""

    kvcached: bool = False
    #: "safetensors" for the weights of :func:`vllm_model.write_tiny_llama`,
    #: "dummy" for vLLM's own (see :mod:`vllm_model` for why tests avoid those).
    load_format: str = "safetensors"
    #: A multiple of 32 (the CPU attention backend's kernel block).
    block_size: int = 32
    seed: int = 0
    max_model_len: int = 4096
    max_num_seqs: int = 32
    #: VLLM_CPU_KVCACHE_SPACE, GiB of KV cache the CPU engine sizes (None:
    #: unset, and vLLM sizes it from the NUMA node's free memory).
    kv_cache_gib: int | None = 1
    prefix_caching: bool = True
    #: Skip torch.compile: the tiny model gains nothing from it and a start
    #: takes tens of seconds less on two cores.
    enforce_eager: bool = True
    #: Tensor-parallel ranks: CPU workers, each bound to its own share of the
    #: CPUs this process may use (vLLM's automatic binding wants a NUMA node
    #: per rank).
    tensor_parallel: int = 1
    #: kvcached instance name (KVCACHED_IPC_NAME) when ``kvcached`` is set.
    ipc_name: str | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(
                f"load_format={self.load_format!r} is not valid: 'safetensors' "
                "(weights from write_tiny_llama) or 'dummy'"
            )
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} is not valid: 1 or more")
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(
                f"block_size={self.block_size} is not valid: the CPU attention "
                "backend needs a positive multiple of 32"
            )

    def args(self, model_dir: Path, port: int) -> list[str]:
        """The server's command-line arguments after ``python -m ...``."""
        args = [
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load-format",
            self.load_format,
            "--skip-tokenizer-init",
            "--seed",
            str(self.seed),
            "--enable-prompt-tokens-details",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.tensor_parallel > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel)]
        args.extend(self.extra_args)
        return args

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment: ``base`` without its kvcached settings,
        then exactly the ones these options ask for."""
        env = {k: v for k, v in base.items() if not k.startswith(_OWNED_ENV_PREFIXES)}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.update(
            {
                # /reset_prefix_cache is a development endpoint.
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                "ENABLE_KVCACHED": "true" if self.kvcached else "false",
            }
        )
        if self.tensor_parallel > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(self.tensor_parallel)
        if self.kvcached and self.ipc_name:
            env["KVCACHED_IPC_NAME"] = self.ipc_name
        if not self.kvcached and cpu_has_amx():
            # A native server loads nothing of kvcached, whose plugin asks for AMX.
            path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            if AMX_SHIM not in path:
                env["PYTHONPATH"] = os.pathsep.join([AMX_SHIM, *path])
        env.update(self.extra_env)
        return env


@dataclass
class Completion:
    """One completion request's outcome."""

    status: int
    token_ids: list[int]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """HTTP 200 with at least one output token (the seed's ``<phase>_ok``)."""
        return self.status == 200 and self.error is None and len(self.token_ids) > 0


@dataclass
class StreamedCompletion:
    """A streamed completion: when its first token and its end arrived."""

    status: int
    token_ids: list[int]
    ttft_s: float
    total_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and len(self.token_ids) > 0


@dataclass(frozen=True)
class StopResult:
    """How a server ended after the stop signal."""

    exit_s: float  # seconds from the signal to the main process' exit
    clean: bool  # exited on the signal, within the grace period
    returncode: int | None
    leftover_pids: tuple[int, ...]  # processes of its group alive after the end


class ServerError(RuntimeError):
    """The server did not start or died; the message carries its log's tail."""


class VllmServer:
    """One vLLM server process group: :meth:`start`, :meth:`wait_ready`, use it,
    then :meth:`stop` (or :meth:`close` in a ``finally``, which stops it if needed).

    Invariant: while ``self.proc`` is not None and has not exited, the server's
    process group ``self.proc.pid`` exists and is ours to signal.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        options: ServerOptions | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.options = options or ServerOptions()
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.stop_result: StopResult | None = None
        self._log_offset_at_stop: int | None = None
        self._started_at = 0.0

    # -- lifetime ---------------------------------------------------------
    def start(self) -> None:
        """Spawn the server in its own process group (returns at once)."""
        if self.proc is not None:
            raise RuntimeError("start() called twice on one VllmServer")
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += self.options.args(self.model_dir, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.options.env(os.environ),
                start_new_session=True,
            )
        self._started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll ``/health`` until it answers 200; return seconds since start.
        Raises :class:`ServerError` if the server exits or the time runs out."""
        assert self.proc is not None, "wait_ready() before start()"
        deadline = self._started_at + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with {self.proc.returncode} before it was "
                    f"ready; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                status, _ = self._request("GET", "/health", timeout_s=2.0)
            except OSError:
                status = 0
            if status == 200:
                self.ready_s = time.monotonic() - self._started_at
                return self.ready_s
            time.sleep(0.5)
        raise ServerError(
            f"vLLM server not ready within {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def alive(self) -> bool:
        """The main process runs and ``/health`` answers 200."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            status, _ = self._request("GET", "/health", timeout_s=5.0)
        except OSError:
            return False
        return status == 200

    def stop(self, grace_s: float = STOP_GRACE_S) -> StopResult:
        """SIGINT to the process group; SIGKILL to it after ``grace_s``.
        Idempotent: a second call returns the first result."""
        if self.stop_result is not None:
            return self.stop_result
        assert self.proc is not None, "stop() before start()"
        self._log_offset_at_stop = self._log_size()
        pgid = self.proc.pid
        start = time.monotonic()
        _signal_group(pgid, signal.SIGINT)
        try:
            returncode: int | None = self.proc.wait(timeout=grace_s)
            clean = True
        except subprocess.TimeoutExpired:
            clean = False
            _signal_group(pgid, signal.SIGKILL)
            returncode = self.proc.wait(timeout=30)
        exit_s = time.monotonic() - start
        # Children (engine core, workers) leave after the main process; give
        # them the rest of the grace period, then kill what is left.
        leftover = _wait_group_empty(pgid, max(5.0, grace_s - exit_s) if clean else 5.0)
        if leftover:
            _signal_group(pgid, signal.SIGKILL)
            _wait_group_empty(pgid, 10.0)
        self.stop_result = StopResult(exit_s, clean, returncode, leftover)
        return self.stop_result

    def close(self) -> None:
        """Make sure nothing of the server is left (for ``finally`` blocks)."""
        if self.proc is not None and self.stop_result is None:
            self.stop(grace_s=30.0)

    # -- the API ----------------------------------------------------------
    def complete(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        timeout_s: float = 300.0,
    ) -> Completion:
        """One greedy completion of a token-id prompt. Never raises for an HTTP
        or connection failure: that is a :class:`Completion` that is not ok."""
        body = self._completion_body(prompt, max_tokens, ignore_eos, stream=False)
        start = time.monotonic()
        try:
            status, payload = self._request("POST", "/v1/completions", body, timeout_s)
        except OSError as exc:
            return Completion(0, [], error=repr(exc), seconds=time.monotonic() - start)
        seconds = time.monotonic() - start
        if status != 200:
            return Completion(
                status, [], error=payload[:500].decode(errors="replace"), seconds=seconds
            )
        try:
            data = json.loads(payload)
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            return Completion(
                status,
                list(choice.get("token_ids") or []),
                prompt_tokens=usage.get("prompt_tokens"),
                cached_tokens=details.get("cached_tokens"),
                seconds=seconds,
            )
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Completion(status, [], error=f"bad response {exc!r}", seconds=seconds)

    def complete_all(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        concurrent: bool = True,
        timeout_s: float = 600.0,
    ) -> list[Completion]:
        """Complete every prompt, all at once (``concurrent``) or one by one;
        results in prompt order."""
        if not concurrent:
            return [
                self.complete(p, max_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s)
                for p in prompts
            ]
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            futures = [
                pool.submit(
                    self.complete, p, max_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s
                )
                for p in prompts
            ]
            return [f.result() for f in futures]

    def stream(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool = True,
        timeout_s: float = 300.0,
    ) -> StreamedCompletion:
        """A streamed greedy completion, timing the first token (TTFT)."""
        body = self._completion_body(prompt, max_tokens, ignore_eos, stream=True)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        start = time.monotonic()
        tokens: list[int] = []
        ttft = -1.0
        try:
            conn.request(
                "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                error = resp.read()[:500].decode(errors="replace")
                return StreamedCompletion(resp.status, [], -1.0, time.monotonic() - start, error)
            for chunk in completion_chunks(resp):
                ids = chunk_token_ids(chunk)
                if ids and ttft < 0:
                    ttft = time.monotonic() - start
                tokens.extend(ids)
            return StreamedCompletion(resp.status, tokens, ttft, time.monotonic() - start)
        except (OSError, ValueError) as exc:
            return StreamedCompletion(0, tokens, ttft, time.monotonic() - start, repr(exc))
        finally:
            conn.close()

    def reset_prefix_cache(self, retry_s: float = 10.0) -> bool:
        """``POST /reset_prefix_cache``; vLLM refuses while blocks are held, so
        retry for ``retry_s``. True when the engine says it reset."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                status, payload = self._request("POST", "/reset_prefix_cache", b"", 30.0)
                ok = status == 200 and bool(json.loads(payload or b"{}").get("success"))
            except (OSError, ValueError):
                ok = False
            if ok or time.monotonic() >= deadline:
                return ok
            time.sleep(0.5)

    # -- the log ----------------------------------------------------------
    def log_text(self, before_stop: bool = False) -> str:
        """The server's log; with ``before_stop``, only what it wrote before the
        stop signal (shutdown noise is not an error signature)."""
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        if before_stop and self._log_offset_at_stop is not None:
            data = data[: self._log_offset_at_stop]
        return data.decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- plumbing ---------------------------------------------------------
    def _completion_body(
        self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool, stream: bool
    ) -> bytes:
        body: dict[str, object] = {
            "model": SERVED_MODEL_NAME,
            "prompt": [int(t) for t in prompt],
            "max_tokens": int(max_tokens),
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": bool(ignore_eos),
        }
        if stream:
            body["stream"] = True
        return json.dumps(body).encode()

    def _request(
        self, method: str, path: str, body: bytes | None = None, timeout_s: float = 30.0
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_stats(pgid: int) -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields)`` of every process of process group ``pgid`` (zombies
    too), from /proc/<pid>/stat; ``fields`` start after the parenthesised
    command: state ppid pgrp session tty tpgid flags minflt cminflt majflt
    cmajflt utime stime ..."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            yield int(entry), fields


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every process of process group
    ``pgid`` (a server started in a session of its own: API server, engine core,
    workers)."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in group_stats(pgid) if len(f) > 13)
    return ticks / os.sysconf("SC_CLK_TCK")


def _group_pids(pgid: int) -> tuple[int, ...]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    return tuple(sorted(pid for pid, fields in group_stats(pgid) if fields[0] != "Z"))


def _wait_group_empty(pgid: int, timeout_s: float) -> tuple[int, ...]:
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _group_pids(pgid)
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.2)
