"""What ``kvctl`` shows, built from snapshots and ledgers, and how it is drawn.

Two kinds of rows:

* :class:`InstanceRow`: one instance on one GPU, folded from the snapshots of
  all its processes (and, for an instance that publishes none, from its ledger
  records alone). ``used_bytes`` is the physical memory the instance holds
  there, the figure its limit caps; ``reserved_bytes`` is the idle part of it
  (pre-mapped pages ready for new requests, released first).
* :class:`GpuRow`: one device's ledger: budget, margin, charges, calibration.

Drawing: :func:`render_table` (``kvctl list``), :func:`render_status`,
:func:`render_gpus` and :func:`render_top` (the full-screen view with a usage
bar per GPU and per instance). No torch, no device: this runs in ``kvctl``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcached.control.snapshot import Snapshot
from kvcached.ledger.locks import process_state
from kvcached.ledger.snapshot import LedgerSnapshot
from kvcached.units import format_bytes

LIVE, OVER, DEAD = "live", "over-limit", "dead"


@dataclass
class InstanceRow:
    """One instance on one GPU: the sums over its processes' pools there."""

    name: str
    gpu: str
    used_bytes: int = 0  #: physical memory mapped (what the limit caps)
    reserved_bytes: int = 0  #: of used: idle, pre-mapped pages
    virtual_bytes: int = 0
    prefix_cache_bytes: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    limit_bytes: int | None = None
    limit_revision: int = 0
    charged_bytes: int | None = None  #: the ledger's charge (None: no ledger found)
    pids: list[int] = field(default_factory=list)
    pools: int = 0
    state: str = LIVE
    engine: str = ""
    engine_version: str = ""
    kvcached_version: str = ""
    backend: str = ""
    uptime_s: float = 0.0
    misses: int = 0
    #: idle bytes it released to neighbours that missed (``KVCACHED_YIELD_IDLE``)
    yielded_bytes: int = 0
    #: the bytes one page takes (the unit it grows by); 0 while it maps none
    page_bytes: int = 0
    ledger: str = ""
    #: The model's state under ``kvcached serve`` (starting, ready, sleeping, waking,
    #: stopped, failed), from the router's snapshot; "" when no serve runs it.
    serve_state: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuRow:
    """One device's ledger: what ``kvctl gpus`` and the GPU bars show."""

    gpu: str
    path: str = ""
    total_bytes: int = 0
    budget_bytes: int = 0
    margin_bytes: int = 0
    charged_bytes: int = 0
    released_bytes: int = 0  #: of charged: released, refund still batched
    pools: int = 0
    dead_pools: int = 0
    instances: list[str] = field(default_factory=list)
    calibration_seq: int = 0
    calibrated_at: float = 0.0  #: seconds since the epoch
    calibration_free_bytes: int = 0
    #: 0: read under the data lock; else the pid (-1: not known) that held it past
    #: kvctl's --timeout, so the figures were read without it
    locked_by: int = 0
    locked_state: str = ""  #: that process' state (``stopped``, ``traced``...)

    @property
    def held_note(self) -> str:
        """One line saying who holds this ledger's data lock ("" when nobody did)."""
        if not self.locked_by:
            return ""
        who = (
            f"pid {self.locked_by} ({self.locked_state})"
            if self.locked_by > 0
            else "a process /proc/locks does not name"
        )
        return (
            f"ledger {self.path}: its data lock is held by {who}; figures read without "
            "the lock (grants on this GPU are misses until it is free)"
        )

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.charged_bytes

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["headroom_bytes"] = self.headroom_bytes
        return out


def gpu_rows(ledgers: Iterable[LedgerSnapshot]) -> list[GpuRow]:
    rows = []
    for snap in ledgers:
        h = snap.header
        rows.append(
            GpuRow(
                gpu=h.device_id,
                path=h.path,
                total_bytes=h.total_bytes,
                budget_bytes=h.budget,
                margin_bytes=h.safety_margin,
                charged_bytes=h.charged,
                released_bytes=h.released,
                pools=sum(1 for p in snap.pools if p.alive),
                dead_pools=sum(1 for p in snap.pools if not p.alive),
                instances=sorted(i.name for i in snap.instances if i.pools),
                calibration_seq=h.calibration_seq,
                calibrated_at=h.calibration_time_ns / 1e9,
                calibration_free_bytes=h.calibration_free,
                locked_by=snap.locked_by,
                locked_state=process_state(snap.locked_by) if snap.locked_by > 0 else "",
            )
        )
    return sorted(rows, key=lambda g: g.gpu)


