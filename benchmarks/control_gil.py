"""What kvcached's control thread costs the engine's own thread through the GIL.

Every engine process with kvcached pools has an instance whose control thread
publishes a snapshot for ``kvctl`` every tick (0.2 s) and looks at the limit
revisions in between. Each time a Python thread wakes it needs the GIL, and a
thread busy in Python (vLLM's engine core launching kernels, eager) loses it
for the switch. This measures that cost as a ratio against the same loop with
no instance in the process (the baseline), in rounds of rotated order:

* ``alone``: the busy loop, no instance (the baseline);
* ``polling``: an instance whose control thread looks at the revisions every
  ``REVISION_POLL_S`` (20 ms) itself: what every engine loop got before the step
  took that look over, and what an idle engine gets now (nothing is busy then);
* ``stepping``: the same instance, the loop calling ``Instance.note_step()``
  once per step, as kvcached's vLLM and SGLang hooks do: the step looks at the
  revisions and the thread wakes only at its tick.

A step is ``--ops`` small torch CPU ops (each holds the GIL, as a kernel launch
does). Read-outs per condition: steps per second over ``alone``'s in the same
round (median and range over rounds) and the control thread's wake-ups per
second.

    python benchmarks/control_gil.py --out benchmarks/results/control-gil.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import _provenance

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("alone", "polling", "stepping")


def _run(condition: str, seconds: float, ops: int, name: str) -> tuple[float, float]:
    """Steps per second of the busy loop under ``condition``, and the control
    thread's wake-ups per second (0 alone)."""
    from kvcached.control.instance import Instance

    instance = None if condition == "alone" else Instance(name, engine="bench")
    a, b = torch.zeros(4), torch.ones(4)
    note = instance.note_step if condition == "stepping" else None
    try:
        if instance is not None:
            time.sleep(0.1)  # the thread is up and in its rhythm
        woke = instance.wakeups if instance is not None else 0
        steps = 0
        start = time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end:
            if note is not None:
                note()
            for _ in range(ops):
                torch.add(a, b, out=a)
            steps += 1
        wall = time.perf_counter() - start
        wakeups = (instance.wakeups - woke) if instance is not None else 0
    finally:
        if instance is not None:
            instance.close()
    return steps / wall, wakeups / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0, help="per condition and round")
    ap.add_argument("--ops", type=int, default=14000, help="torch ops per step (~10 ms here)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/control-gil.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.ops < 1:
        ap.error("--rounds and --ops must be at least 1, --seconds above 0")
    os.environ.setdefault("KVCACHED_LEDGER_DIR", tempfile.mkdtemp(prefix="control-gil-"))
    prov = _provenance.start()
    _run("alone", 1.0, args.ops, "warm-up")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = CONDITIONS[r % 3 :] + CONDITIONS[: r % 3]
        if r % 2:
            order = order[::-1]
        row: dict[str, Any] = {"order": list(order)}
        for condition in order:
            rate, wakeups = _run(condition, args.seconds, args.ops, f"control-gil-{r}-{condition}")
            row[condition] = {"steps_per_s": rate, "wakeups_per_s": wakeups}
        for condition in CONDITIONS[1:]:
            row[condition]["kept"] = row[condition]["steps_per_s"] / row["alone"]["steps_per_s"]
        rounds.append(row)
        print(
            f"round {r}: polling kept {row['polling']['kept']:.4f} "
            f"({row['polling']['wakeups_per_s']:.0f} wake-ups/s), stepping kept "
            f"{row['stepping']['kept']:.4f} ({row['stepping']['wakeups_per_s']:.0f}/s)",
            flush=True,
        )
    summary: dict[str, Any] = {}
    for condition in CONDITIONS[1:]:
        kept = [row[condition]["kept"] for row in rounds]
        wake = [row[condition]["wakeups_per_s"] for row in rounds]
        summary[condition] = {
            "kept_median": statistics.median(kept),
            "kept_range": [min(kept), max(kept)],
            "wakeups_per_s_median": statistics.median(wake),
        }
    step_ms = 1e3 / statistics.median(row["alone"]["steps_per_s"] for row in rounds)
    result = {
        "benchmark": "control_gil",
        "baseline": "the busy loop with no kvcached instance in the process (alone)",
        "settings": vars(args) | {"out": str(args.out)},
        "step_ms_alone": step_ms,
        "summary": summary,
        "rounds": rounds,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    print(
        f"polling kept {summary['polling']['kept_median']:.4f}, stepping kept "
        f"{summary['stepping']['kept_median']:.4f} (a step {step_ms:.2f} ms alone) -> {args.out}"
    )
    _provenance.write_result(args.out, result, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
