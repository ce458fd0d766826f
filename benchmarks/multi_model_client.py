"""The multi-model benchmark's client: streamed requests, the samplers of KV
memory and engine queues, one trace replayed against a configuration's
targets (``multi_model.py`` starts the servers, ``multi_model_stats.py``
sums up)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvharness.vllm_server import (
    SERVED_MODEL_NAME,
    ServerError,
    chunk_token_ids,
    completion_chunks,
)
from kvharness.vllm_server import group_cpu_s as process_group_cpu_s
from multi_model_trace import prompt_tokens


@dataclass(frozen=True)
class Target:
    """Where one model's requests go and where its engine is watched."""

    model: str  #: the request body's ``model`` (the served name)
    instance: str  #: its kvcached instance name (``kvctl list``), and its key in samples
    port: int  #: requests go here: the engine, or a router in front of it
    metrics_port: int  #: the engine's own ``/metrics``
    pgid: int  #: the engine's process group (CPU seconds); 0: not known


# -- requests ---------------------------------------------------------------------------------
def send(
    port: int,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 600.0,
    model: str = SERVED_MODEL_NAME,
    deadline: float | None = None,
) -> dict[str, Any]:
    """One streamed greedy completion: TTFT, end-to-end, the engine's queue
    time, output tokens. Never raises for an HTTP or connection failure.

    ``deadline`` (``time.monotonic()``): the request is cut there (the
    connection closed, so vLLM aborts it) and marked ``cut``; one with no
    first token by then has ``ttft_s`` None and ``ttft_censored_s``, the time
    it had waited, a lower bound of its TTFT."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    out: dict[str, Any] = {
        "ok": False,
        "ttft_s": None,
        "e2e_s": None,
        "queue_s": None,
        "tokens": 0,
        "error": None,
    }
    start = time.monotonic()
    if deadline is not None:
        # A socket read blocks at most until the deadline; a waiting request sends nothing.
        timeout_s = max(0.5, min(timeout_s, deadline - start))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        sock = conn.sock  # the response reads through it, also after conn lets go of it
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return out

        def lines() -> Iterator[bytes]:
            while True:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        out["cut"] = True
                        return
                    # A timeout bounds one read, not the stream: each read gets what is left.
                    with contextlib.suppress(OSError, AttributeError):
                        sock.settimeout(max(0.05, left))
                raw = resp.readline()
                if not raw:
                    return
                yield raw

        for chunk in completion_chunks(lines()):
            ids = chunk_token_ids(chunk)
            if ids and out["ttft_s"] is None:
                out["ttft_s"] = time.monotonic() - start
            out["tokens"] += len(ids)
            queue_ms = (chunk.get("metrics") or {}).get("queue_time_ms")
            if queue_ms is not None:
                out["queue_s"] = queue_ms / 1e3
        out["e2e_s"] = time.monotonic() - start
        out["ok"] = out["ttft_s"] is not None and out["tokens"] == max_tokens
        if not out["ok"]:
            out["error"] = f"{out['tokens']} of {max_tokens} tokens"
    except (OSError, ValueError) as exc:
        out["error"] = repr(exc)
        if deadline is not None and time.monotonic() >= deadline - 0.01:
            out["cut"] = True
    finally:
        conn.close()
    if out.get("cut"):
        out["e2e_s"] = None
        out["error"] = f"cut at the run's deadline after {out['tokens']} of {max_tokens} tokens"
        if out["ttft_s"] is None:
            out["ttft_censored_s"] = time.monotonic() - start
    return out


# -- sampling ---------------------------------------------------------------------------------
def engine_metrics(port: int) -> dict[str, float]:
    """``kv_cache_usage_perc``, ``num_requests_running``, ``_waiting`` and
    ``num_preemptions_total`` from the server's ``/metrics`` (empty if it does
    not answer)."""
    wanted = (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except OSError:
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name.split(":", 1)[1]] = out.get(name.split(":", 1)[1], 0.0) + float(
                    line.rsplit(" ", 1)[1]
                )
    return out


def _kvctl_json(*args: str) -> Any:
    """``kvctl ARGS --json`` run by kvctl's own code in this process (a new
    interpreter every sample would take CPU from the kvcached servers alone);
    None when it fails."""
    from kvcached.cli import kvctl

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            kvctl.main([*args, "--json"])
        except SystemExit:
            return None
    try:
        return json.loads(buf.getvalue() or "null")
    except ValueError:
        return None


def kvctl_ledger(ledger_dir: Path, instances: list[str]) -> dict[str, Any]:
    """``kvctl gpus --json`` for the GPU (or host device) that ``instances``
    use: its name, the ledger's budget, charges, batched refunds, headroom and
    calibration count, in bytes (empty when not found)."""
    rows = _kvctl_json("gpus", "--ledger-dir", str(ledger_dir)) or []
    for g in rows:
        if set(g.get("instances") or ()) & set(instances):
            out: dict[str, Any] = {
                k: int(g[k])
                for k in ("budget_bytes", "charged_bytes", "released_bytes", "headroom_bytes")
            }
            out["gpu"] = g.get("gpu")
            out["calibration_seq"] = int(g.get("calibration_seq") or 0)
            return out
    return {}


def kvctl_used(ledger_dir: Path, instances: list[str]) -> dict[str, dict[str, int]]:
    """``kvctl list --json`` as ``{instance: {used_bytes, reserved_bytes,
    prefix_cache_bytes, misses, yielded_bytes}}`` for the live ``instances``
    (reserved: idle pre-mapped pages; prefix cache: idle cached blocks; both
    inside used; misses: allocations the budget refused, so far; yielded: idle
    bytes released to neighbours that missed, so far)."""
    rows = _kvctl_json("list", "--ledger-dir", str(ledger_dir)) or []
    return {
        r["name"]: {
            "used_bytes": int(r["used_bytes"]),
            "reserved_bytes": int(r["reserved_bytes"]),
            "prefix_cache_bytes": int(r.get("prefix_cache_bytes") or 0),
            "misses": int(r["misses"]),
            "yielded_bytes": int(r.get("yielded_bytes") or 0),
        }
        for r in rows
        if r.get("name") in instances and r.get("state") != "dead"
    }


class Sampler:
    """Every ``period_s``: per model its KV memory and running / waiting requests."""

    def __init__(
        self,
        config: str,
        targets: list[Target],
        ledger_dir: Path,
        period_s: float,
        static_bytes: int,
    ) -> None:
        self.config, self.targets, self.static_bytes = config, targets, static_bytes
        self.ledger_dir, self.period_s = ledger_dir, period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> Sampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample(self) -> dict[str, Any]:
        t = time.monotonic() - self._t0
        names = [x.instance for x in self.targets]
        kv = kvctl_used(self.ledger_dir, names) if self.config == "kvcached" else {}
        row: dict[str, Any] = {"t": round(t, 2)}
        if self.config == "kvcached":
            row["ledger"] = kvctl_ledger(self.ledger_dir, names)
        for x in self.targets:
            m = engine_metrics(x.metrics_port)
            row[x.instance] = {
                "kv_bytes": None,
                "running": m.get("num_requests_running"),
                "waiting": m.get("num_requests_waiting"),
                "preemptions": m.get("num_preemptions_total"),
            }
            if self.config == "kvcached":
                inst = kv.get(x.instance, {})
                row[x.instance]["kv_bytes"] = inst.get("used_bytes")
                # what of kv_bytes no running request holds: at the knee, a neighbour's miss
                row[x.instance]["reserved_bytes"] = inst.get("reserved_bytes")
                row[x.instance]["prefix_cache_bytes"] = inst.get("prefix_cache_bytes")
                row[x.instance]["misses"] = inst.get("misses")
                row[x.instance]["yielded_bytes"] = inst.get("yielded_bytes")
            elif m.get("kv_cache_usage_perc") is not None:
                row[x.instance]["kv_bytes"] = int(m["kv_cache_usage_perc"] * self.static_bytes)
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period_s)


# -- one run ----------------------------------------------------------------------------------
@dataclass
class Run:
    config: str
    round: int
    peak: float
    trace_seed: int
    loadavg_start: float = 0.0
    loadavg_end: float = 0.0
    wall_s: float = 0.0
    #: CPU seconds the servers' processes (API server, engine core, worker) used
    #: during the run, per model: less sensitive to other work on the machine
    #: than latency.
    cpu_s: list[float] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: seconds after the trace's last arrival that requests were still waited for
    #: (None: until every one ended)
    drain_s: float | None = None


def run_trace(
    config: str,
    rnd: int,
    targets: list[Target],
    trace: dict[str, Any],
    ledger_dir: Path,
    sample_s: float,
    static_bytes: int,
    drain_s: float | None = None,
) -> Run:
    """Replay one trace against ``targets`` (request ``model`` i goes to
    target i) at its times; return every request's record and the samples.
    ``drain_s``: requests still running that long after the trace's last
    arrival are cut (:func:`send`'s ``deadline``)."""
    run = Run(
        config,
        rnd,
        float(trace["spec"]["peak"]),
        int(trace["seed"]),
        loadavg_start=os.getloadavg()[0],
        drain_s=drain_s,
    )
    reqs = trace["requests"]
    prompts = [prompt_tokens(r["prompt_seed"], r["prompt_len"]) for r in reqs]
    results: list[dict[str, Any] | None] = [None] * len(reqs)
    late: list[float] = [0.0] * len(reqs)
    last_t = max((r["t"] for r in reqs), default=0.0)

    def one(i: int, t0: float) -> None:
        r = reqs[i]
        late[i] = time.monotonic() - t0 - r["t"]
        x = targets[r["model"]]
        deadline = None if drain_s is None else t0 + last_t + drain_s
        results[i] = send(x.port, prompts[i], r["max_tokens"], model=x.model, deadline=deadline)

    cpu0 = [process_group_cpu_s(x.pgid) if x.pgid else 0.0 for x in targets]
    with (
        Sampler(config, targets, ledger_dir, sample_s, static_bytes) as sampler,
        ThreadPoolExecutor(max_workers=max(8, len(reqs))) as pool,
    ):
        t0 = time.monotonic()
        for i, r in enumerate(reqs):
            delay = t0 + r["t"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, t0)
        pool.shutdown(wait=True)
        run.wall_s = time.monotonic() - t0
    run.samples = sampler.samples
    run.cpu_s = [
        round(process_group_cpu_s(x.pgid) - c, 3) if x.pgid else 0.0
        for x, c in zip(targets, cpu0, strict=True)
    ]
    run.loadavg_end = os.getloadavg()[0]
    for i, r in enumerate(reqs):
        res = results[i] or {"ok": False, "error": "not run"}
        run.requests.append(
            {"i": i, "model": r["model"], "t": r["t"], "late_s": round(late[i], 4), **res}
        )
    return run


def wait_idle(targets: list[Target], timeout_s: float = 120.0) -> None:
    """Until no engine has a request running or waiting (then 1 s more)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for x in targets:
            m = engine_metrics(x.metrics_port)
            busy += m.get("num_requests_running", 1.0) + m.get("num_requests_waiting", 0.0)
        if busy == 0:
            break
        time.sleep(0.5)
    time.sleep(1.0)


def warm_up(targets: list[Target], prompt_len: int = 200, max_tokens: int = 16) -> None:
    """A few requests per model, so no first-request cost lands in a run."""
    with ThreadPoolExecutor(max_workers=4 * len(targets)) as pool:
        futures = [
            pool.submit(
                send, x.port, prompt_tokens(10_000 + i, prompt_len), max_tokens, model=x.model
            )
            for x in targets
            for i in range(4)
        ]
        failed = [f.result()["error"] for f in futures if not f.result()["ok"]]
    if failed:
        raise ServerError(f"warm-up requests failed: {failed[0]}")
