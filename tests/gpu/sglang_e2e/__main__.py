"""Run the SGLang GPU cases: ``python -m tests.gpu.sglang_e2e --out DIR [--cases ...]``.

``models``: per model the plan's three servers (kvcached ``kv_c1``, kvcached
``kv_c0``, native); the two kvcached ones start together (co-start: each must be
sized as if alone), native after them; all run the phases gen_seq, gen_conc, a
prefix-cache reset (``/flush_cache``), apc x3 and apc_conc at once.
``limit``: ``kvctl limit`` on one kvcached server (usage within it in 30 s, load
under it, regrowth once lifted). ``elastic``: two kvcached servers, A grows past
half the free memory, its flush releases over half, B then grows past what was
free at A's peak, both loaded at once, probes unchanged. ``mixed`` (only when
asked): one vLLM 0.26 and one SGLang 0.5.17 server sharing one ledger (mixed.py).
Writes ``DIR/summary.json`` after each case group (a run cut short keeps what it
measured), ``DIR/details.json`` and ``DIR/logs.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.kvharness import gpu_prompts as prompts
from benchmarks.kvharness.gpu_models import MODELS, make_model
from benchmarks.kvharness.gpu_server import gpu_pids
from tests.gpu.sglang_e2e import checks as ck
from tests.gpu.sglang_e2e.server import SGLangServer

CASES = ("models", "limit", "elastic")
#: Only when asked: needs gpu-vllm's bundle installed on the same machine (mixed.py).
EXTRA_CASES = ("mixed",)


def run_phases(server: SGLangServer, tokenizer: str) -> dict[str, Any]:
    gen, apc = prompts.gen_prompts(tokenizer), prompts.apc_prompts(tokenizer)
    out: dict[str, Any] = {}
    out["gen_seq"] = server.complete_all(gen, ck.GEN_TOKENS, concurrent=False)
    out["gen_conc"] = server.complete_all(gen, ck.GEN_TOKENS, concurrent=True)
    out["reset_status"] = server.reset_prefix_cache()
    for i in range(3):
        out[f"apc_{i}"] = server.complete_all(apc, ck.APC_TOKENS, concurrent=False)
    out["apc_conc"] = server.complete_all(apc, ck.APC_TOKENS, concurrent=True)
    return out


def text_of(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def new_server(args: argparse.Namespace, path: Path, name: str, port: int, env: dict[str, str],
               mem_fraction: float) -> SGLangServer:  # fmt: skip
    argv = ck.server_args(
        model=str(path),
        name=name,
        port=port,
        context_length=MODELS[args.model]["max_model_len"],
        mem_fraction=mem_fraction,
        max_running=args.max_running,
        graphs=args.graphs,
    )
    env = {"KVCACHED_LOG_LEVEL": "info", "KVCACHED_IPC_NAME": name, **env}
    return SGLangServer(name, port, argv, env, Path(args.logs) / f"{name}.log")


def model_cases(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    tok = MODELS[args.model]["tokenizer"]
    servers = {
        kind: new_server(
            args,
            path,
            f"sglang-{args.model}-{kind}",
            args.port + i,
            ck.KINDS[kind],
            args.native_fraction if kind == "native" else args.kv_fraction,
        )
        for i, kind in enumerate(k for k in ck.KINDS if k in args.kinds)
    }
    ready: dict[str, float | None] = {}
    for kind, s in servers.items():
        if kind != "native":
            s.start()
    for kind, s in servers.items():
        if kind != "native":
            ready[kind] = s.wait_ready(args.ready_s)
    if "native" in servers:
        servers["native"].start()
        ready["native"] = servers["native"].wait_ready(args.ready_s)
    results: dict[str, dict] = {}

    def drive(kind: str, s: SGLangServer) -> None:
        r: dict[str, Any] = {"ready_s": ready[kind]}
        if r["ready_s"] is not None:
            try:
                r["phases"] = run_phases(s, tok)
            except Exception as exc:  # recorded: its checks fail
                r["error"] = repr(exc)
            r["alive_after_load"] = s.alive()
        pid = s.proc.pid
        r["exit_s"] = s.stop()
        time.sleep(2)
        r["gpu_process_left"] = pid in gpu_pids()
        results[kind] = r

    threads = [threading.Thread(target=drive, args=kv) for kv in servers.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out: dict[str, dict] = {}
    native = (results.get("native") or {}).get("phases")
    for kind, r in results.items():
        kvcached = kind != "native"
        found = ck.log_findings(text_of(servers[kind].log), kvcached)
        c: dict[str, Any] = ck.server_checks(r, found, kvcached)
        figures: dict[str, Any] = {}
        if kvcached:
            if native and r.get("phases"):
                both = ck.native_checks(r["phases"], native)
                figures = {k: both.pop(k) for k in list(both) if k.startswith("_")}
                c.update(both)
            else:  # nothing to compare: those checks fail
                c.update(dict.fromkeys(("gen_seq_tokens_equal_native", "apc_tokens_equal_native",
                                        "top5_logprobs_within_tol", "cached_tokens_equal_native"),
                                       False))  # fmt: skip
        out[f"sglang-{args.model}-{kind}"] = c
        details.setdefault("servers", {})[kind] = {
            **{k: v for k, v in r.items() if k != "phases"},
            "log": found,
            **figures,
            "phases": {
                k: [{kk: vv for kk, vv in x.items() if kk != "top"} for x in v]
                if isinstance(v, list)
                else v
                for k, v in (r.get("phases") or {}).items()
            },
        }
    co = [k for k in ("kv_c1", "kv_c0") if k in servers]
    if len(co) == 2:
        tokens = [ck.kv_tokens(text_of(servers[k].log)) for k in co]
        details["co_started_kv_tokens"] = dict(zip(co, tokens, strict=True))
        out[f"sglang-{args.model}-co-started"] = ck.co_start_checks(tokens)
    return out


def limit_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    from tests.gpu.vllm_e2e.limit import NAME, Peak, fill, kvctl, usage

    tok = MODELS[args.model]["tokenizer"]
    server = new_server(args, path, NAME, args.port + 10,
                        {"ENABLE_KVCACHED": "true", "KVCACHED_MAX_CACHED_TOKENS": "-1"},
                        args.kv_fraction)  # fmt: skip
    rec: dict[str, Any] = {}
    c: dict[str, bool] = {}
    server.start()
    try:
        rec["ready_s"] = server.wait_ready(args.ready_s)
        c["server_ready"] = rec["ready_s"] is not None
        if rec["ready_s"] is None:
            raise RuntimeError("the server did not start")
        rec["idle"] = idle = usage()
        c["fill_ok"] = fill(server, tok, 11, args.fill, args.fill_words)
        rec["filled"] = filled = usage()
        rec["limit"] = limit = idle + (filled - idle) // 4
        rec["set"] = kvctl("limit", NAME, str(limit), "--wait", "0")
        start, rec["within_s"] = time.monotonic(), None
        while time.monotonic() - start < 30:
            if usage() <= limit:
                rec["within_s"] = round(time.monotonic() - start, 2)
                break
            time.sleep(0.1)
        c["idle_usage_within_limit_in_30s"] = rec["within_s"] is not None
        with Peak() as peak:
            short = prompts.word_maker(tok, 12)
            replies = server.complete_all([prompts.text(short, 150) for _ in range(100)], 16, True)
            long_ = prompts.word_maker(tok, 13)
            replies += [server.complete(prompts.text(long_, 1500), 16) for _ in range(4)]
        rec["peak_under_limit"] = peak.peak
        c["every_request_under_the_limit_ok"] = ck.ok_replies(replies)
        c["usage_stayed_within_limit"] = peak.peak <= limit
        rec["removed"] = kvctl("limit", NAME, "none", "--wait", "0")
        c["refill_ok"] = fill(server, tok, 14, args.fill, args.fill_words)
        rec["regrown"] = usage()
        c["regrew_past_the_limit"] = rec["regrown"] > limit
        c["alive_after_load"] = server.alive()
    except Exception as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
        c["no_error"] = False
    finally:
        rec["exit_s"] = server.stop()
        c["clean_exit_within_90s"] = rec["exit_s"] is not None
    found = ck.log_findings(text_of(server.log), True)
    c["no_traceback_cuda_error_or_patch_failure"] = bool(
        found["no_traceback_or_cuda_error"] and not found["bad"]
    )
    c["kvcached_active"] = bool(found["kvcached_active"])
    details["limit"] = {**rec, "log": found}
    return {f"sglang-{args.model}/limit": c}


def elastic_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    from tests.gpu.vllm_e2e.elastic import charged, headroom, load_until, probe

    tok = MODELS[args.model]["tokenizer"]
    env = {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_GPU_UTILIZATION": args.utilization,
        "KVCACHED_MAX_CACHED_TOKENS": "-1",
    }
    a, b = (new_server(args, path, f"e2e-elastic-{k}", args.port + 20 + i, env, args.kv_fraction)
            for i, k in enumerate("ab"))  # fmt: skip
    servers = {"a": a, "b": b}
    rec: dict[str, Any] = {}
    c: dict[str, bool] = {}
    for s in servers.values():
        s.start()
    try:
        rec["ready_s"] = {k: s.wait_ready(args.ready_s) for k, s in servers.items()}
        c["servers_ready"] = None not in rec["ready_s"].values()
        if not c["servers_ready"]:
            raise RuntimeError("a server did not start")
        before = {k: probe(s, tok) for k, s in servers.items()}
        names = {s.name for s in servers.values()}
        rec["free_start"] = free0 = headroom(names)
        rec["a_idle"] = a_idle = charged(a.name)
        ok, rec["a_peak"] = load_until(a, a.name, tok, 1, a_idle + free0 // 2, args.words)
        rec["free_at_a_peak"] = headroom(names)
        c["a_load_ok"] = ok
        c["a_holds_over_half_the_free_memory"] = rec["a_peak"] - a_idle > free0 / 2
        rec["reset_status"] = a.reset_prefix_cache()
        time.sleep(2)  # the flush runs in the scheduler's next round
        rec["a_after_reset"] = charged(a.name)
        c["a_reset_releases_over_half_of_its_growth"] = (
            rec["a_peak"] - rec["a_after_reset"] > (rec["a_peak"] - a_idle) / 2
        )
        b_idle = charged(b.name)
        ok, rec["b_peak"] = load_until(b, b.name, tok, 2, b_idle + rec["free_at_a_peak"],
                                       args.words)  # fmt: skip
        c["b_load_ok"] = ok
        c["b_grows_past_what_was_free_at_a_peak"] = rec["b_peak"] - b_idle > rec["free_at_a_peak"]
        b.reset_prefix_cache()
        results: dict[str, list[dict]] = {}

        def load(key: str, seed: int) -> None:
            make = prompts.word_maker(tok, seed)
            results[key] = servers[key].complete_all(
                [prompts.text(make, args.words) for _ in range(32)], 16, concurrent=True
            )

        threads = [threading.Thread(target=load, args=(k, 3 + i)) for i, k in enumerate("ab")]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        c["both_at_once_every_request_ok"] = all(ck.ok_replies(r) for r in results.values())
        after = {k: probe(s, tok) for k, s in servers.items()}
        c["probes_unchanged"] = before == after and all(any(p) for p in before.values())
        c["alive_after_load"] = all(s.alive() for s in servers.values())
    except Exception as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
        c["no_error"] = False
    finally:
        rec["exit_s"] = {k: s.stop() for k, s in servers.items()}
        c["clean_exit_within_90s"] = None not in rec["exit_s"].values()
    found = {k: ck.log_findings(text_of(s.log), True) for k, s in servers.items()}
    c["no_traceback_cuda_error_or_patch_failure"] = all(
        f["no_traceback_or_cuda_error"] and not f["bad"] for f in found.values()
    )
    c["kvcached_active"] = all(f["kvcached_active"] for f in found.values())
    details["elastic"] = {**rec, "log": found}
    return {f"sglang-{args.model}/elastic": c}


def provenance(argv: list[str]) -> dict[str, Any]:
    from tests.gpu.vllm_e2e.__main__ import provenance as base

    rec = base(argv, "tests.gpu.sglang_e2e")
    rec.pop("vllm_version", None)
    try:
        from importlib import metadata

        rec["sglang_version"] = metadata.version("sglang")
    except Exception:
        rec["sglang_version"] = None
    return rec


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tests.gpu.sglang_e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="folder for summary.json, details.json, logs")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES + EXTRA_CASES)
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--kinds", nargs="+", default=list(ck.KINDS), choices=list(ck.KINDS))
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (default: off)")
    ap.add_argument(
        "--kv-fraction",
        type=float,
        default=0.8,
        help="kvcached servers' --mem-fraction-static (sizes the virtual budget)",
    )
    ap.add_argument(
        "--native-fraction",
        type=float,
        default=0.25,
        help="the native server's --mem-fraction-static (it shares the GPU)",
    )
    ap.add_argument("--max-running", type=int, default=32, help="--max-running-requests")
    ap.add_argument("--utilization", default="0.12", help="elastic: KVCACHED_GPU_UTILIZATION")
    ap.add_argument("--words", type=int, default=1500, help="elastic: words per load prompt")
    ap.add_argument("--fill", type=int, default=64, help="limit: prompts of a fill")
    ap.add_argument("--fill-words", type=int, default=1500, help="limit: words per fill prompt")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument(
        "--ready-s",
        type=float,
        default=300.0,
        help="give up on a server start after this (stay inside one device call)",
    )
    ap.add_argument("--models-dir", default="/tmp/e2e-models")
    ap.add_argument(
        "--make-model",
        default=".gpu/sglang/make_model.py",
        help="the gpu-sglang bundle's make_model.py",
    )
    # Not under OUT: the device brings back 8 files at most (logs.tar.gz holds them).
    ap.add_argument("--logs", default="/tmp/e2e-sglang-logs", help="server logs")
    args = ap.parse_args(argv)  # fmt: skip
    if not 0 < args.kv_fraction < 1 or not 0 < args.native_fraction < 1:
        ap.error("--kv-fraction and --native-fraction: fractions in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {**provenance(argv), "logprob_tol": ck.LOGPROB_TOL, "cases": {}}
    details: dict[str, Any] = {"provenance": summary["provenance"], "timings_s": {}}
    t = time.time()
    path = make_model(args.model, Path(args.models_dir) / args.model, args.make_model)
    details["timings_s"]["make_model"] = round(time.time() - t, 1)
    from tests.gpu.sglang_e2e.mixed import mixed_case

    run = {"models": model_cases, "limit": limit_case, "elastic": elastic_case, "mixed": mixed_case}
    for case in args.cases:
        t = time.time()
        got = run[case](args, path, details)
        summary["cases"].update(got)
        details["timings_s"][case] = round(time.time() - t, 1)
        print(
            json.dumps({"case": case, "s": details["timings_s"][case], "checks": got}), flush=True
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "details.json").write_text(json.dumps(details, indent=1, default=str) + "\n")
        if Path(args.logs).is_dir():
            with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
                tar.add(args.logs, arcname="logs")
    failed = ck.failed_checks(summary["cases"])
    print(json.dumps({"failed_checks": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
