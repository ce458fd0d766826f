"""``kvcached demo`` as a result file: the README's demo output, reproducible.

Runs the demo (host backend, no GPU) with the given options and writes its
``--json`` summary with a provenance block to ``benchmarks/results/demo-host.json``;
``tests/test_readme_figures.py`` checks that the README's demo output is this
file's summary, rendered as the demo prints it.

    python benchmarks/demo.py            # the README's defaults: 3 instances, 1G, 20 s
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import _provenance
from kvcached.cli.demo import run_demo
from kvcached.units import parse_size

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--budget", default="1G")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo-host.json"))
    args = ap.parse_args(argv)
    prov = _provenance.start(argv)
    out = io.StringIO()
    rc = run_demo(
        duration_s=args.duration,
        instances=args.instances,
        budget=parse_size(args.budget),
        seed=args.seed,
        as_json=True,
        out=out,
    )
    if rc != 0:
        print(f"benchmarks/demo.py: the demo exited with {rc}; nothing written", file=sys.stderr)
        return rc
    result = {
        "benchmark": "demo",
        "options": vars(args) | {"out": None},
        "summary": json.loads(out.getvalue()),
    }
    path = _provenance.write_result(args.out, result, prov)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
