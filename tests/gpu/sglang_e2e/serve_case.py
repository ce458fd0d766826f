"""``kvcached serve`` with an SGLang model (``--cases serve``): an ``engine: sglang``
entry with kvcached and the ``kv`` sleep level behind serve's router, and beside
it an ``engine: vllm`` entry of the same shape when gpu-vllm's bundle is on the
machine (``/tmp/site``, installed by the call before, as for ``mixed``).

Steps: serve starts the engines (SGLang with the cases' own arguments plus
``--enable-metrics``, so serve's engine-activity watch reads SGLang's gauges);
``kvctl list`` shows each instance with its engine; per model a greedy
completion and a concurrent fill go through the router (its charge grows) and
the engine's own ``/metrics`` reads as serve's table of engine kinds expects;
``idle_after`` seconds after the last request the sleep policy puts each model
to sleep and the ledger charges it 0 bytes; the next request wakes it and
answers the same tokens; serve stops on SIGINT within 90 s and leaves no engine
process and no GPU process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_models import MODELS
from benchmarks.kvharness.gpu_server import Server, get, gpu_pids, group_alive, log_findings
from kvcached.serve.engines import ENGINE_KINDS, read_activity, read_gauges
from tests.gpu.e2e_cases import charged, kvctl
from tests.gpu.sglang_e2e import checks as ck
from tests.integration.serve.serve_process import http_get, start_serve

SERVE_NAME = "e2e-serve-sglang"
VLLM_NAME = "e2e-serve-vllm"
#: Each model's engine kind (serve's engine table, ``kvctl list``'s engine column).
ENGINES = {SERVE_NAME: "sglang", VLLM_NAME: "vllm"}
#: Seconds without a request before serve's policy puts a model to sleep.
IDLE_AFTER_S = 8.0
#: Words of the probe prompt and of each of the fill's prompts.
PROBE_WORDS, FILL_WORDS, FILL_COUNT = 64, 1500, 16


def serve_config(
    args: argparse.Namespace,
    path: Path,
    port: int,
    engine_ports: dict[str, int],
    state_dir: Path,
    vllm_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The case's serve config: the SGLang model, kvcached on, ``kv`` sleep; with
    ``vllm_env`` (gpu-vllm's site) a vLLM model the same way beside it."""
    env = {"KVCACHED_LOG_LEVEL": "info", "KVCACHED_MAX_CACHED_TOKENS": "-1"}
    if vllm_env is not None:  # two engines share the card: each a small budget, as in mixed
        env["KVCACHED_GPU_UTILIZATION"] = args.utilization

    def entry(name: str, engine: str, engine_args: list[str], more_env: dict) -> dict[str, Any]:
        return {
            "name": name,
            "engine": engine,
            "model": str(path),
            "port": engine_ports[name],
            "args": engine_args,
            "env": {**more_env, **env},
            "sleep": {"level": "kv", "idle_after": IDLE_AFTER_S},
            "startup_timeout": args.ready_s,
            "wake_timeout": 120,
            "stop_timeout": 30,
            # a dead engine is a finding, not something a restart should hide
            "restart": {"policy": "never"},
        }

    sglang = ck.engine_args(
        context_length=MODELS[args.model]["max_model_len"],
        mem_fraction=args.kv_fraction,
        max_running=args.max_running,
        graphs=args.graphs,
        extra=("--enable-metrics",),
    )
    models = [entry(SERVE_NAME, "sglang", sglang, {})]
    if vllm_env is not None:
        vllm = ["--max-model-len", str(MODELS[args.model]["max_model_len"]), "--seed", "0"]
        vllm += [] if args.graphs else ["--enforce-eager"]
        models.append(entry(VLLM_NAME, "vllm", vllm, vllm_env))
    return {
        "port": port,
        "state_dir": str(state_dir),
        "idle_check_s": 0.2,
        "on_model_failure": "keep-serving",
        "models": models,
    }


