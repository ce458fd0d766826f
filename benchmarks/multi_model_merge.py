"""Merge multi-model results that ran different peaks (or other rounds of the same
trace) into one result, so that one plot and one table cover them: the runs are
read back as ``--resume`` reads them (each part's ``-requests.json`` and
``-trace.json`` beside it) and summed up again. A part resumed with ``--resume``
already holds its earlier parts: merge only results of separate sweeps.

    python benchmarks/multi_model_merge.py OUT.json PART.json PART.json [--plot]

writes ``OUT.json``, ``OUT-requests.json`` and ``OUT-trace.json`` (so that the
merged result can itself be resumed), and with ``--plot`` the two PNGs beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _provenance
import multi_model as mm
from multi_model_stats import CONFIGS, peak_key, run_summary, summarize
from multi_model_trace import file_sha256, read_traces

#: setup keys every part must share (the same servers and KV memory)
SAME_SETUP = ("kv_total_bytes", "models", "kv_bytes_per_token", "shape", "utilization")
#: what a run's figures depend on (the library, the client, the servers, the
#: trace): parts of commits that differ only elsewhere (results, docs, how the
#: report is written; the merge sums the runs up again itself) are one result
MEASURING_CODE = (
    "kvcached",
    "benchmarks/multi_model_client.py",
    "benchmarks/multi_model_gpu.py",
    "benchmarks/multi_model_trace.py",
    "benchmarks/kvharness",
)


def merge(parts: list[Path], out: Path) -> dict[str, Any]:
    """One result of ``parts`` written to ``out`` (and its requests and trace
    beside it). Raises ValueError naming the part whose setup, runs or traces
    do not agree with the first's."""
    if len(parts) < 2:
        raise ValueError(f"parts={[str(p) for p in parts]}: merging needs two results or more")
    first = json.loads(parts[0].read_text())
    runs: list[Any] = []
    blocks: list[dict[str, Any]] = []
    traces: dict[float, dict[str, Any]] = {}
    sources = []
    calls: list[dict[str, Any]] = []
    for path in parts:
        result = json.loads(path.read_text())
        for key in SAME_SETUP:
            mine, theirs = result["setup"].get(key), first["setup"].get(key)
            if mine != theirs:
                raise ValueError(f"{path}: setup.{key} is {mine!r}, {parts[0]} has {theirs!r}")
        if (result.get("gpu") or {}).get("name") != (first.get("gpu") or {}).get("name"):
            raise ValueError(f"{path}: another card than {parts[0]}'s")
        prev = mm.read_previous(path)
        for trace in read_traces(prev.trace_path)["traces"]:
            peak = float(trace["spec"]["peak"])
            if peak in traces and traces[peak]["requests"] != trace["requests"]:
                raise ValueError(f"{path}: peak {peak:g} ran another trace than an earlier part's")
            traces.setdefault(peak, trace)
        have = {(r.config, r.round, r.peak) for r in runs}
        for run in prev.runs:
            if (run.config, run.round, run.peak) in have:
                raise ValueError(f"{path}: {run.config} r{run.round} peak {run.peak:g} twice")
        runs += prev.runs
        blocks += [{**b, "part": path.name} for b in prev.blocks]
        calls += [{**c, "part": path.name} for c in prev.calls]
        sources.append(
            {
                "file": path.name,
                "commit": result.get("commit"),
                "date": result.get("date"),
                "command": result.get("command"),
                "peaks": result.get("peaks"),
                "rounds": result.get("rounds"),
                "complete": result.get("complete"),
                "plan": result.get("plan"),
            }
        )
    # a part resumed over sessions may hold calls of other commits than its last
    called = [str(c["commit"]) for c in calls if c.get("commit")]
    if len(set(called)) > 1:
        _provenance.check_same_code(called, MEASURING_CODE)
    peaks = sorted(traces)
    trace_path = out.with_name(out.stem + "-trace.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"seed": read_traces(mm.read_previous(parts[0]).trace_path)["seed"]}
    doc["traces"] = [traces[p] for p in peaks]
    trace_path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    configs = tuple(c for c in CONFIGS if any(r.config == c for r in runs))
    keep = {k: first.get(k) for k in ("benchmark", "device", "machine", "vllm", "gpu", "setup")}
    report: dict[str, Any] = {
        **keep,
        "complete": all(s["complete"] for s in sources),
        "command": " ".join(
            ["python", "benchmarks/multi_model_merge.py", out.name] + [p.name for p in parts]
        ),  # fmt: skip
        "merged_from": sources,
        "commit": sorted({str(s["commit"]) for s in sources}),
        "trace": {
            "file": trace_path.name,
            "seed": doc["seed"],
            "sha256": file_sha256(trace_path),
            "specs": [t["spec"] for t in doc["traces"]],
        },
        "configs": list(configs),
        "drain_s": first.get("drain_s"),
        "peaks": [peak_key(p) for p in peaks],
        "rounds": max(int(s["rounds"] or 1) for s in sources),
        **summarize(runs, peaks, configs),
        "blocks": blocks,
        "runs": [run_summary(r) for r in runs],
        "calls": calls,
        **long_tail_of(out, first),
        "provenance": merged_provenance(parts),
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    mm.write_requests(out, runs)
    return report


def long_tail_of(out: Path, first: dict[str, Any]) -> dict[str, Any]:
    """``long_tail`` and ``models_per_gpu`` as of now: from ``long-tail-gpu.json``
    beside ``out`` where there is one (it may have run after every part did), else
    as the first part recorded them."""
    beside = out.with_name("long-tail-gpu.json")
    if first.get("device") == "gpu" and beside.is_file():
        figures = mm.long_tail_figures(beside)
        return {"long_tail": figures, "models_per_gpu": figures.get("models_per_gpu")}
    return {"long_tail": first.get("long_tail"), "models_per_gpu": first.get("models_per_gpu")}


def merged_provenance(parts: list[Path]) -> dict[str, Any]:
    """The parts' provenance as one block (:func:`_provenance.merged`)."""
    blocks = [json.loads(p.read_text()).get("provenance") for p in parts]
    return _provenance.merged(blocks, [p.name for p in parts], MEASURING_CODE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("parts", type=Path, nargs="+")
    ap.add_argument("--plot", action="store_true", help="write the two PNGs beside OUT")
    args = ap.parse_args(argv)
    report = merge(args.parts, args.out)
    print(f"-> {args.out} (peaks {report['peaks']}, {len(report['runs'])} runs)")
    if args.plot:
        from multi_model_plot import plot_all, tag_of

        for path in plot_all(report, args.out.parent, tag_of(args.out)):
            print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
