"""The plan's limit case on a GPU: ``python -m tests.gpu.vllm_e2e.limit --out DIR``.

One kvcached server; a fill of its prefix cache; ``kvctl limit`` to its idle
usage plus a quarter of what the fill added; within 30 s, with no requests, its
usage within the limit; 100 short then 4 long requests all succeed while its
usage (the ledger's charge, sampled every 0.1 s) stays within the limit; the
limit removed, a new fill regrows it past the limit. Writes ``DIR/summary.json``
(checks and figures, with provenance) and ``DIR/limit.log``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.kvharness.gpu_models import case_arguments, prepare
from benchmarks.kvharness.gpu_server import Server, finish_case
from tests.gpu.e2e_cases import LIMIT_NAME, limit_steps
from tests.gpu.e2e_run import provenance


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.vllm_e2e.limit", description=__doc__)
    case_arguments(ap, 8300)
    ap.add_argument("--fill", type=int, default=64, help="prompts of the fill")
    ap.add_argument("--fill-words", type=int, default=2000)
    args = ap.parse_args(argv)
    out, tok, path, extra = prepare(args)
    env = {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_IPC_NAME": LIMIT_NAME,
        "KVCACHED_LOG_LEVEL": "info",
        # Idle cached blocks are what the limit reclaims: let the fill keep them all.
        "KVCACHED_MAX_CACHED_TOKENS": "-1",
    }
    server = Server(LIMIT_NAME, args.port, str(path), extra, env, out / "limit.log")
    rec: dict[str, Any] = {**provenance(argv, "tests.gpu.vllm_e2e.limit"), "model": args.model}
    checks: dict[str, bool] = {}
    server.start()
    try:
        rec["ready_s"] = server.wait_ready(600)
        checks["server_ready"] = rec["ready_s"] is not None
        if rec["ready_s"] is None:
            raise RuntimeError("the server did not start")
        limit_steps(server, tok, rec, checks, fill_count=args.fill, fill_words=args.fill_words,
                    long_words=3000)  # fmt: skip
    except (Exception, KeyboardInterrupt) as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
    finally:
        rec["exit_s"] = server.stop()
        checks["clean_exit_within_90s"] = rec["exit_s"] is not None
    return finish_case(rec, checks, [server.log], f"{args.model}/limit", out)


if __name__ == "__main__":
    raise SystemExit(main())
