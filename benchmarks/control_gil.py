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

A step is ``--chunks-per-step`` chunks of ``--ops`` small torch CPU ops each
(every op holds the GIL, as a kernel launch does), each chunk timed. Read-outs
per condition, against ``alone``'s in the same round (median and range over
rounds): steps per second (``kept``), the share of wall time stalled, summed
over chunks that took over 3x the median chunk (``stalled_extra``: a GIL switch
is 0.1-0.2 ms, too short to move a 2 s step rate on a shared VM), and the
control thread's wake-ups per second.

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


def _run(
    condition: str, seconds: float, ops: int, chunks_per_step: int, name: str
) -> dict[str, float]:
    """The busy loop under ``condition``: steps per second, the share of its
    wall time spent stalled (chunks that took over 3x the median chunk, the
    excess summed), and the control thread's wake-ups per second (0 alone)."""
    from kvcached.control.instance import Instance

    instance = None if condition == "alone" else Instance(name, engine="bench")
    a, b = torch.zeros(4), torch.ones(4)
    note = instance.note_step if condition == "stepping" else None
    clock = time.perf_counter
    chunks: list[float] = []
    try:
        if instance is not None:
            time.sleep(0.1)  # the thread is up and in its rhythm
        woke = instance.wakeups if instance is not None else 0
        start = clock()
        end = start + seconds
        t = start
        while t < end:
            if note is not None:
                note()
            for _ in range(chunks_per_step):
                for _ in range(ops):
                    torch.add(a, b, out=a)
                now = clock()
                chunks.append(now - t)
                t = now
        wall = t - start
        wakeups = (instance.wakeups - woke) if instance is not None else 0
    finally:
        if instance is not None:
            instance.close()
    median = statistics.median(chunks)
    stalled = sum(d - median for d in chunks if d > 3 * median)
    return {
        "steps_per_s": len(chunks) / chunks_per_step / wall,
        "stalled_share": stalled / wall,
        "chunk_us": median * 1e6,
        "wakeups_per_s": wakeups / wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=0.5, help="per condition and round")
    ap.add_argument("--ops", type=int, default=64, help="torch ops per timed chunk (~50 us here)")
    ap.add_argument("--chunks-per-step", type=int, default=200, help="chunks per step (~10 ms)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/control-gil.json")
    args = ap.parse_args(argv)
    if min(args.rounds, args.ops, args.chunks_per_step) < 1 or args.seconds <= 0:
        ap.error("--rounds, --ops and --chunks-per-step must be at least 1, --seconds above 0")
    os.environ.setdefault("KVCACHED_LEDGER_DIR", tempfile.mkdtemp(prefix="control-gil-"))
    prov = _provenance.start()
    _run("alone", 1.0, args.ops, args.chunks_per_step, "warm-up")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = CONDITIONS[r % 3 :] + CONDITIONS[: r % 3]
        if r % 2:
            order = order[::-1]
        row: dict[str, Any] = {"order": list(order)}
        for condition in order:
            row[condition] = _run(
                condition, args.seconds, args.ops, args.chunks_per_step, f"cg-{r}-{condition}"
            )
        for condition in CONDITIONS[1:]:
            row[condition]["kept"] = row[condition]["steps_per_s"] / row["alone"]["steps_per_s"]
            row[condition]["stalled_extra"] = (
                row[condition]["stalled_share"] - row["alone"]["stalled_share"]
            )
        rounds.append(row)
        print(
            f"round {r}: polling kept {row['polling']['kept']:.4f} (stalled "
            f"{row['polling']['stalled_extra']:+.2%}, {row['polling']['wakeups_per_s']:.0f} "
            f"wake-ups/s), stepping kept {row['stepping']['kept']:.4f} (stalled "
            f"{row['stepping']['stalled_extra']:+.2%}, {row['stepping']['wakeups_per_s']:.0f}/s)",
            flush=True,
        )
    summary: dict[str, Any] = {}
    for condition in CONDITIONS[1:]:
        kept = [row[condition]["kept"] for row in rounds]
        wake = [row[condition]["wakeups_per_s"] for row in rounds]
        extra = [row[condition]["stalled_extra"] for row in rounds]
        summary[condition] = {
            "kept_median": statistics.median(kept),
            "kept_range": [min(kept), max(kept)],
            "stalled_extra_median": statistics.median(extra),
            "stalled_extra_mean": statistics.fmean(extra),
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
        f"polling kept {summary['polling']['kept_median']:.4f} (stalled "
        f"{summary['polling']['stalled_extra_median']:+.2%}), stepping kept "
        f"{summary['stepping']['kept_median']:.4f} (stalled "
        f"{summary['stepping']['stalled_extra_median']:+.2%}); a step {step_ms:.2f} ms alone "
        f"-> {args.out}"
    )
    _provenance.write_result(args.out, result, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
