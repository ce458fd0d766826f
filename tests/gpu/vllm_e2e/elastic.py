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
import threading
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_models import case_arguments, prepare
from benchmarks.kvharness.gpu_server import Server, finish_case
from tests.gpu.vllm_e2e.__main__ import provenance
from tests.gpu.vllm_e2e.limit import kvctl


def charged(name: str) -> int:
    return sum(
        r["charged_bytes"] if r["charged_bytes"] is not None else r["used_bytes"]
        for r in kvctl("list", name)
    )


def headroom(names: set[str]) -> int:
    """The least headroom over the ledgers that hold ``names``' pools."""
    return min(g["headroom_bytes"] for g in kvctl("gpus") if set(g["instances"]) & names)


def load_until(server: Server, name: str, tok: str, seed: int, target: int, words: int,
               batch: int = 16, most: int = 4096) -> tuple[bool, int]:  # fmt: skip
    """Send batches of distinct prompts (1 output token, prefix cache kept)
    until ``name``'s charge passes ``target``; (every request ok, its charge)."""
    make = prompts.word_maker(tok, seed)
    ok, sent = True, 0
    while charged(name) <= target and sent < most:
        replies = server.complete_all(
            [prompts.text(make, words) for _ in range(batch)], 1, concurrent=True
        )
        ok = ok and all(r["status"] == 200 for r in replies)
        sent += batch
    return ok, charged(name)


def probe(server: Server, tok: str) -> list[list[str]]:
    make = prompts.word_maker(tok, 99)
    return [r.get("tokens", []) for r in server.complete_all(
        [prompts.text(make, 40) for _ in range(3)], 16, concurrent=False)]  # fmt: skip


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
    a, b = servers["a"], servers["b"]
    rec: dict[str, Any] = {**provenance(argv, "tests.gpu.vllm_e2e.elastic"), "model": args.model}
    checks: dict[str, bool] = {}
    for s in servers.values():
        s.start()
    try:
        rec["ready_s"] = {k: s.wait_ready(600) for k, s in servers.items()}
        checks["servers_ready"] = None not in rec["ready_s"].values()
        if not checks["servers_ready"]:
            raise RuntimeError("a server did not start")
        before = {k: probe(s, tok) for k, s in servers.items()}
        names = {s.name for s in servers.values()}
        rec["free_start"] = free0 = headroom(names)
        rec["a_idle"] = a_idle = charged(a.name)
        ok, rec["a_peak"] = load_until(a, a.name, tok, 1, a_idle + free0 // 2, args.words)
        rec["free_at_a_peak"] = headroom(names)
        checks["a_load_ok"] = ok
        checks["a_holds_over_half_the_free_memory"] = rec["a_peak"] - a_idle > free0 / 2
        rec["reset_status"] = a.reset_prefix_cache()
        rec["a_after_reset"] = charged(a.name)
        checks["a_reset_releases_over_half_of_its_growth"] = (
            rec["a_peak"] - rec["a_after_reset"] > (rec["a_peak"] - a_idle) / 2
        )
        b_idle = charged(b.name)
        ok, rec["b_peak"] = load_until(
            b, b.name, tok, 2, b_idle + rec["free_at_a_peak"], args.words
        )
        checks["b_load_ok"] = ok
        checks["b_grows_past_what_was_free_at_a_peak"] = (
            rec["b_peak"] - b_idle > rec["free_at_a_peak"]
        )
        b.reset_prefix_cache()
        results: dict[str, list[dict]] = {}

        def both(key: str, seed: int) -> None:
            make = prompts.word_maker(tok, seed)
            results[key] = servers[key].complete_all(
                [prompts.text(make, args.words) for _ in range(32)], 16, concurrent=True
            )

        threads = [threading.Thread(target=both, args=(k, 3 + i)) for i, k in enumerate("ab")]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        checks["both_at_once_every_request_ok"] = all(
            r["status"] == 200 and r.get("completion_tokens", 0) > 0
            for rs in results.values() for r in rs
        )  # fmt: skip
        after = {k: probe(s, tok) for k, s in servers.items()}
        checks["probes_unchanged"] = before == after and all(any(p) for p in before.values())
        checks["alive_after_load"] = all(s.alive() for s in servers.values())
    except (Exception, KeyboardInterrupt) as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
    finally:
        rec["exit_s"] = {k: s.stop() for k, s in servers.items()}
        checks["clean_exit_within_90s"] = None not in rec["exit_s"].values()
    return finish_case(rec, checks, [s.log for s in servers.values()], f"{args.model}/elastic", out)


if __name__ == "__main__":
    raise SystemExit(main())
