"""Run the SGLang GPU cases: ``python -m tests.gpu.sglang_e2e --out DIR [--cases ...]``.

``models``: per model the plan's three servers (kvcached ``kv_c1``, kvcached
``kv_c0``, native); the two kvcached ones start together (co-start: each must be
sized as if alone), native after them; all run the phases gen_seq, gen_conc, a
prefix-cache reset (``/flush_cache``), apc x3 and apc_conc at once.
``limit``: ``kvctl limit`` on one kvcached server (usage within it in 30 s, load
under it, regrowth once lifted). ``elastic``: two kvcached servers, A grows past
half the free memory, its flush releases over half, B then grows past what was
free at A's peak, both loaded at once, probes unchanged. ``serve``: ``kvcached
serve`` with an ``engine: sglang`` model (and a vLLM one beside it where gpu-vllm's
bundle is installed), their ``kv`` sleep and wake (serve_case.py).
``mixed`` (only when
asked): one vLLM 0.26 and one SGLang 0.5.17 server sharing one ledger (mixed.py).
Writes ``DIR/summary.json`` after each case group (a run cut short keeps what it
measured), ``DIR/details.json`` and ``DIR/logs.tar.gz``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.kvharness.gpu_models import MODELS, make_model
from benchmarks.kvharness.gpu_server import Server, log_verdicts
from tests.gpu.e2e_cases import (
    LIMIT_NAME,
    drive_each,
    elastic_steps,
    limit_steps,
    run_phases,
    servers_ready,
    start_kvcached_first,
    without_top,
)
from tests.gpu.e2e_run import provenance as base_provenance
from tests.gpu.e2e_run import run_groups
from tests.gpu.sglang_e2e import checks as ck
from tests.gpu.sglang_e2e.server import SGLangServer

CASES = ("models", "limit", "elastic", "serve")
#: Only when asked: needs gpu-vllm's bundle installed on the same machine (mixed.py).
EXTRA_CASES = ("mixed",)


def text_of(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def findings(server: Server, kvcached: bool) -> dict[str, Any]:
    """:func:`checks.log_findings` of a server's log, split where the harness
    sent its stop signal (the whole log if it never did)."""
    data = server.log.read_bytes() if server.log.exists() else b""
    cut = server.log_bytes_at_stop
    cut = len(data) if cut is None else min(cut, len(data))
    before, after = (data[:cut].decode(errors="replace"), data[cut:].decode(errors="replace"))
    return ck.log_findings(before, kvcached, shutdown=after)


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
    ready = start_kvcached_first(servers, args.ready_s)

    def load(s: SGLangServer) -> dict[str, Any]:
        try:
            return {"phases": run_phases(s, tok)}
        except Exception as exc:  # recorded: its checks fail
            return {"error": repr(exc)}

    results = drive_each(servers, ready, load)
    out: dict[str, dict] = {}
    native = (results.get("native") or {}).get("phases")
    for kind, r in results.items():
        kvcached = kind != "native"
        found = findings(servers[kind], kvcached)
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
            "phases": without_top(r.get("phases") or {}),
        }
    co = [k for k in ("kv_c1", "kv_c0") if k in servers]
    if len(co) == 2:
        tokens = [ck.kv_tokens(text_of(servers[k].log)) for k in co]
        details["co_started_kv_tokens"] = dict(zip(co, tokens, strict=True))
        out[f"sglang-{args.model}-co-started"] = ck.co_start_checks(tokens)
    return out


def limit_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
    tok = MODELS[args.model]["tokenizer"]
    server = new_server(args, path, LIMIT_NAME, args.port + 10,
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
        limit_steps(server, tok, rec, c, fill_count=args.fill, fill_words=args.fill_words,
                    long_words=1500)  # fmt: skip
    except Exception as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
        c["no_error"] = False
    finally:
        rec["exit_s"] = server.stop()
        c["clean_exit_within_90s"] = rec["exit_s"] is not None
    found = findings(server, True)
    c.update(log_verdicts([found]))
    details["limit"] = {**rec, "log": found}
    return {f"sglang-{args.model}/limit": c}


@contextlib.contextmanager
def running(
    servers: dict[str, Server], rec: dict[str, Any], checks: dict[str, bool]
) -> Iterator[None]:
    """Start ``servers`` for the block; an exception in it is recorded
    (``rec["error"]``, the check ``no_error`` fails), not raised; after it every
    server is stopped (``rec["exit_s"]``, the check ``clean_exit_within_90s``)."""
    for s in servers.values():
        s.start()
    try:
        yield
    except Exception as exc:  # recorded: a check not reached fails
        rec["error"] = repr(exc)
        checks["no_error"] = False
    finally:
        rec["exit_s"] = {k: s.stop() for k, s in servers.items()}
        checks["clean_exit_within_90s"] = None not in rec["exit_s"].values()


def elastic_case(args: argparse.Namespace, path: Path, details: dict) -> dict[str, dict]:
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
    with running(servers, rec, c):
        servers_ready(servers, args.ready_s, rec, c)
        # SGLang's flush runs in the scheduler's next round.
        elastic_steps(servers, tok, rec, c, words=args.words, flush_s=2)
    found = {k: findings(s, True) for k, s in servers.items()}
    c.update(log_verdicts(found.values()))
    details["elastic"] = {**rec, "log": found}
    return {f"sglang-{args.model}/elastic": c}


def provenance(argv: list[str]) -> dict[str, Any]:
    rec = base_provenance(argv, "tests.gpu.sglang_e2e")
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
    from tests.gpu.sglang_e2e.serve_case import serve_case

    run = {"models": model_cases, "limit": limit_case, "elastic": elastic_case,
           "serve": serve_case, "mixed": mixed_case}  # fmt: skip
    groups = [(case, lambda case=case: run[case](args, path, details)) for case in args.cases]
    return run_groups(groups, "case", out, summary, details, args.logs,
                      timings=details["timings_s"])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
