"""Setting an instance's limit from outside it (``kvctl limit``, controllers).

A limit lives in the instance's record of each device ledger it uses, with a
revision. :func:`set_limit` writes it on every such device and reports what
happened: ``applied`` (in force, usage within it), ``deferred`` (in force, the
instance is releasing idle memory to get within it), ``stale`` (an older
revision than the one stored: not written) or ``conflict`` (the same revision
already holds another value: not written).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvcached.config import get_config
from kvcached.errors import InstanceNotFoundError
from kvcached.ledger.file import list_ledgers
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.snapshot import LedgerSnapshot, LimitStatus


@dataclass(frozen=True)
class DeviceLimit:
    gpu: str
    status: LimitStatus
    limit_bytes: int | None
    revision: int
    charged_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class LimitResult:
    """What :func:`set_limit` did, per device and overall (the worst status)."""

    instance: str
    status: LimitStatus
    devices: list[DeviceLimit] = field(default_factory=list)


_ORDER = (LimitStatus.APPLIED, LimitStatus.DEFERRED, LimitStatus.STALE, LimitStatus.CONFLICT)


def ledger_snapshots(directory: str | None = None) -> list[LedgerSnapshot]:
    """A snapshot of every ledger file in ``directory`` (default ``KVCACHED_LEDGER_DIR``)."""
    directory = get_config().ledger_dir if directory is None else directory
    out = []
    for path in list_ledgers(directory):
        ledger = Ledger.open_existing(path)
        try:
            out.append(ledger.snapshot())
        finally:
            ledger.close()
    return out


def set_limit(name: str, limit_bytes: int | None = None, *, percent: float | None = None,
              revision: int | None = None, directory: str | None = None,
              wait_s: float = 0.0) -> LimitResult:
    """Set instance ``name``'s limit on every device it uses.

    Give ``limit_bytes`` (``None``: unlimited) or ``percent`` of each device's
    memory. ``revision`` defaults to the stored one plus one on each device; pass
    the revision you read to detect concurrent writers (``stale``/``conflict``).
    With ``wait_s``, wait up to that long for usage to come within the limit
    before answering ``deferred``. Raises :class:`InstanceNotFoundError` when no
    device ledger has a pool of ``name``.
    """
    if percent is not None:
        if not 0 < percent <= 100:
            raise ValueError(f"percent={percent!r}: must be in (0, 100]")
    elif limit_bytes is not None and (not isinstance(limit_bytes, int) or limit_bytes <= 0):
        raise ValueError(f"limit_bytes={limit_bytes!r}: must be a byte count > 0, or None")
    directory = get_config().ledger_dir if directory is None else directory
    results: list[DeviceLimit] = []
    seen = []
    for path in list_ledgers(directory):
        ledger = Ledger.open_existing(path)
        try:
            snap = ledger.snapshot()
            inst = snap.instance(name)
            if inst is None or inst.pools == 0:
                continue
            seen.append(snap.header.device_id)
            total = snap.header.total_bytes
            limit = int(total * percent / 100) if percent is not None else limit_bytes
            rev = inst.revision + 1 if revision is None else revision
            status = ledger.set_limit(name, limit, rev)
            results.append(DeviceLimit(snap.header.device_id, status, limit or None, rev,
                                       inst.charged, total))
        finally:
            ledger.close()
    if not seen:
        raise InstanceNotFoundError(
            f"no kvcached instance named {name!r} holds memory on any device "
            f"(ledgers in {directory})"
        )
    results = _settle(name, results, directory, wait_s)
    worst = max((d.status for d in results), key=_ORDER.index)
    return LimitResult(name, worst, results)


def _settle(name: str, results: list[DeviceLimit], directory: str,
            wait_s: float) -> list[DeviceLimit]:
    """Mark applied limits that usage is still above as deferred (after waiting)."""
    deadline = time.monotonic() + wait_s
    while True:
        charged = {}
        for snap in ledger_snapshots(directory):
            inst = snap.instance(name)
            if inst is not None:
                charged[snap.header.device_id] = inst.charged
        settled = []
        for d in results:
            now = charged.get(d.gpu, d.charged_bytes)
            status = d.status
            if status in (LimitStatus.APPLIED, LimitStatus.DEFERRED):
                over = d.limit_bytes is not None and now > d.limit_bytes
                status = LimitStatus.DEFERRED if over else LimitStatus.APPLIED
            settled.append(DeviceLimit(d.gpu, status, d.limit_bytes, d.revision, now,
                                       d.total_bytes))
        if all(d.status != LimitStatus.DEFERRED for d in settled) or time.monotonic() >= deadline:
            return settled
        results = settled
        time.sleep(0.1)
