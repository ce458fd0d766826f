"""Record one ``tests/compat/run.sh`` result as a row of
``benchmarks/results/compat.json`` (replacing the row of the same engine and
version). A row: ``engine``, ``version`` (as released), ``passed``,
``failed`` (failures + errors), ``skipped``, ``date``, ``commit``, and how it
was made (``command``, ``machine``, ``load_avg``, ``python``, ``duration_s``).

Usage: python tests/compat/record.py --engine vllm --version 0.30.0 --junit FILE --command CMD
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "compat.json"


def counts(junit: Path) -> dict[str, int]:
    """``passed``, ``failed``, ``skipped`` from a pytest JUnit XML file."""
    tree = ET.parse(junit).getroot()
    suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
    if not suites:
        raise ValueError(f"--junit {junit}: no <testsuite> in it")
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    duration = sum(float(s.get("time", 0.0)) for s in suites)
    return {
        "passed": total - failed - skipped,
        "failed": failed,
        "skipped": skipped,
        "duration_s": round(duration, 1),
    }


def commit() -> str:
    """HEAD (``-dirty`` with uncommitted changes); ``KVCACHED_COMPAT_COMMIT``
    names it for a tree exported without its git directory."""
    if os.environ.get("KVCACHED_COMPAT_COMMIT"):
        return os.environ["KVCACHED_COMPAT_COMMIT"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return head + ("-dirty" if dirty else "")


def load_rows(path: Path = RESULTS) -> list[dict]:
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: must hold a JSON list of rows")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    ap.add_argument("--version", required=True, help="as released, e.g. 0.30.0")
    ap.add_argument("--junit", required=True, type=Path)
    ap.add_argument("--command", required=True)
    ap.add_argument(
        "--results", type=Path, default=Path(os.environ.get("KVCACHED_COMPAT_RESULTS") or RESULTS)
    )
    args = ap.parse_args(argv)
    row = {
        "engine": args.engine,
        "version": args.version,
        **counts(args.junit),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "command": args.command,
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }
    rows = [
        r
        for r in load_rows(args.results)
        if (r.get("engine"), r.get("version")) != (args.engine, args.version)
    ]
    rows.append(row)
    rows.sort(key=lambda r: (r["engine"], [int(p) for p in r["version"].split(".")]))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(rows, indent=2) + "\n")
    print(
        f"compat.json: {args.engine} {args.version}: {row['passed']} passed, "
        f"{row['failed']} failed, {row['skipped']} skipped",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
