"""The frame of the vLLM and SGLang GPU runners' multi-case runs
(``python -m tests.gpu.vllm_e2e``, ``python -m tests.gpu.sglang_e2e``): the
provenance their summaries open with, the loop over case groups that writes
``OUT/summary.json``, ``OUT/details.json`` and ``OUT/logs.tar.gz`` after each
group (a run cut short keeps what it measured), and the failed checks at the end.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def provenance(argv: list[str], module: str) -> dict[str, Any]:
    """What a summary opens with: the commit, the command (``python -m MODULE
    ARGV``), the device, vLLM's version, and benchmarks/_provenance.py's block."""

    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            return ""

    try:
        import vllm

        version = vllm.__version__
    except Exception:
        version = None
    commit = os.environ.get("KVCACHED_BENCH_COMMIT") or sh(["git", "rev-parse", "HEAD"])
    device = sh(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    block = {  # benchmarks/_provenance.py's block, which tests/test_readme_figures.py reads
        "commit": commit,
        "command": f"python -m {module} " + " ".join(argv),
        "machine": {
            "device": device,
            "host": platform.node(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return {
        "provenance": block,
        "commit": commit,
        "command": f"python -m {module} " + " ".join(argv),
        "device": device,
        "vllm_version": version,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg": os.getloadavg()[0],
    }


def failed_checks(cases: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """Every (case, check) that is not exactly ``True``; a case with no checks
    counts as failed."""
    out = [(case, k) for case, c in cases.items() for k, v in c.items() if v is not True]
    return out + [(case, "(no checks)") for case, c in cases.items() if not c]


def write_outputs(out: Path, summary: dict[str, Any], details: dict[str, Any], logs: str) -> None:
    """``out/summary.json``, ``out/details.json`` and the server logs as ``out/logs.tar.gz``."""
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "details.json").write_text(json.dumps(details, indent=1, default=str) + "\n")
    if Path(logs).is_dir():
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            tar.add(logs, arcname="logs")


def run_groups(
    groups: Iterable[tuple[str, Callable[[], dict[str, dict]]]],
    key: str,
    out: Path,
    summary: dict[str, Any],
    details: dict[str, Any],
    logs: str,
    *,
    suffix: str = "",
    timings: dict[str, float] | None = None,
) -> int:
    """Run each ``(label, group)``: its checks by case go into ``summary["cases"]``
    (each case name with ``suffix``), a JSON line ``{key: label, "s": ..., "checks":
    ...}`` is printed and the outputs are written; ``timings`` (if given) gets each
    group's seconds. Then the failed checks are printed; 1 if any, else 0."""
    for label, group in groups:
        t = time.time()
        checks = group()
        summary["cases"].update({case + suffix: c for case, c in checks.items()})
        seconds = round(time.time() - t, 1)
        if timings is not None:
            timings[label] = seconds
        print(json.dumps({key: label, "s": seconds, "checks": checks}), flush=True)
        write_outputs(out, summary, details, logs)
    failed = failed_checks(summary["cases"])
    print(json.dumps({"failed_checks": failed}), flush=True)
    return 1 if failed else 0
