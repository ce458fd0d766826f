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
import json
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_models import case_arguments, prepare
from benchmarks.kvharness.gpu_server import Server, finish_case
from tests.gpu.vllm_e2e.__main__ import provenance

NAME = "e2e-limit"


def kvctl(*args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvctl", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kvctl {' '.join(args)}: {done.stderr.strip() or done.stdout}")
    return json.loads(done.stdout)


def usage() -> int:
    return sum(
        r["charged_bytes"] if r["charged_bytes"] is not None else r["used_bytes"]
        for r in kvctl("list", NAME)
    )


class Peak:
    """The largest usage seen while the block runs (sampled every 0.1 s)."""

    def __enter__(self) -> Peak:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, usage())
            self._stop.wait(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peak = max(self.peak, usage())


def fill(server: Server, tokenizer: str, seed: int, count: int, words: int) -> bool:
    make = prompts.word_maker(tokenizer, seed)
    batch = [prompts.text(make, words) for _ in range(count)]
    return all(r["status"] == 200 for r in server.complete_all(batch, 1, concurrent=True))


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
        "KVCACHED_IPC_NAME": NAME,
        "KVCACHED_LOG_LEVEL": "info",
        # Idle cached blocks are what the limit reclaims: let the fill keep them all.
        "KVCACHED_MAX_CACHED_TOKENS": "-1",
    }
    server = Server(NAME, args.port, str(path), extra, env, out / "limit.log")
    rec: dict[str, Any] = {**provenance(argv, "tests.gpu.vllm_e2e.limit"), "model": args.model}
    checks: dict[str, bool] = {}
    server.start()
    try:
        rec["ready_s"] = server.wait_ready(600)
        checks["server_ready"] = rec["ready_s"] is not None
        if rec["ready_s"] is None:
            raise RuntimeError("the server did not start")
        rec["idle"] = idle = usage()
        checks["fill_ok"] = fill(server, tok, 11, args.fill, args.fill_words)
        rec["filled"] = filled = usage()
        limit = idle + (filled - idle) // 4
        rec["limit"] = limit
        rec["set"] = kvctl("limit", NAME, str(limit), "--wait", "0")
        start, rec["within_s"] = time.monotonic(), None
        while time.monotonic() - start < 30:
            if usage() <= limit:
                rec["within_s"] = round(time.monotonic() - start, 2)
                break
            time.sleep(0.1)
        checks["idle_usage_within_limit_in_30s"] = rec["within_s"] is not None
        with Peak() as peak:
            short = prompts.word_maker(tok, 12)
            replies = server.complete_all([prompts.text(short, 150) for _ in range(100)], 16, True)
            long_ = prompts.word_maker(tok, 13)
            replies += [server.complete(prompts.text(long_, 3000), 16) for _ in range(4)]
        rec["peak_under_limit"] = peak.peak
        checks["every_request_under_the_limit_ok"] = all(
            r["status"] == 200 and r.get("completion_tokens", 0) > 0 for r in replies
        )
        checks["usage_stayed_within_limit"] = peak.peak <= limit
        rec["removed"] = kvctl("limit", NAME, "none", "--wait", "0")
        checks["refill_ok"] = fill(server, tok, 14, args.fill, args.fill_words)
        rec["regrown"] = usage()
        checks["regrew_past_the_limit"] = rec["regrown"] > limit
        checks["alive_after_load"] = server.alive()
    except (Exception, KeyboardInterrupt) as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
    finally:
        rec["exit_s"] = server.stop()
        checks["clean_exit_within_90s"] = rec["exit_s"] is not None
    return finish_case(rec, checks, [server.log], f"{args.model}/limit", out)


if __name__ == "__main__":
    raise SystemExit(main())