def engine_reading(text: str, engine: str = "sglang") -> dict[str, Any]:
    """What serve reads from an engine's ``/metrics``: every gauge and counter of
    its row of serve's engine table present, and the (busy, requests) reading."""
    kind = ENGINE_KINDS[engine]
    names = (*kind.busy_gauges, *kind.request_counters)
    seen = read_gauges(text, names)
    return {"present": {n: n in seen for n in names}, "reading": read_activity(text, kind)}


def serve_checks(rec: dict[str, Any], name: str = SERVE_NAME) -> dict[str, bool]:
    """Model ``name``'s verdicts from the case's record (no GPU needed: tested on
    records): the serve-wide entries and ``rec["models"][name]``'s."""
    engine = ENGINES[name]
    m = (rec.get("models") or {}).get(name) or {}
    first, woken = m.get("first") or {}, m.get("woken") or {}
    reading = m.get("metrics") or {}
    return {
        "serve_ready": rec.get("ready_s") is not None,
        f"kvctl_lists_it_as_{engine}": ck.engines_listed(rec.get("list") or [], {name: engine}),
        "first_request_tokens": first.get("status") == 200 and bool(first.get("tokens")),
        "fill_every_request_ok": bool(m.get("fill_ok")),
        "grew_under_load": (m.get("charged_loaded") or 0) > 0,
        "engine_metrics_read": bool(reading.get("present"))
        and all(reading["present"].values())
        and reading.get("reading") is not None,
        "slept_when_idle": m.get("slept_after_s") is not None,
        "sleep_holds_0_bytes": m.get("charged_asleep") == 0,
        "wake_on_request_same_tokens": woken.get("status") == 200
        and woken.get("tokens") == first.get("tokens")
        and bool(first.get("tokens")),
        "ready_after_wake": m.get("state_after_wake") == "ready",
        "clean_exit_within_90s": rec.get("exit_s") is not None and rec.get("exit_code") == 0,
        "no_engine_process_left": rec.get("engine_left") is False,
        "no_gpu_process_left": bool(rec.get("gpu_pids_loaded")) and rec.get("gpu_left") == [],
    }


def _state(port: int, name: str) -> dict[str, Any]:
    status, doc = http_get(port, f"/v1/models/{name}/state", timeout_s=10)
    return doc if status == 200 and isinstance(doc, dict) else {}


