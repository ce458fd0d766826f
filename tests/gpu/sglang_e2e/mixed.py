"""vLLM and SGLang in one budget (``--cases mixed``): one vLLM 0.26 and one SGLang
0.5.17 server on the same GPU, both with kvcached, one ledger.

Needs both bundles on the machine: gpu-vllm's in ``/tmp/site`` (its install.sh,
one device call) and gpu-sglang's in ``/tmp/sgsite`` (the call that runs this,
on the same warm machine). Each server gets its own site on ``PYTHONPATH``.
Checks: ``kvctl list`` shows both instances with their engine named; vLLM grows
past half the memory free at the start while SGLang idles, its prefix-cache
reset gives it back, then SGLang grows past the same static half while vLLM
idles; both loaded at once with every request answered; both alive, a clean
exit, no traceback or kvcached failure in either log, kvcached active in both.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.kvharness.gpu_models import MODELS
from benchmarks.kvharness.gpu_server import Server, log_findings, log_verdicts
from tests.gpu.e2e_cases import (
    charged,
    headroom,
    kvctl,
    load_at_once,
    load_until,
    ok_replies,
    servers_ready,
)
from tests.gpu.sglang_e2e import checks as ck

VLLM_SITE = Path("/tmp/site")


def vllm_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` and what gpu-vllm's vLLM 0.26 needs to run from its own site
    (gpu-vllm's env.sh), beside gpu-sglang's on ``PYTHONPATH``."""
    return {
        **env,
        "PYTHONPATH": str(VLLM_SITE),
        "PATH": f"{VLLM_SITE}/bin:{os.environ.get('PATH', '')}",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }


def vllm_server(args: argparse.Namespace, path: Path, env: dict[str, str]) -> Server:
    """gpu-vllm's vLLM 0.26 with kvcached, on its own site."""
    env = {**vllm_env(env), "KVCACHED_IPC_NAME": "e2e-mixed-vllm"}
    extra = ["--max-model-len", str(MODELS[args.model]["max_model_len"]), "--seed", "0"]
    if not args.graphs:
        extra.append("--enforce-eager")
    return Server(env["KVCACHED_IPC_NAME"], args.port + 30, str(path), extra, env,
                  Path(args.logs) / "e2e-mixed-vllm.log")  # fmt: skip


def mixed_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    from tests.gpu.sglang_e2e.__main__ import findings, new_server, running

    case = f"mixed-vllm-0.26+sglang-0.5.17-{args.model}"
    if not (VLLM_SITE / "vllm").is_dir():
        details["mixed"] = {"error": f"no vLLM in {VLLM_SITE}: run gpu-vllm's install.sh first"}
        return {case: {"vllm_bundle_installed": False}}
    tok = MODELS[args.model]["tokenizer"]
    env = {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_GPU_UTILIZATION": args.utilization,
        "KVCACHED_MAX_CACHED_TOKENS": "-1",
        "KVCACHED_LOG_LEVEL": "info",
    }
    sg = new_server(args, path, "e2e-mixed-sglang", args.port + 31, env, args.kv_fraction)
    vl = vllm_server(args, path, env)
    servers = {"vllm": vl, "sglang": sg}
    rec: dict[str, Any] = {}
    c: dict[str, bool] = {"vllm_bundle_installed": True}
    with running(servers, rec, c):
        servers_ready(servers, args.ready_s, rec, c)
        rec["list"] = kvctl("list")
        c["kvctl_lists_both_with_engine"] = ck.engines_listed(
            rec["list"], {vl.name: "vllm", sg.name: "sglang"}
        )
        names = {vl.name, sg.name}
        rec["free_start"] = free0 = headroom(names)
        for key, seed in (("vllm", 21), ("sglang", 22)):  # each grows while the other idles
            s = servers[key]
            idle = charged(s.name)
            ok, peak = load_until(s, s.name, tok, seed, idle + free0 // 2, args.words)
            rec[f"{key}_idle"], rec[f"{key}_peak"] = idle, peak
            c[f"{key}_load_ok"] = ok
            c[f"{key}_grows_past_a_static_half"] = peak - idle > free0 / 2
            rec[f"{key}_reset"] = s.reset_prefix_cache()
            time.sleep(2)
            rec[f"{key}_after_reset"] = after = charged(s.name)
            c[f"{key}_reset_gives_back_over_half"] = peak - after > (peak - idle) / 2
        results = load_at_once(servers, tok, args.words, 23)
        c["both_at_once_every_request_ok"] = all(ok_replies(r) for r in results.values())
        c["alive_after_load"] = all(s.alive() for s in servers.values())
    found = {"sglang": findings(sg, True), "vllm": log_findings(vl.log, True)}
    c.update(log_verdicts(found.values()))
    details["mixed"] = {**rec, "log": found}
    return {case: c}
