"""Check a ledger's records as they are read: a value out of range is corruption.

The header check (:func:`kvcached.ledger.file.check_header`) proves that a
file has our layout; this proves that what is in it can be true: every index
in range, every charge between 0 and the device's total, the released part of
a charge within it, the journals well formed, and (read under the data lock)
the cross-record rules: free slots charge nothing, a live pool names a live
instance, the charges sum to no more than the device. A ledger that fails is
refused like a bad header (:class:`~kvcached.errors.LedgerCorruptError`, one
line naming the file, what is wrong and what to do) and never written.

A copy taken without the data lock (``kvctl`` when a holder stalls) may catch
a record halfway through a change, so only the per-record checks apply to it.
"""

from __future__ import annotations

import re

from kvcached.errors import LedgerCorruptError
from kvcached.ledger import layout
from kvcached.ledger.layout import Header, InstanceRecord, PoolRecord

#: The largest device a ledger accepts (8 PiB): anything above is a bad size,
#: not a device (and keeps every sum far from the int64 limit).
MAX_TOTAL_BYTES = 1 << 53

_NAME = re.compile(rb"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
_WHAT_TO_DO = (
    "stop every kvcached process that uses this device, then remove the file; "
    "kvcached never replaces or rewrites a ledger file itself"
)

_P_TOKEN = PoolRecord.token.offset // 8
_P_CHARGED = PoolRecord.charged.offset // 8
_P_RELEASED = PoolRecord.released.offset // 8
_P_PID = PoolRecord.pid.offset // 4
_P_INSTANCE = PoolRecord.instance.offset // 4
_I_TOKEN = InstanceRecord.token.offset // 8
_I_LIMIT = InstanceRecord.limit.offset // 8


def corrupt(path: str, what: str) -> LedgerCorruptError:
    """The error for a ledger whose contents cannot be true."""
    return LedgerCorruptError(f"{path} is corrupt: {what}. {_WHAT_TO_DO}")


def check_image(buf, path: str, *, locked: bool) -> None:
    """Raise :class:`LedgerCorruptError` unless ``buf`` (the whole file: the live
    mapping or a copy) holds a ledger whose every record is in range.
    ``locked``: ``buf`` was read under the data lock, so the cross-record rules
    hold too."""
    mv = memoryview(buf)
    try:
        _check(mv, path, locked)
    finally:
        mv.release()


def _check_header(mv: memoryview, path: str) -> Header:
    """The header, every word of it in range (else the corruption error)."""
    head = Header.from_buffer_copy(mv[: layout.HEADER_SIZE])
    total = head.total_bytes
    if not 0 < total <= MAX_TOTAL_BYTES:
        raise corrupt(path, f"the device's total is {total} bytes (must be 1 to 2**53)")

    def in_range(name: str, value: int, low: int, high: int) -> None:
        if not low <= value <= high:
            raise corrupt(path, f"header {name}={value}, outside [{low}, {high}]")

    in_range("safety_margin", head.safety_margin, 0, total)
    in_range("budget", head.budget, 0, total)
    in_range("calibration_free", head.calibration_free, 0, total)
    in_range("pool_high_water", head.pool_high_water, 0, layout.POOL_SLOTS)
    in_range("retire_slot", head.retire_slot, 0, layout.POOL_SLOTS)
    in_range("retire_instance", head.retire_instance, 0, layout.INSTANCE_SLOTS)
    in_range("retire_budget", head.retire_budget, 0, total)
    in_range("publish_pending", head.publish_pending, 0, 1)
    in_range("window_open", head.window_open, 0, 1)
    in_range("window_granted", head.window_granted, 0, 1 << 62)
    if head.publish_pending:
        in_range("publish_budget", head.publish_budget, 0, total)
        in_range("publish_free", head.publish_free, 0, total)
    if head.calibration_seq == 0:
        raise corrupt(path, "header calibration_seq is 0 (a ledger starts at 1)")
    return head


def _check(mv: memoryview, path: str, locked: bool) -> None:
    head = _check_header(mv, path)
    total = head.total_bytes
    pools = mv[layout.POOLS_OFFSET : layout.INSTANCES_OFFSET]
    p64, p32 = pools.cast("q"), pools.cast("i")
    insts = mv[layout.INSTANCES_OFFSET : layout.FILE_SIZE]
    i64 = insts.cast("q")
    try:
        pw, pw4 = layout.POOL_RECORD_SIZE // 8, layout.POOL_RECORD_SIZE // 4
        iw = layout.INSTANCE_RECORD_SIZE // 8
        live_instances = {s for s in range(layout.INSTANCE_SLOTS) if i64[s * iw + _I_TOKEN]}
        charged_sum = 0
        for s in range(layout.POOL_SLOTS):
            token = p64[s * pw + _P_TOKEN]
            charged = p64[s * pw + _P_CHARGED]
            released = p64[s * pw + _P_RELEASED]
            if not token:
                if locked and (charged or released):
                    raise corrupt(
                        path,
                        f"free pool record {s} charges {charged} bytes "
                        f"({released} released); a free record charges 0",
                    )
                continue
            if s >= head.pool_high_water:
                raise corrupt(
                    path,
                    f"pool record {s} is in use above the high-water mark {head.pool_high_water}",
                )
            if not 0 <= charged <= total:
                raise corrupt(
                    path, f"pool record {s} charges {charged} bytes on a device of {total}"
                )
            if not 0 <= released <= charged:
                raise corrupt(
                    path, f"pool record {s} has {released} bytes released of {charged} charged"
                )
            inst = p32[s * pw4 + _P_INSTANCE]
            if not 1 <= inst <= layout.INSTANCE_SLOTS:
                raise corrupt(
                    path,
                    f"pool record {s} names instance record {inst - 1}, "
                    f"outside 0..{layout.INSTANCE_SLOTS - 1}",
                )
            if locked and inst - 1 not in live_instances:
                raise corrupt(
                    path, f"pool record {s} names instance record {inst - 1}, which is not in use"
                )
            if p32[s * pw4 + _P_PID] <= 0:
                raise corrupt(path, f"pool record {s} has owner pid {p32[s * pw4 + _P_PID]}")
            charged_sum += charged
        if locked and charged_sum > total:
            raise corrupt(
                path, f"the pools charge {charged_sum} bytes together on a device of {total}"
            )
        for s in sorted(live_instances):
            start = s * layout.INSTANCE_RECORD_SIZE + InstanceRecord.name.offset
            name = bytes(insts[start : start + layout.NAME_BYTES]).rstrip(b"\0")
            if not _NAME.match(name):
                raise corrupt(
                    path,
                    f"instance record {s} has the name {name[:64]!r}, not a "
                    "valid KVCACHED_IPC_NAME",
                )
            if i64[s * iw + _I_LIMIT] < 0:
                raise corrupt(path, f"instance record {s} has the limit {i64[s * iw + _I_LIMIT]}")
    finally:
        for v in (p64, p32, pools, i64, insts):
            v.release()
