"""The plan's elastic case on a GPU: ``python -m tests.gpu.vllm_e2e.elastic --out DIR``.

Two kvcached servers, A and B, on one GPU, no ``--gpu-memory-utilization``.
``KVCACHED_GPU_UTILIZATION`` (``--utilization``) shrinks the ledger's budget so
that "half the free memory" is seconds of prefill, not minutes. Phases:

1. A loads (distinct long prompts, prefix cache kept) until its KV holds more
   than half of the memory free before it grew;
2. A's prefix-cache reset releases more than half of what it grew;
3. B loads until it holds more than was free at A's peak (what a static split
   made at A's peak would have left B);
4. both loaded at once: every request succeeds;
5. three greedy probes per server, sent before phase 1 and after phase 4,
   answer the same tokens.

Writes ``DIR/summary.json`` (one case, ``MODEL/elastic``, with its checks and
figures, and provenance) and the two servers' logs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.kvharness.gpu_models import case_arguments, prepare
from benchmarks.kvharness.gpu_server import Server, finish_case
from tests.gpu.e2e_cases import elastic_steps, servers_ready
from tests.gpu.e2e_run import provenance


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.vllm_e2e.elastic", description=__doc__)
    case_arguments(ap, 8400)
    ap.add_argument("--utilization", default="0.12", help="KVCACHED_GPU_UTILIZATION")
    ap.add_argument("--words", type=int, default=3000, help="words per load prompt")
    args = ap.parse_args(argv)
    out, tok, path, extra = prepare(args)
    servers = {}
    for i, key in enumerate("ab"):
        env = {
            "ENABLE_KVCACHED": "true",
            "KVCACHED_IPC_NAME": f"e2e-elastic-{key}",
            "KVCACHED_GPU_UTILIZATION": args.utilization,
            "KVCACHED_MAX_CACHED_TOKENS": "-1",
            "KVCACHED_LOG_LEVEL": "info",
            "VLLM_SERVER_DEV_MODE": "1",
        }
        servers[key] = Server(env["KVCACHED_IPC_NAME"], args.port + i, str(path), extra, env,
                              out / f"elastic-{key}.log")  # fmt: skip
    rec: dict[str, Any] = {**provenance(argv, "tests.gpu.vllm_e2e.elastic"), "model": args.model}
    checks: dict[str, bool] = {}
    for s in servers.values():
        s.start()
    try:
        servers_ready(servers, 600, rec, checks)
        elastic_steps(servers, tok, rec, checks, words=args.words, flush_s=0)
    except (Exception, KeyboardInterrupt) as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
    finally:
        rec["exit_s"] = {k: s.stop() for k, s in servers.items()}
        checks["clean_exit_within_90s"] = None not in rec["exit_s"].values()
    return finish_case(rec, checks, [s.log for s in servers.values()], f"{args.model}/elastic", out)


if __name__ == "__main__":
    raise SystemExit(main())
