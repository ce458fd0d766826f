"""``kvcached serve`` with an SGLang model (``--cases serve``): one ``engine: sglang``
entry with kvcached and the ``kv`` sleep level, behind serve's router.

Steps: serve starts the SGLang 0.5.17 engine (the cases' own arguments plus
``--enable-metrics``, so serve's engine-activity watch reads SGLang's gauges);
``kvctl list`` shows the instance with its engine and serve state; a greedy
completion and a concurrent fill go through the router (the instance's charge
grows); SGLang's own ``/metrics`` reads as serve's table of engine kinds expects
(running, waiting and request counters); ``idle_after`` seconds after the last
request the sleep policy puts the model to sleep and the ledger charges the
instance 0 bytes; the next request wakes it and answers the same tokens; serve
stops on SIGINT within 90 s and leaves no engine process and no GPU process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_models import MODELS
from benchmarks.kvharness.gpu_server import Server, get, gpu_pids, group_alive
from kvcached.serve.engines import ENGINE_KINDS, read_activity
from tests.gpu.e2e_cases import charged, kvctl
from tests.gpu.sglang_e2e import checks as ck

SERVE_NAME = "e2e-serve-sglang"
#: Seconds without a request before serve's policy puts the model to sleep.
IDLE_AFTER_S = 8.0
#: Words of the probe prompt and of each of the fill's prompts.
PROBE_WORDS, FILL_WORDS, FILL_COUNT = 64, 1500, 16


def serve_config(
    args: argparse.Namespace, path: Path, port: int, engine_port: int, state_dir: Path
) -> dict[str, Any]:
    """The case's serve config: one SGLang model, kvcached on, ``kv`` sleep."""
    engine = ck.engine_args(
        context_length=MODELS[args.model]["max_model_len"],
        mem_fraction=args.kv_fraction,
        max_running=args.max_running,
        graphs=args.graphs,
        extra=("--enable-metrics",),
    )
    return {
        "port": port,
        "state_dir": str(state_dir),
        "idle_check_s": 0.2,
        "on_model_failure": "keep-serving",
        "models": [
            {
                "name": SERVE_NAME,
                "engine": "sglang",
                "model": str(path),
                "port": engine_port,
                "args": engine,
                "env": {"KVCACHED_LOG_LEVEL": "info", "KVCACHED_MAX_CACHED_TOKENS": "-1"},
                "sleep": {"level": "kv", "idle_after": IDLE_AFTER_S},
                "startup_timeout": args.ready_s,
                "wake_timeout": 120,
                "stop_timeout": 30,
                # a dead engine is a finding, not something a restart should hide
                "restart": {"policy": "never"},
            }
        ],
    }


def engine_reading(text: str) -> dict[str, Any]:
    """What serve reads from SGLang's ``/metrics``: every gauge and counter of the
    ``sglang`` row present, and the (busy, requests) reading."""
    kind = ENGINE_KINDS["sglang"]
    names = (*kind.busy_gauges, *kind.request_counters)
    present = {n: any(ln.startswith((n + "{", n + " ")) for ln in text.splitlines()) for n in names}
    return {"present": present, "reading": read_activity(text, kind)}


def serve_checks(rec: dict[str, Any]) -> dict[str, bool]:
    """The case's verdicts from its record (no GPU needed: tested on records)."""
    first, woken = rec.get("first") or {}, rec.get("woken") or {}
    reading = rec.get("metrics") or {}
    return {
        "serve_ready": rec.get("ready_s") is not None,
        "kvctl_lists_it_as_sglang": ck.engines_listed(
            rec.get("list") or [], {SERVE_NAME: "sglang"}
        ),
        "first_request_tokens": first.get("status") == 200 and bool(first.get("tokens")),
        "fill_every_request_ok": bool(rec.get("fill_ok")),
        "grew_under_load": (rec.get("charged_loaded") or 0) > 0,
        "engine_metrics_read": bool(reading.get("present"))
        and all(reading["present"].values())
        and reading.get("reading") is not None,
        "slept_when_idle": rec.get("slept_after_s") is not None,
        "sleep_holds_0_bytes": rec.get("charged_asleep") == 0,
        "wake_on_request_same_tokens": woken.get("status") == 200
        and woken.get("tokens") == first.get("tokens")
        and bool(first.get("tokens")),
        "ready_after_wake": rec.get("state_after_wake") == "ready",
        "clean_exit_within_90s": rec.get("exit_s") is not None and rec.get("exit_code") == 0,
        "no_engine_process_left": rec.get("engine_left") is False,
        "no_gpu_process_left": bool(rec.get("gpu_pids_loaded")) and rec.get("gpu_left") == [],
    }


