"""Setting an instance's limit from outside it (``kvctl limit``, controllers).

A limit lives in the instance's record of each device ledger it uses, with a
revision. :func:`set_limit` writes it on every such device and reports what
happened: ``applied`` (in force, usage within it), ``deferred`` (in force, the
instance is releasing idle memory to get within it, or waits for blocks in use
to be freed), ``stale`` (an older revision than the one stored: not written) or
``conflict`` (the same revision already holds another value: not written).

Which ledgers: those in ``KVCACHED_LEDGER_DIR`` and, so that ``kvctl`` works
without the instance's environment, every ledger a live instance names in its
snapshot. This module imports no torch and no device library.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvcached.errors import InstanceNotFoundError, LedgerError, LedgerPermissionError
from kvcached.ledger.file import list_ledgers
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.limits import check_instance_name
from kvcached.ledger.locks import LOCK_WAIT_S
from kvcached.ledger.snapshot import LedgerSnapshot, LimitStatus

if TYPE_CHECKING:
    from kvcached.control.snapshot import Snapshot


@dataclass(frozen=True)
class DeviceLimit:
    """The outcome on one device."""

    gpu: str
    status: LimitStatus
    limit_bytes: int | None  #: ``None``: unlimited
    revision: int
    charged_bytes: int  #: the instance's charge there when last read
    total_bytes: int

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out


@dataclass(frozen=True)
class LimitResult:
    """What :func:`set_limit` did, per device and overall (the worst status)."""

    instance: str
    status: LimitStatus
    devices: list[DeviceLimit] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "status": self.status.value,
            "devices": [d.as_dict() for d in self.devices],
        }


#: The largest limit a ledger's instance record holds (a signed 64-bit byte count).
MAX_LIMIT_BYTES = (1 << 63) - 1

_ORDER = (LimitStatus.APPLIED, LimitStatus.DEFERRED, LimitStatus.STALE, LimitStatus.CONFLICT)


def ledger_dirs(
    directory: str | None = None,
    snapshots: Sequence[Snapshot] | None = None,
    *,
    configured_dir: str | None = None,
) -> list[str]:
    """Where to look for ledgers: ``directory`` alone when given, else
    ``configured_dir`` (the caller's ``KVCACHED_LEDGER_DIR``, ``config.ledger_dir``)
    plus the directory of every ledger that a live instance's snapshot names (an
    instance may run with another directory). ``snapshots``: already read ones
    (default: read them now)."""
    if directory is not None:
        return [directory]
    if configured_dir is None:
        raise ValueError(
            "ledger_dirs(): give directory (only the ledgers there) or configured_dir "
            "(config.ledger_dir, the KVCACHED_LEDGER_DIR this process runs with)"
        )
    if snapshots is None:
        from kvcached.control.snapshot import read_snapshots

        snapshots = read_snapshots(cleanup=False)
    found = [configured_dir]
    for snap in snapshots:
        if not snap.alive:
            continue
        for pool in snap.data.get("pools", []):
            path = pool.get("ledger")
            if isinstance(path, str) and path:
                found.append(os.path.dirname(path))
    out: list[str] = []
    seen: set[str] = set()
    for d in found:
        key = os.path.realpath(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _listed(directory: str) -> list[str]:
    try:
        return list_ledgers(directory)
    except PermissionError as exc:
        raise LedgerPermissionError(
            exc.errno,
            f"{exc.strerror} while listing the kvcached ledger directory "
            "(KVCACHED_LEDGER_DIR); its instances' limits and charges need read and write "
            "access to it",
            directory,
        ) from exc


def ledger_snapshots(
    directory: str | None = None,
    snapshots: Sequence[Snapshot] | None = None,
    problems: list[str] | None = None,
    timeout: float = LOCK_WAIT_S,
    *,
    configured_dir: str | None = None,
) -> list[LedgerSnapshot]:
    """A snapshot of every ledger file (see :func:`ledger_dirs` for which, and
    for ``directory`` and ``configured_dir``).

    A ledger that cannot be read (no permission, another layout version, a
    corrupt record) raises its :class:`~kvcached.errors.LedgerError` (for no
    permission a :class:`~kvcached.errors.LedgerPermissionError`, a
    ``PermissionError``), unless ``problems`` is given: then its message is
    appended there and the ledger skipped. All of them together wait at most
    ``timeout`` seconds for data locks that other processes hold; a ledger
    still held then is read without its lock (its snapshot's ``locked_by``
    names the holder).
    """
    deadline = time.monotonic() + timeout
    out = []
    paths: list[str] = []
    for d in ledger_dirs(directory, snapshots, configured_dir=configured_dir):
        try:
            paths += _listed(d)
        except LedgerPermissionError as exc:
            if problems is None:
                raise
            problems.append(str(exc))
    for path in paths:
        try:
            ledger = Ledger.open_existing(path)
        except (LedgerError, OSError) as exc:
            if problems is None:
                raise
            problems.append(str(exc))
            continue
        try:
            out.append(ledger.snapshot(max(0.0, deadline - time.monotonic())))
        except (LedgerError, OSError) as exc:
            if problems is None:
                raise
            problems.append(str(exc))
        finally:
            ledger.close()
    return out


def set_limit(
    name: str,
    limit_bytes: int | None = None,
    *,
    percent: float | None = None,
    revision: int | None = None,
    directory: str | None = None,
    configured_dir: str | None = None,
    wait_s: float = 0.0,
    timeout: float = LOCK_WAIT_S,
) -> LimitResult:
    """Set instance ``name``'s limit on every device it uses.

    Give ``limit_bytes`` (``None``: remove the limit) or ``percent`` of each
    device's memory. ``revision`` defaults to the stored one plus one on each
    device; pass the revision you read to detect concurrent writers
    (``stale``/``conflict``). ``directory`` or ``configured_dir``: where the
    ledgers are (see :func:`ledger_dirs`). With ``wait_s``, wait up to that long for usage to
    come within the limit before answering ``deferred``. Raises
    :class:`InstanceNotFoundError` when no ledger has a pool of ``name``,
    ``ValueError`` for a bad argument, and
    :class:`~kvcached.errors.LedgerPermissionError` when a ledger may not be
    written by this user, :class:`~kvcached.errors.LedgerBusyError` when a
    ledger's data lock stays held by another process for ``timeout`` seconds.
    """
    _check_limit_args(name, limit_bytes, percent, wait_s)
    dirs = ledger_dirs(directory, configured_dir=configured_dir)
    results: list[DeviceLimit] = []
    unreadable: list[Exception] = []
    paths: list[str] = []
    for d in dirs:
        try:
            paths += _listed(d)
        except LedgerPermissionError as exc:
            unreadable.append(exc)
    for path in paths:
        try:
            ledger = Ledger.open_existing(path)
        except (LedgerError, OSError) as exc:
            unreadable.append(exc)  # fatal only if the instance is found nowhere else
            continue
        try:
            snap = ledger.snapshot(timeout)
            if snap.locked_by:
                raise ledger.busy_error(snap.lock_waited_s)
            inst = snap.instance(name)
            if inst is None or inst.pools == 0:
                continue
            total = snap.header.total_bytes
            limit = max(1, int(total * percent / 100)) if percent is not None else limit_bytes
            rev = inst.revision + 1 if revision is None else revision
            status = ledger.set_limit(name, limit, rev, timeout=timeout)
            results.append(
                DeviceLimit(snap.header.device_id, status, limit or None, rev, inst.charged, total)
            )
        finally:
            ledger.close()
    if not results:
        if unreadable:
            raise unreadable[0]
        raise InstanceNotFoundError(
            f"no kvcached instance named {name!r} holds memory on any device "
            f"(ledgers in {', '.join(dirs)})"
        )
    results = _settle(name, results, dirs, wait_s, timeout)
    worst = max((d.status for d in results), key=_ORDER.index)
    return LimitResult(name, worst, results)


def _check_limit_args(
    name: str, limit_bytes: int | None, percent: float | None, wait_s: float
) -> None:
    """:func:`set_limit`'s arguments, or ``ValueError`` naming the bad one."""
    check_instance_name(name)
    if percent is not None:
        if limit_bytes is not None:
            raise ValueError("give limit_bytes or percent, not both")
        if (
            isinstance(percent, bool)
            or not isinstance(percent, (int, float))
            or not 0 < percent <= 100
        ):
            raise ValueError(f"percent={percent!r}: must be a number in (0, 100]")
    elif limit_bytes is not None and (
        isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0
    ):
        raise ValueError(
            f"limit_bytes={limit_bytes!r}: must be a byte count > 0, or None to remove the limit"
        )
    elif limit_bytes is not None and limit_bytes > MAX_LIMIT_BYTES:
        raise ValueError(
            f"limit_bytes={limit_bytes}: must be at most {MAX_LIMIT_BYTES} "
            "(2**63 - 1, what a ledger's limit field holds), or None to remove "
            "the limit"
        )
    if wait_s < 0:
        raise ValueError(f"wait_s={wait_s!r}: must be >= 0 seconds")


