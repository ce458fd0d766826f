"""Where a benchmark result came from: one ``provenance`` block for every result file.

Every benchmark under ``benchmarks/`` calls :func:`start` before it measures and
:func:`write_result` to write its JSON, so every file under ``benchmarks/results/``
says which commit it measured, the command that made it, the machine, and the load
average at the start and the end (timings on a shared 2-core machine mean little
without it). ``tests/test_readme_figures.py`` reads the block: a README figure is
only quoted from a file that has one, and never as current from a file marked stale.

The block::

    "provenance": {
        "commit": "0602e17...",           # git HEAD of the measured tree
        "tree_dirty": false,              # uncommitted changes to tracked files
        "command": "python benchmarks/memory.py --backend host",
        "machine": {"host": ..., "platform": ..., "cpu": ..., "cpus": 2, "python": ...},
        "load_average_start": [1.0, 0.9, 0.8],
        "load_average_end": [1.1, 0.9, 0.8],
        "started_utc": "...", "finished_utc": "...",
        "stale": "why"                    # only once the measured code has changed since
    }

A copy of the tree without its git history (the GPU machine gets one) names its
commit through ``KVCACHED_BENCH_COMMIT``; without either the commit is recorded as
``"unknown: ..."`` and the README check refuses to quote the file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "KVCACHED_BENCH_COMMIT"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> tuple[str, bool | None]:
    """The measured tree's commit and whether tracked files differ from it."""
    named = os.environ.get(COMMIT_ENV, "").strip()
    if named:
        return named, None  # a copy of the tree: its dirtiness is not ours to see
    head = _git("rev-parse", "HEAD")
    if not head:
        return f"unknown: no git checkout at {ROOT}; set {COMMIT_ENV}", None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, (bool(status) if status is not None else None)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine as a reader compares two results: host, OS, CPU, Python, torch."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # never imported here: a benchmark may not need it
    if torch is not None:
        info["torch"] = getattr(torch, "__version__", None)
    return info


def command(argv: list[str] | None = None) -> str:
    """The command line that reproduces the run, from the repository root."""
    script = Path(sys.argv[0])
    try:
        script_text = str(script.resolve().relative_to(ROOT))
    except ValueError:
        script_text = str(script)
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script_text, *args])


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """The block as it stands before measuring (call it first: the load average then)."""
    sha, dirty = commit()
    return {
        "commit": sha,
        "tree_dirty": dirty,
        "command": command(argv),
        "machine": machine(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "started_utc": _now(),
    }


def finish(block: dict[str, Any]) -> dict[str, Any]:
    """The block completed after measuring (a copy; ``block`` is left as it was)."""
    done = dict(block)
    done["machine"] = {**machine(), **block.get("machine", {})}
    done["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    done["finished_utc"] = _now()
    return done


def write_result(path: str | os.PathLike[str], result: dict[str, Any],
                 block: dict[str, Any], indent: int = 2) -> Path:
    """Write ``result`` with its completed provenance block as JSON at ``path``."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict, not {type(result).__name__}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["provenance"] = finish(block)
    out.write_text(json.dumps(result, indent=indent) + "\n")
    return out