def _state(port: int) -> dict[str, Any]:
    status, body = get(f"http://127.0.0.1:{port}/v1/models/{SERVE_NAME}/state", 10)
    return json.loads(body) if status == 200 else {}


def _wait_ready(proc: subprocess.Popen, port: int, limit_s: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit_s and proc.poll() is None:
        with contextlib.suppress(Exception):
            if get(f"http://127.0.0.1:{port}/ready", 5)[0] == 200:
                return round(time.monotonic() - began, 1)
        time.sleep(1.0)
    return None


def _wait_state(port: int, want: str, limit_s: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        with contextlib.suppress(Exception):
            if _state(port).get("state") == want:
                return round(time.monotonic() - began, 1)
        time.sleep(0.2)
    return None


def _steps(router: Server, port: int, engine_port: int, rec: dict[str, Any], tok: str) -> None:
    rec["list"] = kvctl("list")
    make = prompts.word_maker(tok, 31)
    probe = prompts.text(make, PROBE_WORDS)
    rec["first"] = router.complete(probe, 16)
    fill = [prompts.text(make, FILL_WORDS) for _ in range(FILL_COUNT)]
    replies = router.complete_all(fill, 32, concurrent=True)
    rec["gpu_pids_loaded"] = sorted(gpu_pids())
    rec["fill_ok"] = all(r["status"] == 200 and r["completion_tokens"] > 0 for r in replies)
    rec["charged_loaded"] = charged(SERVE_NAME)
    status, body = get(f"http://127.0.0.1:{engine_port}/metrics", 10)
    rec["metrics"] = engine_reading(body.decode(errors="replace")) if status == 200 else {}
    rec["slept_after_s"] = _wait_state(port, "sleeping", IDLE_AFTER_S + 60)
    time.sleep(1.0)
    rec["charged_asleep"] = charged(SERVE_NAME)
    rec["list_asleep"] = kvctl("list")
    rec["woken"] = router.complete(probe, 16)
    rec["state_after_wake"] = _state(port).get("state")


def _keep_log(state_dir: Path, logs: Path) -> Path:
    """A second name for the engine's log: serve removes a model's log on a clean stop."""
    src, kept = state_dir / f"{SERVE_NAME}.log", logs / f"{SERVE_NAME}.log"
    with contextlib.suppress(OSError):
        kept.unlink()
    with contextlib.suppress(OSError):
        os.link(src, kept)
    return kept


def serve_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    from tests.gpu.sglang_e2e.__main__ import text_of

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    state_dir = logs / "serve-state"
    port, engine_port = args.port + 40, args.port + 41
    cfg_path = logs / "serve.yaml"  # JSON is YAML
    cfg_path.write_text(json.dumps(serve_config(args, path, port, engine_port, state_dir)))
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    rec: dict[str, Any] = {}
    with open(logs / "serve.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvcached", "serve", str(cfg_path)],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    engine_pid = 0
    try:
        rec["ready_s"] = _wait_ready(proc, port, args.ready_s + 30)
        if rec["ready_s"] is None:
            raise RuntimeError("kvcached serve did not become ready")
        engine_pid = int(_state(port).get("pid") or 0)
        router = Server(SERVE_NAME, port, "", [], {}, logs / "unused.log")
        _steps(router, port, engine_port, rec, MODELS[args.model]["tokenizer"])
    except Exception as exc:  # recorded: the checks not reached fail
        rec["error"] = repr(exc)
    finally:
        log = _keep_log(state_dir, logs)
        cut = log.stat().st_size if log.exists() else 0
        began = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            rec["exit_code"] = proc.wait(90)
            rec["exit_s"] = round(time.monotonic() - began, 1)
        except subprocess.TimeoutExpired:
            rec["exit_s"] = None
            for pgid in (proc.pid, engine_pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if pgid:
                        os.killpg(pgid, signal.SIGKILL)
        rec["engine_left"] = bool(engine_pid) and group_alive(engine_pid)
        rec["gpu_left"] = sorted(gpu_pids() & set(rec.get("gpu_pids_loaded") or ()))
    c = serve_checks(rec)
    if "error" in rec:
        c["no_error"] = False
    text = text_of(log)
    found = ck.log_findings(text[:cut], True, shutdown=text[cut:])
    c["no_traceback_cuda_error_or_patch_failure"] = (
        found["no_traceback_or_cuda_error"] and not found["bad"]
    )
    c["kvcached_active"] = found["kvcached_active"]
    details["serve"] = {**rec, "log": found}
    return {f"sglang-{args.model}/serve": c}
