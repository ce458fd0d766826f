"""``kvctl metrics``: instances and GPUs in the Prometheus text exposition format.

Format 0.0.4 (``text/plain; version=0.0.4``), written by hand: a dozen gauges
do not need the ``prometheus-client`` dependency. The rules it keeps (and
``tests/control/test_metrics.py`` checks): one ``# HELP`` and one ``# TYPE``
line per family, before its samples, and the samples of a family together;
metric and label names from ``[a-zA-Z_:][a-zA-Z0-9_:]*``; label values with
``\\``, ``"`` and newlines escaped; counters end in ``_total``; the text ends
with a newline. A family with no sample is still described, so a scrape of a
machine with no instance is valid and says what would be there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvcached.control.view import LIVE, OVER, GpuRow, InstanceRow

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Value = Callable[[Any], "float | int | None"]

_INSTANCE: tuple[tuple[str, str, str, Value], ...] = (
    (
        "kvcached_instance_up",
        "gauge",
        "1 while a process of the instance is alive, 0 for a dead one not yet cleaned up",
        lambda r: 1 if r.state in (LIVE, OVER) else 0,
    ),
    (
        "kvcached_instance_used_bytes",
        "gauge",
        "Physical KV memory the instance holds on the GPU (what its limit caps)",
        lambda r: r.used_bytes,
    ),
    (
        "kvcached_instance_reserved_bytes",
        "gauge",
        "Of used: idle pages mapped ahead for new requests",
        lambda r: r.reserved_bytes,
    ),
    (
        "kvcached_instance_prefix_cache_bytes",
        "gauge",
        "Memory in unreferenced prefix-cache blocks (released under a limit)",
        lambda r: r.prefix_cache_bytes,
    ),
    (
        "kvcached_instance_virtual_bytes",
        "gauge",
        "Address space reserved for the KV cache",
        lambda r: r.virtual_bytes,
    ),
    ("kvcached_instance_blocks_used", "gauge", "KV blocks in use", lambda r: r.blocks_used),
    (
        "kvcached_instance_blocks_total",
        "gauge",
        "KV blocks the cache can address",
        lambda r: r.blocks_total,
    ),
    (
        "kvcached_instance_limit_bytes",
        "gauge",
        "The instance's limit on the GPU (absent when it has none)",
        lambda r: r.limit_bytes,
    ),
    (
        "kvcached_instance_limit_revision",
        "gauge",
        "Revision of the instance's limit",
        lambda r: r.limit_revision,
    ),
    (
        "kvcached_instance_ledger_charged_bytes",
        "gauge",
        "What the GPU's ledger charges the instance",
        lambda r: r.charged_bytes,
    ),
    (
        "kvcached_instance_misses_total",
        "counter",
        "Allocations refused for lack of memory (scheduling misses)",
        lambda r: r.misses,
    ),
    (
        "kvcached_instance_yielded_bytes_total",
        "counter",
        "Idle bytes released to neighbours whose allocations missed (KVCACHED_YIELD_IDLE)",
        lambda r: r.yielded_bytes,
    ),
    (
        "kvcached_instance_processes",
        "gauge",
        "Processes of the instance on the GPU",
        lambda r: len(r.pids),
    ),
    (
        "kvcached_instance_uptime_seconds",
        "gauge",
        "Seconds since the instance started",
        lambda r: round(r.uptime_s, 3),
    ),
)
_GPU: tuple[tuple[str, str, str, Value], ...] = (
    ("kvcached_gpu_total_bytes", "gauge", "Device memory", lambda g: g.total_bytes),
    (
        "kvcached_gpu_budget_bytes",
        "gauge",
        "The ledger's budget for KV memory (last calibration)",
        lambda g: g.budget_bytes,
    ),
    ("kvcached_gpu_margin_bytes", "gauge", "The ledger's safety margin", lambda g: g.margin_bytes),
    (
        "kvcached_gpu_charged_bytes",
        "gauge",
        "Sum of every pool's charge",
        lambda g: g.charged_bytes,
    ),
    (
        "kvcached_gpu_headroom_bytes",
        "gauge",
        "Budget minus charges (negative: over budget)",
        lambda g: g.headroom_bytes,
    ),
    ("kvcached_gpu_pools", "gauge", "Live pools charged to the ledger", lambda g: g.pools),
    (
        "kvcached_gpu_calibrations_total",
        "counter",
        "Calibrations published so far",
        lambda g: g.calibration_seq,
    ),
    (
        "kvcached_gpu_last_calibration_timestamp_seconds",
        "gauge",
        "When the budget was last calibrated (Unix time)",
        lambda g: round(g.calibrated_at, 3),
    ),
)


def escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(**labels: object) -> str:
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def _family(
    out: list[str],
    name: str,
    kind: str,
    help_text: str,
    samples: list[tuple[str, float | int | None]],
) -> None:
    out.append(f"# HELP {name} {escape_help(help_text)}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        if value is not None:
            out.append(f"{name}{labels} {format_value(value)}")


def prometheus(rows: Sequence[InstanceRow], gpus: Sequence[GpuRow]) -> str:
    """The exposition of ``rows`` and ``gpus`` (see the module docstring)."""
    out: list[str] = []
    _family(
        out,
        "kvcached_instance_info",
        "gauge",
        "Constant 1, labelled with the instance's engine and versions",
        [
            (
                _labels(
                    instance=r.name,
                    gpu=r.gpu,
                    engine=r.engine,
                    engine_version=r.engine_version,
                    kvcached_version=r.kvcached_version,
                    backend=r.backend,
                ),
                1,
            )
            for r in rows
        ],
    )
    for name, kind, help_text, value in _INSTANCE:
        _family(
            out,
            name,
            kind,
            help_text,
            [(_labels(instance=r.name, gpu=r.gpu), value(r)) for r in rows],
        )
    _family(
        out,
        "kvcached_instance_serve_state",
        "gauge",
        "1, labelled with the model's state under kvcached serve (starting, ready, "
        "sleeping, waking, stopped, failed)",
        [
            (_labels(instance=r.name, gpu=r.gpu, state=r.serve_state), 1)
            for r in rows
            if r.serve_state
        ],
    )
    for name, kind, help_text, value in _GPU:
        _family(out, name, kind, help_text, [(_labels(gpu=g.gpu), value(g)) for g in gpus])
    return "\n".join(out) + "\n"