def _add_pool(
    rows: dict[tuple[str, str], InstanceRow], snap: Snapshot, pool: dict[str, Any], now: float
) -> None:
    """Add one pool of snapshot ``snap`` to its (instance, GPU) row."""
    doc = snap.data
    key = (snap.instance, str(pool.get("gpu", "?")))
    row = rows.get(key)
    if row is None:
        row = rows[key] = InstanceRow(
            name=snap.instance, gpu=key[1], state=LIVE if snap.alive else DEAD
        )
    row.pools += 1
    row.used_bytes += int(pool.get("bytes_mapped", 0))
    row.reserved_bytes += int(pool.get("bytes_reserved", 0))
    row.virtual_bytes += int(pool.get("virtual_bytes", 0))
    row.prefix_cache_bytes += int(pool.get("prefix_cache_bytes", 0))
    row.blocks_used += int(pool.get("blocks_used", 0))
    row.blocks_total += int(pool.get("blocks_total", 0))
    row.misses += int(pool.get("misses", 0))
    pages = int(pool.get("pages_mapped", 0))
    if pages > 0:
        row.page_bytes = max(row.page_bytes, int(pool.get("bytes_mapped", 0)) // pages)
    row.backend = str(pool.get("backend", row.backend))
    row.ledger = str(pool.get("ledger", row.ledger))
    limit = pool.get("limit_bytes")
    if limit is not None:
        row.limit_bytes = int(limit)
    row.limit_revision = max(row.limit_revision, int(pool.get("limit_revision", 0)))
    if snap.pid not in row.pids:
        row.pids.append(snap.pid)
    if snap.alive and row.state == DEAD:
        row.state = LIVE  # one live process keeps the instance live
    row.engine = str(doc.get("engine", row.engine))
    row.engine_version = str(doc.get("engine_version", row.engine_version))
    row.kvcached_version = str(doc.get("kvcached_version", row.kvcached_version))
    started = float(doc.get("started_at", now))
    row.uptime_s = max(row.uptime_s, now - started)


def instance_rows(
    snapshots: Sequence[Snapshot], ledgers: Sequence[LedgerSnapshot] = ()
) -> list[InstanceRow]:
    """Fold every process' snapshot into one row per (instance, GPU); take the
    limit and charge from the ledgers where they are found (they are the truth;
    a snapshot is up to one tick old) and add instances that hold memory in a
    ledger but publish no snapshot."""
    rows: dict[tuple[str, str], InstanceRow] = {}
    now = time.time()
    served: dict[str, str] = {}  # instance -> its state, published by kvcached serve
    for snap in snapshots:
        doc = snap.data
        serve = doc.get("serve")
        if snap.alive and isinstance(serve, dict) and isinstance(serve.get("state"), str):
            served[snap.instance] = serve["state"]
        for pool in doc.get("pools", []):
            _add_pool(rows, snap, pool, now)
        for gpu, nbytes in (doc.get("yielded_by_gpu") or {}).items():
            row = rows.get((snap.instance, str(gpu)))
            if row is not None:
                row.yielded_bytes += int(nbytes)
    for led in ledgers:
        gpu = led.header.device_id
        for inst in led.instances:
            alive = [p for p in led.pools if p.instance == inst.name and p.alive]
            row = rows.get((inst.name, gpu))
            if row is None:
                if not alive:
                    continue  # a record with no live pool: nothing to show
                row = rows[(inst.name, gpu)] = InstanceRow(
                    name=inst.name,
                    gpu=gpu,
                    used_bytes=inst.charged,
                    pools=len(alive),
                    pids=sorted({p.pid for p in alive}),
                    ledger=led.header.path,
                )
            row.limit_bytes = inst.limit or None
            row.limit_revision = inst.revision
            row.charged_bytes = inst.charged
    for row in rows.values():
        if row.state != DEAD and row.limit_bytes and row.used_bytes > row.limit_bytes:
            row.state = OVER
        row.serve_state = served.get(row.name, "")
    for name, state in served.items():  # a served model with no engine memory (stopped)
        if not any(r.name == name for r in rows.values()):
            rows[(name, "-")] = InstanceRow(
                name=name, gpu="-", serve_state=state, engine="kvcached-serve"
            )
    return sorted(rows.values(), key=lambda r: (r.name, r.gpu))


def gather(
    directory: str | None = None,
    names: Sequence[str] = (),
    problems: list[str] | None = None,
    timeout: float = 2.0,
    *,
    configured_dir: str | None = None,
) -> tuple[list[InstanceRow], list[GpuRow]]:
    """Read every snapshot and ledger now: ``(instance rows, GPU rows)``; the
    ledgers in ``directory``, else in ``configured_dir`` and wherever a live
    instance's are (:func:`~kvcached.control.limits.ledger_dirs`).
    ``names``: only these instances and their GPUs. Dead snapshots are cleaned up where this
    user may (and shown as dead where not). Unreadable ledgers are skipped and
    described in ``problems`` when it is given, else raised. A ledger whose data
    lock another process holds for ``timeout`` seconds (all ledgers together) is
    read without it; its row's ``locked_by`` names the holder."""
    from kvcached.control.limits import ledger_snapshots
    from kvcached.control.snapshot import read_snapshots

    snaps = read_snapshots()
    ledgers = ledger_snapshots(
        directory, snaps, problems, timeout=timeout, configured_dir=configured_dir
    )
    rows = instance_rows(snaps, ledgers)
    gpus = gpu_rows(ledgers)
    if names:  # only these instances, and the GPUs they use
        rows = [r for r in rows if r.name in names]
        used = {r.gpu for r in rows}
        gpus = [g for g in gpus if g.gpu in used]
    return rows, gpus


# -- text ------------------------------------------------------------------------------------
def _limit_text(row: InstanceRow) -> str:
    return format_bytes(row.limit_bytes) if row.limit_bytes else "none"


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _columns(lines: list[tuple[str, ...]], right: Sequence[int] = ()) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def render_table(rows: Sequence[InstanceRow]) -> str:
    """``kvctl list``'s table."""
    serve = any(r.serve_state for r in rows)  # the SERVE column only under kvcached serve
    lines: list[tuple[str, ...]] = [
        ("NAME", "GPU", "USED", "RESERVED", "LIMIT", "PID", "STATE") + (("SERVE",) if serve else ())
    ]
    for r in rows:
        lines.append(
            (
                r.name,
                r.gpu,
                format_bytes(r.used_bytes),
                format_bytes(r.reserved_bytes),
                _limit_text(r),
                ",".join(map(str, r.pids)),
                r.state,
            )
            + ((r.serve_state or "-",) if serve else ())
        )
    return _columns(lines, right=(2, 3, 4))


def render_gpus(gpus: Sequence[GpuRow]) -> str:
    """``kvctl gpus``'s table: each device's ledger."""
    now = time.time()
    lines: list[tuple[str, ...]] = [
        (
            "GPU",
            "TOTAL",
            "BUDGET",
            "MARGIN",
            "CHARGED",
            "HEADROOM",
            "POOLS",
            "INSTANCES",
            "CALIBRATED",
        )
    ]
    for g in gpus:
        pools = str(g.pools) + (f" (+{g.dead_pools} dead)" if g.dead_pools else "")
        lines.append(
            (
                g.gpu,
                format_bytes(g.total_bytes),
                format_bytes(g.budget_bytes),
                format_bytes(g.margin_bytes),
                format_bytes(g.charged_bytes),
                format_bytes(g.headroom_bytes),
                pools,
                ",".join(g.instances) or "-",
                f"#{g.calibration_seq}, {_age(max(0.0, now - g.calibrated_at))} ago",
            )
        )
    return _columns(lines, right=(1, 2, 3, 4, 5))


def render_status(rows: Sequence[InstanceRow]) -> str:
    """``kvctl status NAME``: everything known about one instance."""
    first = rows[0]
    out = [
        f"instance   {first.name}",
        f"state      {', '.join(sorted({r.state for r in rows}))}"
        + (f" (kvcached serve: {first.serve_state})" if first.serve_state else ""),
        f"engine     {first.engine or '?'} {first.engine_version}".rstrip(),
        f"kvcached   {first.kvcached_version or '?'}",
        f"pids       {', '.join(str(p) for p in sorted({p for r in rows for p in r.pids}))}",
        f"uptime     {_age(max(r.uptime_s for r in rows))}",
    ]
    for r in rows:
        mapped = format_bytes(r.used_bytes)
        out += [
            "",
            f"gpu        {r.gpu} ({r.backend or 'backend unknown'}), {r.pools} pool(s)",
            f"  used       {mapped} mapped, of which {format_bytes(r.reserved_bytes)} "
            f"reserved (idle)",
            f"  limit      {_limit_text(r)} (revision {r.limit_revision})",
            f"  ledger     {format_bytes(r.charged_bytes) if r.charged_bytes is not None else '?'}"
            f" charged  {r.ledger or ''}".rstrip(),
            f"  blocks     {r.blocks_used} of {r.blocks_total} in use",
            f"  prefix     {format_bytes(r.prefix_cache_bytes)} in unreferenced cached blocks",
            f"  virtual    {format_bytes(r.virtual_bytes)} reserved address space",
            f"  misses     {r.misses} allocations refused",
            f"  yielded    {format_bytes(r.yielded_bytes)} idle, to neighbours that missed",
        ]
    return "\n".join(out)


# -- the top screen ------------------------------------------------------------------------------
def bar(fraction: float, width: int) -> str:
    """``[####......]``: ``fraction`` (clamped to [0, 1]) of ``width`` cells."""
    fraction = min(max(fraction, 0.0), 1.0)
    full = int(round(fraction * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def usage_bar(used: int, reserved: int, limit: int | None, scale: int, width: int) -> str:
    """An instance's bar on its GPU's scale: ``#`` in use, ``+`` reserved
    (idle, pre-mapped), ``|`` where its limit is."""
    scale = max(scale, 1)

    def cells(n: int) -> int:
        return min(width, int(round(max(n, 0) / scale * width)))

    total = cells(used)
    idle = min(total, cells(reserved))
    chars = ["#"] * (total - idle) + ["+"] * idle + ["."] * (width - total)
    if limit:
        at = min(width - 1, cells(limit))
        chars[at] = "|"
    return "[" + "".join(chars) + "]"


def render_top(
    rows: Sequence[InstanceRow],
    gpus: Sequence[GpuRow],
    width: int = 100,
    height: int | None = None,
    title: str | None = None,
    footer: Sequence[str] = (),
) -> str:
    """``kvctl top``'s screen: a bar per GPU (charged of its budget) and one per
    instance (its memory on its GPU's budget scale: ``#`` in use, ``+``
    reserved, ``|`` its limit), bars aligned in one column."""
    width = max(width, 40)
    nw = min(24, max([8] + [len(r.name) for r in rows]))
    gw = min(20, max([3] + [len(r.gpu) for r in rows] + [len(g.gpu) for g in gpus]))
    lead = nw + 1 + gw  # the bars start after this
    bw = max(10, min(60, width - lead - 2 - 2 - 2 * 11 - 13))
    head = title or (
        f"kvcached top   {time.strftime('%H:%M:%S')}   {len(rows)} instance(s) on "
        f"{len(gpus)} GPU(s)   q quits"
    )
    out = [head, ""]
    scales: dict[str, int] = {}
    if gpus:
        out.append(
            f"{'GPU':<{lead}} {'CHARGED OF BUDGET':<{bw + 2}} {'CHARGED':>10} {'BUDGET':>10}  POOLS"
        )
    for g in gpus:
        scale = g.budget_bytes or g.total_bytes
        scales[g.gpu] = scale
        frac = g.charged_bytes / scale if scale else 0.0
        out.append(
            f"{g.gpu:<{lead}.{lead}} {bar(frac, bw)} {format_bytes(g.charged_bytes):>10} "
            f"{format_bytes(scale):>10}  {g.pools}"
        )
    if gpus:
        out.append("")
    if rows:
        out.append(
            f"{'INSTANCE':<{nw}} {'GPU':<{gw}} {'USAGE (# used + reserved | limit)':<{bw + 2}}"
            f" {'USED':>10} {'LIMIT':>10}  STATE"
        )
    for r in rows:
        scale = scales.get(r.gpu) or r.limit_bytes or r.virtual_bytes or r.used_bytes or 1
        out.append(
            f"{r.name:<{nw}.{nw}} {r.gpu:<{gw}.{gw}} "
            f"{usage_bar(r.used_bytes, r.reserved_bytes, r.limit_bytes, scale, bw)} "
            f"{format_bytes(r.used_bytes):>10} {_limit_text(r):>10}  {r.state}"
            + (f" ({r.serve_state})" if r.serve_state else "")
        )
    if not rows:
        out.append("no kvcached instance is running")
    if footer:
        out.append("")
        out.extend(footer)
    if height is not None:
        out = out[: max(1, height)]
    return "\n".join(line[:width] for line in out)
