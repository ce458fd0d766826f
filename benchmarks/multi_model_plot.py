"""The plots of the multi-model benchmark, from its result JSON (matplotlib).

* ``multi-model-speedup.png``: TTFT speed-up of kvcached over the static split
  (native over kvcached) against the peak, mean and P99, with each
  configuration's control (round 0 over round 1) as the noise.
* ``multi-model-memory.png``: KV memory per model over time at the highest
  peak, stacked, against the budget: kvcached (``kvctl``'s used bytes) above,
  native (in-use KV from ``/metrics``; each holds its static third) below.

    python benchmarks/multi_model_plot.py [benchmarks/results/multi-model-cpu.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20


def plot_all(report: dict[str, Any], directory: Path, tag: str = "") -> list[Path]:
    """Write both PNGs into ``directory`` (``multi-model[-TAG]-speedup.png`` and
    ``-memory.png``); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    stem = f"multi-model-{tag}" if tag else "multi-model"
    return [
        plot_speedup(report, directory / f"{stem}-speedup.png"),
        plot_memory(report, directory / f"{stem}-memory.png"),
    ]


def tag_of(result: Path) -> str:
    """The plots' tag of a result file: ``multi-model-cpu-X.json`` gives ``X``
    (the CPU's plain result none), ``multi-model-gpu-X.json`` ``gpu-X``."""
    stem = result.stem
    if stem.startswith("multi-model-cpu"):
        return stem.removeprefix("multi-model-cpu").strip("-")
    return stem.removeprefix("multi-model").strip("-")


def title_of(report: dict[str, Any]) -> str:
    """What ran where: the GPU's card and how many rounds (no control with one)."""
    if report.get("device") != "gpu":
        return "Three tiny Llamas on vLLM CPU: shared budget vs static thirds"
    card = (report.get("gpu") or {}).get("name") or "a GPU"
    rounds = report.get("rounds") or 1
    note = f"{rounds} rounds" if rounds > 1 else "one round, no control"
    return f"Three Llama-3.1-8B shapes on one {card}:\nshared KV budget vs static thirds ({note})"


def plot_speedup(report: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    peaks = report["peaks"]
    xs = [float(p) for p in peaks]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(xs, [report["mean_ttft_speedup"][p] for p in peaks], "o-", label="mean TTFT")
    ax.plot(xs, [report["p99_ttft_speedup"][p] for p in peaks], "s-", label="P99 TTFT")
    for config, style in (("kvcached", ":"), ("native", "--")):
        ctrl = report.get("control", {}).get(config, {}).get("mean_ttft_ratio", {})
        if ctrl:
            ax.plot(
                [float(p) for p in ctrl],
                list(ctrl.values()),
                style,
                color="grey",
                label=f"control: {config} vs itself (mean)",
            )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("peak arrival rate per model (req/s)")
    ax.set_ylabel("speed-up (native / kvcached)")
    ax.set_yscale("log", base=2)
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.yaxis.set_major_locator(
        FixedLocator([0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.25, 1.5, 2, 3, 4, 8])
    )
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xticks(xs)
    ax.set_title(title_of(report), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_memory(report: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    peak = max(report["peaks"], key=float)
    models = report["setup"]["models"]
    budget = report["setup"]["budget_bytes"] / MIB
    static = report["setup"]["static_bytes"] / MIB
    fig, axes = plt.subplots(2, 1, figsize=(7.0, 5.6), dpi=120, sharex=True)
    for ax, config in zip(axes, ("kvcached", "native"), strict=True):
        run = next(
            (r for r in report["runs"] if r["config"] == config and r["peak"] == float(peak)), None
        )
        if run is None:
            ax.set_title(f"{config}: no run at peak {peak}")
            continue
        ts = [s["t"] for s in run["samples"]]
        ys = [[(s[m]["kv_bytes"] or 0) / MIB for s in run["samples"]] for m in models]
        ax.stackplot(ts, ys, labels=models, alpha=0.8)
        ax.axhline(budget, color="black", lw=1.0, label=f"budget {budget:.0f} MiB")
        if config == "native":
            for k in range(1, len(models)):
                ax.axhline(static * k, color="grey", lw=0.8, ls="--")
            ax.set_title(
                f"native: KV in use per model (each holds a static {static:.1f} MiB, dashed)",
                fontsize=9,
            )
        else:
            ax.set_title("kvcached: KV memory mapped per model (kvctl used)", fontsize=9)
        ax.set_ylabel("MiB")
        ax.set_ylim(0, budget * 1.15)
        ax.legend(fontsize=7, loc="upper left", ncol=4)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"seconds into the trace (peak {peak} req/s per model, round 0)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    src = (
        Path(argv[0])
        if argv
        else (Path(__file__).resolve().parent / "results" / "multi-model-cpu.json")
    )
    report = json.loads(src.read_text())
    for p in plot_all(report, src.parent, tag_of(src)):
        print(f"-> {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
