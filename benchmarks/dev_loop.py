"""How long the developer loop takes: ``python -m pytest -m "not slow"`` from the
repository root, in the Python that runs this script, timed end to end (collection
included), with the load average before and after (on a shared 2-core machine a
figure means little without it) and the CPU seconds pytest and every process it
waited for used (which the load does not inflate much: the work itself).

    python benchmarks/dev_loop.py                                  # -> results/dev-loop.json
    python benchmarks/dev_loop.py --out benchmarks/results/dev-loop-vllm.json

The README's figure for the loop is checked against the file (tests/readme_figures.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import _provenance

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"]
#: The counts of pytest's last line ("913 passed, 40 skipped, 120 deselected in 96.1s").
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dev-loop.json"))
    args = ap.parse_args(argv)
    block = _provenance.start(argv)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, check=False)
    wall_s = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stdout.strip().splitlines()
    counts = {kind: int(n) for n, kind in OUTCOME.findall(lines[-1] if lines else "")}
    if done.returncode != 0 or not counts.get("passed"):
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-2000:])
        print(f"dev_loop: pytest exited {done.returncode}; nothing written", file=sys.stderr)
        return 1
    result = {
        "command": 'python -m pytest -m "not slow"',
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "outcomes": counts,
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
        "sglang_installed": importlib.util.find_spec("sglang") is not None,
    }
    out = _provenance.write_result(args.out, result, block)
    print(f"{wall_s:.1f} s ({cpu_s:.1f} CPU-s), {counts}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
