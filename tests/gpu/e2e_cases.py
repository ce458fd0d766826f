"""What the vLLM and SGLang GPU runners (``tests/gpu/vllm_e2e``,
``tests/gpu/sglang_e2e``) do to their servers: the model cases' phases and their
start-then-drive, the limit and elastic cases' steps, and ``kvctl`` for the
ledger's view of each server.

Each runner builds its own servers (vLLM's or SGLang's command line) and keeps
its own checks of logs and replies; a case's steps write their figures into
``rec`` and their checks into ``checks`` in the order the summaries show them.
Needs no GPU to import: the servers and ``kvctl`` run only when called.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_server import Server, gpu_pids

GEN_TOKENS, APC_TOKENS = 64, 32
#: The limit case's one server (``kvctl limit`` names it).
LIMIT_NAME = "e2e-limit"


def run_phases(server: Server, tokenizer: str) -> dict[str, Any]:
    """The model cases' phases: gen_seq, gen_conc, a prefix-cache reset, apc x3, apc_conc."""
    gen, apc = prompts.gen_prompts(tokenizer), prompts.apc_prompts(tokenizer)
    out: dict[str, Any] = {}
    out["gen_seq"] = server.complete_all(gen, GEN_TOKENS, concurrent=False)
    out["gen_conc"] = server.complete_all(gen, GEN_TOKENS, concurrent=True)
    out["reset_status"] = server.reset_prefix_cache()
    for i in range(3):
        out[f"apc_{i}"] = server.complete_all(apc, APC_TOKENS, concurrent=False)
    out["apc_conc"] = server.complete_all(apc, APC_TOKENS, concurrent=True)
    return out


def without_top(phases: dict[str, Any]) -> dict[str, Any]:
    """``phases`` as details.json keeps them: each reply without its top-5 logprobs."""
    return {
        k: [{kk: vv for kk, vv in x.items() if kk != "top"} for x in v]
        if isinstance(v, list)
        else v
        for k, v in phases.items()
    }


def in_threads(target: Callable[..., None], calls: Iterable[tuple]) -> None:
    """``target(*args)`` for every ``args`` of ``calls`` at once; returns when all did."""
    threads = [threading.Thread(target=target, args=args) for args in calls]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def start_kvcached_first(servers: dict[str, Server], ready_s: float) -> dict[str, float | None]:
    """Start the kvcached servers together, then native (kind ``"native"``) alone:
    vLLM's profiler counts memory that others take while it profiles as its own
    (the co-start case shows that), and the model cases are about outputs, not
    startup. Seconds until each was ready (``None``: it was not)."""
    ready: dict[str, float | None] = {}
    for kind, s in servers.items():
        if kind != "native":
            s.start()
    for kind, s in servers.items():
        if kind != "native":
            ready[kind] = s.wait_ready(ready_s)
    if "native" in servers:
        servers["native"].start()
        ready["native"] = servers["native"].wait_ready(ready_s)
    return ready


