"""What ``kvctl`` shows, built from snapshots and ledgers, and how it is drawn:
tables, a full-screen ``top`` view with usage bars, and Prometheus text."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcached.control.snapshot import Snapshot
from kvcached.units import format_bytes


@dataclass
class InstanceRow:
    """One instance on one GPU: the sums over its processes' pools there."""

    name: str
    gpu: str
    used_bytes: int = 0
    reserved_bytes: int = 0
    virtual_bytes: int = 0
    prefix_cache_bytes: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    limit_bytes: int | None = None
    limit_revision: int = 0
    pids: list[int] = field(default_factory=list)
    state: str = "live"
    engine: str = ""
    engine_version: str = ""
    uptime_s: float = 0.0
    misses: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuRow:
    """One device's ledger: what kvctl gpus and the GPU bars show."""

    gpu: str
    backend: str = ""
    total_bytes: int = 0
    budget_bytes: int = 0
    margin_bytes: int = 0
    charged_bytes: int = 0
    pools: int = 0
    calibration_seq: int = 0
    calibrated_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def instance_rows(snapshots: list[Snapshot]) -> list[InstanceRow]:
    """Fold every process' snapshot into one row per (instance, GPU)."""
    rows: dict[tuple[str, str], InstanceRow] = {}
    now = time.time()
    for snap in snapshots:
        doc = snap.data
        for pool in doc.get("pools", []):
            key = (snap.instance, pool.get("gpu", "?"))
            row = rows.get(key)
            if row is None:
                row = rows[key] = InstanceRow(name=snap.instance, gpu=key[1])
            row.used_bytes += int(pool.get("bytes_mapped", 0))
            row.reserved_bytes += int(pool.get("bytes_reserved", 0))
            row.virtual_bytes += int(pool.get("virtual_bytes", 0))
            row.prefix_cache_bytes += int(pool.get("prefix_cache_bytes", 0))
            row.blocks_used += int(pool.get("blocks_used", 0))
            row.blocks_total += int(pool.get("blocks_total", 0))
            row.misses += int(pool.get("misses", 0))
            limit = pool.get("limit_bytes")
            if limit is not None:
                row.limit_bytes = int(limit)
                row.limit_revision = max(row.limit_revision, int(pool.get("limit_revision", 0)))
            if snap.pid not in row.pids:
                row.pids.append(snap.pid)
            if not snap.alive:
                row.state = "dead"
            row.engine = doc.get("engine", row.engine)
            row.engine_version = doc.get("engine_version", row.engine_version)
            started = float(doc.get("started_at", now))
            row.uptime_s = max(row.uptime_s, now - started)
    return sorted(rows.values(), key=lambda r: (r.name, r.gpu))


def _limit_text(row: InstanceRow) -> str:
    return format_bytes(row.limit_bytes) if row.limit_bytes else "-"


def render_table(rows: list[InstanceRow]) -> str:
    """``kvctl list``'s table."""
    header = ("NAME", "GPU", "USED", "RESERVED", "LIMIT", "PID", "STATE")
    lines = [header]
    for r in rows:
        lines.append((r.name, r.gpu, format_bytes(r.used_bytes), format_bytes(r.reserved_bytes),
                      _limit_text(r), ",".join(map(str, r.pids)), r.state))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def bar(fraction: float, width: int) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    full = int(round(fraction * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def render_top(rows: list[InstanceRow], gpus: list[GpuRow], width: int = 100) -> str:
    """``kvctl top``'s screen: a bar per GPU (charged of budget) and one per
    instance (used of its limit, or of its GPU's budget when it has none)."""
    bar_width = max(10, min(50, width - 60))
    out = [f"kvcached top   {time.strftime('%H:%M:%S')}   "
           f"{len(rows)} instance(s) on {len(gpus)} GPU(s)   (q or Ctrl-C quits)", ""]
    budgets = {g.gpu: g.budget_bytes for g in gpus}
    for g in gpus:
        frac = g.charged_bytes / g.budget_bytes if g.budget_bytes else 0.0
        out.append(f"GPU {g.gpu:<14} {bar(frac, bar_width)} {format_bytes(g.charged_bytes):>11} of "
                   f"{format_bytes(g.budget_bytes)} budget, {g.pools} pool(s)")
    if gpus:
        out.append("")
    for r in rows:
        cap = r.limit_bytes or budgets.get(r.gpu) or r.virtual_bytes or 1
        out.append(f"{r.name:<20.20} {r.gpu:<12.12} {bar(r.used_bytes / cap, bar_width)} "
                   f"{format_bytes(r.used_bytes):>11} used  limit {_limit_text(r):>10}  "
                   f"{r.state}")
    if not rows:
        out.append("no kvcached instance is running")
    return "\n".join(line[:width] for line in out)


def _labels(**labels: str) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


_INSTANCE_METRICS = (
    ("kvcached_instance_used_bytes", "Physical KV bytes mapped by the instance", "used_bytes"),
    ("kvcached_instance_reserved_bytes", "Idle pre-mapped bytes held ready", "reserved_bytes"),
    ("kvcached_instance_prefix_cache_bytes", "Bytes held by unreferenced prefix-cache blocks",
     "prefix_cache_bytes"),
    ("kvcached_instance_blocks_used", "KV blocks in use", "blocks_used"),
    ("kvcached_instance_limit_bytes", "The instance's limit on this GPU (0: none)", "limit_bytes"),
    ("kvcached_instance_misses_total", "Allocations refused for lack of physical memory", "misses"),
    ("kvcached_instance_up", "1 while a process of the instance is alive", "state"),
)
_GPU_METRICS = (
    ("kvcached_gpu_budget_bytes", "The ledger's published budget", "budget_bytes"),
    ("kvcached_gpu_margin_bytes", "The ledger's safety margin", "margin_bytes"),
    ("kvcached_gpu_charged_bytes", "Sum of every pool's charge", "charged_bytes"),
    ("kvcached_gpu_total_bytes", "Device memory", "total_bytes"),
    ("kvcached_gpu_last_calibration_timestamp_seconds", "When the budget was last calibrated",
     "calibrated_at"),
)


def prometheus(rows: list[InstanceRow], gpus: list[GpuRow]) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    out: list[str] = []
    for metric, help_text, attr in _INSTANCE_METRICS:
        kind = "counter" if metric.endswith("_total") else "gauge"
        out += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        for r in rows:
            value: Any = getattr(r, attr)
            if attr == "state":
                value = 1 if value == "live" else 0
            out.append(f"{metric}{_labels(instance=r.name, gpu=r.gpu)} {int(value or 0)}")
    for metric, help_text, attr in _GPU_METRICS:
        out += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for g in gpus:
            value = getattr(g, attr)
            text = f"{value:.3f}" if isinstance(value, float) else str(int(value))
            out.append(f"{metric}{_labels(gpu=g.gpu)} {text}")
    return "\n".join(out) + "\n"
