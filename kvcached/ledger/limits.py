"""Instance records: each instance's name and its limit on one device.

An instance (``KVCACHED_IPC_NAME``, shared by all its workers) has one record
per device ledger, created by its first pool there and freed with its last.
Its limit caps the sum of its pools' charges (:meth:`Ledger.room
<kvcached.ledger.ledger.Ledger.room>` applies it to every grant). A limit is
written with a revision, so that writers that race (``kvctl``, ``serve``, the
instance itself) settle on the newest: see :meth:`InstanceRecords.set_limit`.
Lowering a limit blocks new growth; it takes no page back by itself (the
instance releases idle pages: :mod:`kvcached.control`).

Every ``*_locked`` method runs under the data lock.
"""

from __future__ import annotations

import os
import re
import secrets
import time

from kvcached.errors import InstanceNotFoundError, LedgerFullError
from kvcached.ledger import _hooks, layout
from kvcached.ledger.file import LedgerFile
from kvcached.ledger.layout import (
    H_HIGH_WATER,
    InstanceRecord,
    i_limit,
    i_name,
    i_revision,
    i_token,
)
from kvcached.ledger.snapshot import LimitStatus

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")


def check_instance_name(name: object) -> str:
    """``name`` if it is a valid instance name (``KVCACHED_IPC_NAME`` rules), else raise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"instance name {name!r} is not valid: 1 to 48 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (see KVCACHED_IPC_NAME)"
        )
    return name


def new_token() -> int:
    """A record's owner identity: random, odd (never 0, which means a free record)."""
    return secrets.randbits(63) | 1


def _word(slot: int, field: str, size: int) -> int:
    return (layout.instance_offset(slot) + getattr(InstanceRecord, field).offset) // size


class InstanceRecords:
    """The instance records of one mapped ledger file.

    Invariants: a record is in use while its token is set, and its token is
    written last (a half-written record never looks live); a name is in at most
    one record in use; a revision only grows.
    """

    def __init__(self, lfile: LedgerFile, tokens: memoryview, instances: memoryview) -> None:
        self.file = lfile
        self.path = lfile.path
        self._tokens = tokens  # every pool record's token, by slot
        self._refs = instances  # every pool record's instance (slot + 1), by slot

    def find_locked(self, name: str) -> int | None:
        """The slot of the instance record named ``name``, or None."""
        encoded = name.encode()
        raw, u64 = self.file.raw, self.file.u64
        for slot in range(layout.INSTANCE_SLOTS):
            if u64[i_token(slot)] and bytes(raw[i_name(slot)]).rstrip(b"\0") == encoded:
                return slot
        return None

    def in_use_locked(self, slot: int) -> bool:
        """Whether a pool record in use refers to instance ``slot``."""
        ref = slot + 1
        hw = self.file.u32[H_HIGH_WATER]
        return any(self._tokens[j] and self._refs[j] == ref for j in range(hw))

    def create_locked(self, name: str, start_time: int) -> int:
        """A new record named ``name`` for this process (started at ``start_time``),
        unlimited; raises :class:`LedgerFullError` when every record is in use."""
        u64 = self.file.u64
        free = [s for s in range(layout.INSTANCE_SLOTS) if not u64[i_token(s)]]
        if not free:
            # An instance record no pool refers to was left by a process that died
            # between creating it and writing its pool: reclaim those.
            free = [s for s in range(layout.INSTANCE_SLOTS) if not self.in_use_locked(s)]
            for s in free:
                u64[i_token(s)] = 0
        if not free:
            raise LedgerFullError(
                f"{self.path}: all {layout.INSTANCE_SLOTS} instance records are in use by live "
                "pools; stop an instance on this device or use fewer KVCACHED_IPC_NAMEs"
            )
        slot = free[0]
        self.file.i64[i_limit(slot)] = 0
        u64[i_revision(slot)] = 0
        self.file.i32[_word(slot, "pid", 4)] = os.getpid()
        u64[_word(slot, "start_time", 8)] = start_time
        u64[_word(slot, "created_ns", 8)] = time.time_ns()
        u64[_word(slot, "limit_set_ns", 8)] = 0
        encoded = name.encode()
        self.file.raw[i_name(slot)] = encoded + bytes(layout.NAME_BYTES - len(encoded))
        u64[i_token(slot)] = new_token()  # identity last
        return slot

    def names_locked(self) -> list[str]:
        return [
            bytes(self.file.raw[i_name(s)]).rstrip(b"\0").decode(errors="replace")
            for s in range(layout.INSTANCE_SLOTS)
            if self.file.u64[i_token(s)]
        ]

    def set_limit_locked(
        self, instance: str, limit: int, revision: int, device_id: str
    ) -> LimitStatus:
        """Set ``instance``'s limit (0: unlimited) at ``revision``.

        ``revision`` above the stored one: applied. Equal to it: applied if the
        limit is the same (a retry), else a ``conflict`` (another writer used that
        revision for another value). Below it: ``stale``. Only ``applied`` writes.
        Raises :class:`InstanceNotFoundError` when no pool of ``instance`` is
        registered on this device (``device_id``, for the message)."""
        slot = self.find_locked(instance)
        if slot is None:
            names = self.names_locked()
            raise InstanceNotFoundError(
                f"no kvcached instance named {instance!r} has a pool on {device_id} "
                f"(ledger {self.path}); instances there: {names or 'none'}"
            )
        i64, u64 = self.file.i64, self.file.u64
        stored = u64[i_revision(slot)]
        if revision < stored:
            return LimitStatus.STALE
        if revision == stored:
            return LimitStatus.APPLIED if i64[i_limit(slot)] == limit else LimitStatus.CONFLICT
        i64[i_limit(slot)] = limit
        u64[_word(slot, "limit_set_ns", 8)] = time.time_ns()
        if _hooks.point is not None:
            _hooks.point("limit-written")
        u64[i_revision(slot)] = revision  # last: a torn write reads as the old revision
        return LimitStatus.APPLIED


def check_limit_args(limit: int | None, revision: int) -> int:
    """``limit`` as a byte count (None: 0, unlimited) if it and ``revision`` are
    valid arguments of a limit write, else raise :class:`ValueError`."""
    limit = 0 if limit is None else limit
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit={limit!r}: must be a byte count >= 0 (0 or None: unlimited)")
    if not isinstance(revision, int) or not 0 < revision < 1 << 64:
        raise ValueError(f"revision={revision!r}: must be an int >= 1 (below 2**64)")
    return limit