def drive_each(
    servers: dict[str, Server],
    ready: dict[str, float | None],
    load: Callable[[Server], dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Every ready server at once: ``load(server)`` (its record's entries), whether
    it is alive after, its stop and whether it left a GPU process; by kind."""
    results: dict[str, dict[str, Any]] = {}

    def drive(kind: str, s: Server) -> None:
        r: dict[str, Any] = {"ready_s": ready[kind]}
        if r["ready_s"] is not None:
            r.update(load(s))
            r["alive_after_load"] = s.alive()
        pid = s.proc.pid
        r["exit_s"] = s.stop()
        time.sleep(2)
        r["gpu_process_left"] = pid in gpu_pids()
        results[kind] = r

    in_threads(drive, servers.items())
    return results


def ok_replies(replies: list[dict]) -> bool:
    """Every reply an HTTP 200 with at least one generated token (and some replies)."""
    return bool(replies) and all(
        r.get("status") == 200 and (r.get("completion_tokens") or 0) > 0 for r in replies
    )


def kvctl(*args: str) -> Any:  # noqa: ANN401 - whatever the command's --json prints
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


def charged(name: str) -> int:
    """The ledger's charge of instance ``name`` (its used bytes where no charge is known)."""
    return sum(
        r["charged_bytes"] if r["charged_bytes"] is not None else r["used_bytes"]
        for r in kvctl("list", name)
    )


def headroom(names: set[str]) -> int:
    """The least headroom over the ledgers that hold ``names``' pools."""
    return min(g["headroom_bytes"] for g in kvctl("gpus") if set(g["instances"]) & names)


class Peak:
    """The largest charge of instance ``name`` seen while the block runs (sampled every 0.1 s)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Peak:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, charged(self.name))
            self._stop.wait(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peak = max(self.peak, charged(self.name))


def fill(server: Server, tokenizer: str, seed: int, count: int, words: int) -> bool:
    """``count`` distinct prompts of ``words`` words at once (1 output token); all 200."""
    make = prompts.word_maker(tokenizer, seed)
    batch = [prompts.text(make, words) for _ in range(count)]
    return all(r["status"] == 200 for r in server.complete_all(batch, 1, concurrent=True))


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
    """Three greedy answers of 16 tokens to the same three prompts."""
    make = prompts.word_maker(tok, 99)
    return [r.get("tokens", []) for r in server.complete_all(
        [prompts.text(make, 40) for _ in range(3)], 16, concurrent=False)]  # fmt: skip


def load_at_once(servers: dict[str, Server], tok: str, words: int, seed: int) -> dict[str, list]:
    """32 prompts of ``words`` words (16 output tokens) to every server at once, the
    servers' prompts seeded ``seed``, ``seed + 1`` ...; their replies by key."""
    results: dict[str, list[dict]] = {}

    def load(key: str, seed: int) -> None:
        make = prompts.word_maker(tok, seed)
        results[key] = servers[key].complete_all(
            [prompts.text(make, words) for _ in range(32)], 16, concurrent=True
        )

    in_threads(load, ((k, seed + i) for i, k in enumerate(servers)))
    return results


def servers_ready(servers: dict[str, Server], ready_s: float, rec: dict, checks: dict) -> None:
    """Wait for every (started) server; raises if one did not come up."""
    rec["ready_s"] = {k: s.wait_ready(ready_s) for k, s in servers.items()}
    checks["servers_ready"] = None not in rec["ready_s"].values()
    if not checks["servers_ready"]:
        raise RuntimeError("a server did not start")


def limit_steps(server: Server, tok: str, rec: dict, checks: dict, *, fill_count: int,
                fill_words: int, long_words: int) -> None:  # fmt: skip
    """The limit case on a ready kvcached server: a fill of its prefix cache;
    ``kvctl limit`` to its idle charge plus a quarter of what the fill added;
    within 30 s, with no requests, its charge within the limit; 100 short then 4
    long (``long_words``) requests all succeed while its charge stays within the
    limit; the limit removed, a new fill regrows it past the limit."""
    name = server.name
    rec["idle"] = idle = charged(name)
    checks["fill_ok"] = fill(server, tok, 11, fill_count, fill_words)
    rec["filled"] = filled = charged(name)
    rec["limit"] = limit = idle + (filled - idle) // 4
    rec["set"] = kvctl("limit", name, str(limit), "--wait", "0")
    start, rec["within_s"] = time.monotonic(), None
    while time.monotonic() - start < 30:
        if charged(name) <= limit:
            rec["within_s"] = round(time.monotonic() - start, 2)
            break
        time.sleep(0.1)
    checks["idle_usage_within_limit_in_30s"] = rec["within_s"] is not None
    with Peak(name) as peak:
        short = prompts.word_maker(tok, 12)
        replies = server.complete_all([prompts.text(short, 150) for _ in range(100)], 16, True)
        long_ = prompts.word_maker(tok, 13)
        replies += [server.complete(prompts.text(long_, long_words), 16) for _ in range(4)]
    rec["peak_under_limit"] = peak.peak
    checks["every_request_under_the_limit_ok"] = ok_replies(replies)
    checks["usage_stayed_within_limit"] = peak.peak <= limit
    rec["removed"] = kvctl("limit", name, "none", "--wait", "0")
    checks["refill_ok"] = fill(server, tok, 14, fill_count, fill_words)
    rec["regrown"] = charged(name)
    checks["regrew_past_the_limit"] = rec["regrown"] > limit
    checks["alive_after_load"] = server.alive()


def elastic_steps(servers: dict[str, Server], tok: str, rec: dict, checks: dict, *, words: int,
                  flush_s: float) -> None:  # fmt: skip
    """The elastic case on two ready kvcached servers ``a`` and ``b``: A grows
    past half the free memory, its prefix-cache reset (given ``flush_s`` to take
    effect) releases over half of that growth, B then grows past what was free
    at A's peak, both loaded at once, and three greedy probes per server answer
    the same before and after (each set from an empty prefix cache)."""
    a, b = servers["a"], servers["b"]

    def probes() -> dict[str, list[list[str]]]:
        # Each set from an empty prefix cache: a prompt whose first tokens hit
        # another prompt's cache is prefilled in two parts, and on random weights
        # (near-even logits) that alone can flip a greedy token (the H100's
        # SGLang run, results/h100/sglang-0.5.17/elastic-limit-1).
        out = {}
        for k, s in servers.items():
            s.reset_prefix_cache()
            if flush_s:
                time.sleep(flush_s)
            out[k] = probe(s, tok)
        return out

    rec["probes_before"] = before = probes()
    names = {s.name for s in servers.values()}
    rec["free_start"] = free0 = headroom(names)
    rec["a_idle"] = a_idle = charged(a.name)
    ok, rec["a_peak"] = load_until(a, a.name, tok, 1, a_idle + free0 // 2, words)
    rec["free_at_a_peak"] = headroom(names)
    checks["a_load_ok"] = ok
    checks["a_holds_over_half_the_free_memory"] = rec["a_peak"] - a_idle > free0 / 2
    rec["reset_status"] = a.reset_prefix_cache()
    if flush_s:
        time.sleep(flush_s)
    rec["a_after_reset"] = charged(a.name)
    checks["a_reset_releases_over_half_of_its_growth"] = (
        rec["a_peak"] - rec["a_after_reset"] > (rec["a_peak"] - a_idle) / 2
    )
    b_idle = charged(b.name)
    ok, rec["b_peak"] = load_until(b, b.name, tok, 2, b_idle + rec["free_at_a_peak"], words)
    checks["b_load_ok"] = ok
    checks["b_grows_past_what_was_free_at_a_peak"] = rec["b_peak"] - b_idle > rec["free_at_a_peak"]
    b.reset_prefix_cache()
    results = load_at_once(servers, tok, words, 3)
    checks["both_at_once_every_request_ok"] = all(ok_replies(r) for r in results.values())
    rec["probes_after"] = after = probes()
    checks["probes_unchanged"] = before == after and all(any(p) for p in before.values())
    checks["alive_after_load"] = all(s.alive() for s in servers.values())