def _charges(name: str, dirs: list[str], timeout: float) -> dict[str, int]:
    charged: dict[str, int] = {}
    for d in dirs:
        for snap in ledger_snapshots(d, problems=[], timeout=timeout):
            inst = snap.instance(name)
            if inst is not None:
                charged[snap.header.device_id] = inst.charged
    return charged


def _settle(
    name: str, results: list[DeviceLimit], dirs: list[str], wait_s: float, timeout: float
) -> list[DeviceLimit]:
    """Mark written limits that usage is still above as deferred (after waiting
    up to ``wait_s`` for the instance to release idle memory)."""
    deadline = time.monotonic() + wait_s
    while True:
        charged = _charges(name, dirs, timeout)
        settled = []
        for d in results:
            now = charged.get(d.gpu, d.charged_bytes)
            status = d.status
            if status in (LimitStatus.APPLIED, LimitStatus.DEFERRED):
                over = d.limit_bytes is not None and now > d.limit_bytes
                status = LimitStatus.DEFERRED if over else LimitStatus.APPLIED
            settled.append(
                DeviceLimit(d.gpu, status, d.limit_bytes, d.revision, now, d.total_bytes)
            )
        if all(d.status != LimitStatus.DEFERRED for d in settled) or time.monotonic() >= deadline:
            return settled
        results = settled
        time.sleep(0.05)