def _wait_ready(proc: subprocess.Popen, port: int, limit_s: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit_s and proc.poll() is None:
        with contextlib.suppress(Exception):
            if get(f"http://127.0.0.1:{port}/ready", 5)[0] == 200:
                return round(time.monotonic() - began, 1)
        time.sleep(1.0)
    return None


def _wait_state(port: int, name: str, want: str, limit_s: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        with contextlib.suppress(Exception):
            if _state(port, name).get("state") == want:
                return round(time.monotonic() - began, 1)
        time.sleep(0.2)
    return None


def _steps(port: int, engine_ports: dict[str, int], rec: dict[str, Any], tok: str) -> None:
    rec["list"] = kvctl("list")
    make = prompts.word_maker(tok, 31)
    probe = prompts.text(make, PROBE_WORDS)
    models: dict[str, dict[str, Any]] = rec.setdefault("models", {})
    routers = {name: Server(name, port, "", [], {}, Path(os.devnull)) for name in engine_ports}
    for name, engine_port in engine_ports.items():
        router = routers[name]
        m = models[name] = {"first": router.complete(probe, 16)}
        fill = [prompts.text(make, FILL_WORDS) for _ in range(FILL_COUNT)]
        replies = router.complete_all(fill, 32, concurrent=True)
        m["fill_ok"] = all(r["status"] == 200 and r["completion_tokens"] > 0 for r in replies)
        m["charged_loaded"] = charged(name)
        status, body = get(f"http://127.0.0.1:{engine_port}/metrics", 10)
        m["metrics"] = (
            engine_reading(body.decode(errors="replace"), ENGINES[name]) if status == 200 else {}
        )
    rec["gpu_pids_loaded"] = sorted(gpu_pids())
    for name, m in models.items():
        m["slept_after_s"] = _wait_state(port, name, "sleeping", IDLE_AFTER_S + 60)
    time.sleep(1.0)
    for name, m in models.items():
        m["charged_asleep"] = charged(name)
    rec["list_asleep"] = kvctl("list")
    for name, m in models.items():
        m["woken"] = routers[name].complete(probe, 16)
        m["state_after_wake"] = _state(port, name).get("state")


def _keep_log(state_dir: Path, logs: Path, name: str) -> Path:
    """A second name for an engine's log: serve removes a model's log on a clean stop."""
    src, kept = state_dir / f"{name}.log", logs / f"{name}.log"
    with contextlib.suppress(OSError):
        kept.unlink()
    with contextlib.suppress(OSError):
        os.link(src, kept)
    return kept


def _stop(proc: subprocess.Popen, engine_pids: list[int], rec: dict[str, Any]) -> None:
    began = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        rec["exit_code"] = proc.wait(90)
        rec["exit_s"] = round(time.monotonic() - began, 1)
    except subprocess.TimeoutExpired:
        rec["exit_s"] = None
        for pgid in (proc.pid, *engine_pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    rec["engine_left"] = any(group_alive(p) for p in engine_pids)
    rec["gpu_left"] = sorted(gpu_pids() & set(rec.get("gpu_pids_loaded") or ()))


def serve_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    from tests.gpu.sglang_e2e.__main__ import text_of
    from tests.gpu.sglang_e2e.mixed import VLLM_SITE, vllm_env

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    state_dir = logs / "serve-state"
    port = args.port + 40
    with_vllm = (VLLM_SITE / "vllm").is_dir()
    names = [SERVE_NAME, VLLM_NAME] if with_vllm else [SERVE_NAME]
    engine_ports = {name: args.port + 41 + i for i, name in enumerate(names)}
    cfg = serve_config(args, path, port, engine_ports, state_dir,
                       vllm_env({}) if with_vllm else None)  # fmt: skip
    cfg_path = logs / "serve.yaml"  # JSON is YAML
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    rec: dict[str, Any] = {"with_vllm": with_vllm}
    proc = start_serve(cfg_path, env, logs / "serve.log")
    engine_pids: list[int] = []
    try:
        rec["ready_s"] = _wait_ready(proc, port, args.ready_s + 30)
        if rec["ready_s"] is None:
            raise RuntimeError("kvcached serve did not become ready")
        engine_pids = [int(_state(port, n).get("pid") or 0) for n in names]
        _steps(port, engine_ports, rec, MODELS[args.model]["tokenizer"])
    except Exception as exc:  # recorded: the checks not reached fail
        rec["error"] = repr(exc)
    finally:
        kept = {n: _keep_log(state_dir, logs, n) for n in names}
        cuts = {n: (p.stat().st_size if p.exists() else 0) for n, p in kept.items()}
        _stop(proc, [p for p in engine_pids if p], rec)
    out: dict[str, dict] = {}
    found: dict[str, Any] = {}
    for name in names:
        c = serve_checks(rec, name)
        if "error" in rec:
            c["no_error"] = False
        if name == VLLM_NAME:  # vLLM's log has its own shutdown mark
            found[name] = log_findings(kept[name], True)
        else:
            text = text_of(kept[name])
            found[name] = ck.log_findings(text[: cuts[name]], True, shutdown=text[cuts[name] :])
        f = found[name]
        c["no_traceback_cuda_error_or_patch_failure"] = (
            f["no_traceback_or_cuda_error"] and not f["bad"]
        )
        c["kvcached_active"] = f["kvcached_active"]
        key = "serve" if name == SERVE_NAME else "serve-vllm-0.26-beside"
        out[f"sglang-{args.model}/{key}"] = c
    details["serve"] = {**rec, "log": found}
    return out
