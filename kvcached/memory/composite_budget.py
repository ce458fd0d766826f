"""Budgets for memory that one process decides and other processes hold.

Under vLLM the engine core decides which pages exist and the workers map them:
the engine core charges every rank's device ledger before a page is planned,
and each worker maps what was charged for it.

* :class:`CompositeBudget` is the engine core's side: one
  :class:`~kvcached.memory.budget.PhysicalBudget` over the ledger accounts of
  several ranks. A grant of ``n`` bytes charges ``n`` on every member, all or
  nothing; a refund refunds every member.
* :class:`PrechargedBudget` is a worker's side: the charge was made elsewhere,
  so mapping never asks for more, and a release is refunded by whoever charged.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

from kvcached.errors import ConfigError
from kvcached.memory.budget import PhysicalBudget

#: How stale a member's cached headroom may be before :meth:`CompositeBudget.headroom`
#: asks it to look at its ledger again (a grant always decides on the ledger itself).
REFRESH_S = 0.05


class CompositeBudget:
    """All-or-nothing grants over several member budgets (one per rank).

    ``devices`` names each member's device: members on one device draw on one
    shared budget, so :meth:`headroom` is the smallest, over devices, of that
    device's headroom divided by how many members it has (a page of ``n``
    bytes per rank costs ``k*n`` there). Members that can ``refresh()`` their
    cached headroom (the ledger's pool accounts) are refreshed at most every
    :data:`REFRESH_S` when :meth:`headroom` is read.

    Invariant: every member has been charged the same bytes (each grant and
    refund goes to all of them), so a denial leaves nothing charged.
    """

    def __init__(
        self, members: Sequence[PhysicalBudget], devices: Sequence[Hashable] | None = None
    ) -> None:
        if not members:
            raise ConfigError("members", members, "at least one budget")
        if devices is None:
            devices = list(range(len(members)))
        if len(devices) != len(members):
            raise ConfigError("devices", devices, f"one device key per member ({len(members)})")
        self.members = list(members)
        self.devices = list(devices)
        groups: dict[Hashable, list[int]] = {}
        for i, key in enumerate(self.devices):
            groups.setdefault(key, []).append(i)
        # For headroom: one representative member per device and its share count.
        self._groups = [(idx[0], len(idx)) for idx in groups.values()]
        self._refreshed = 0.0
        self.denials = 0

    def grant(self, nbytes: int) -> bool:
        done: list[PhysicalBudget] = []
        for member in self.members:
            try:
                ok = member.grant(nbytes)
            except BaseException:
                self._undo(done, nbytes)
                raise
            if not ok:
                self._undo(done, nbytes)
                self.denials += 1
                return False
            done.append(member)
        return True

    @staticmethod
    def _undo(done: list[PhysicalBudget], nbytes: int) -> None:
        for member in reversed(done):  # granted, never created: give it straight back
            member.refund(nbytes)

    def refund(self, nbytes: int) -> None:
        for member in self.members:
            member.refund(nbytes)

    def headroom(self) -> int:
        now = time.monotonic()
        if now - self._refreshed > REFRESH_S:
            self._refreshed = now
            for member in self.members:
                refresh = getattr(member, "refresh", None)
                if refresh is not None:
                    refresh()
        return min(self.members[i].headroom() // shares for i, shares in self._groups)

    def flush(self) -> None:
        for member in self.members:
            member.flush()

    def close(self) -> None:
        for member in self.members:
            member.close()


class PrechargedBudget:
    """The budget of a process that maps memory another process charged.

    :meth:`grant` always succeeds (the charge exists already); :meth:`refund`
    only counts (the charging process refunds once it learns the release is
    confirmed). ``granted`` and ``released`` are the running totals.
    """

    def __init__(self) -> None:
        self.granted = 0
        self.released = 0

    def grant(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"grant(nbytes={nbytes}): must be >= 0")
        self.granted += nbytes
        return True

    def refund(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"refund(nbytes={nbytes}): must be >= 0")
        self.released += nbytes

    def headroom(self) -> int:
        return 1 << 62

    def flush(self) -> None:
        """Nothing is batched here."""

    def close(self) -> None:
        """Nothing to detach."""
