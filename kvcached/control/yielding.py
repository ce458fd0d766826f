"""Idle memory handed to a neighbour that misses: the control thread's yield pass.

The ledger lets an instance grow only into the device's unspent budget; it
cannot take back what another instance holds idle. Without this pass a model
whose requests wait for memory waits while a neighbour on the same GPU keeps
pages it reserved and prefix-cache blocks no request holds (on the H100's
three-model sweep, ~0.8-1.9 GiB at the knee: ``benchmarks/results/h100/
multi-model-sweep/README.md``). Each instance's control thread runs it after
its limit pass (:meth:`kvcached.control.instance.Instance.enforce`), on every
device where the instance has a ledger account:

* **call**: where one of this instance's pools missed since the last pass
  (its ``misses`` grew), could still grow in its own virtual space, and the
  device's budget is what is short, post a call for what it lacked
  (``short_bytes``, else one :func:`growth_unit`) in its pool record
  (:mod:`kvcached.ledger.wants`, which also skips a call the device's room
  or the instance's own limit makes useless);
* **yield**: where another instance posted a call since the last pass, and
  this instance did not miss there itself, map no reserve there for
  :data:`RESERVE_HOLD_S` (the pools' ``hold_reserve``), and where the
  device's room does not cover the call, release the difference from its
  idle memory there: the pools' ``reclaim``, which takes idle pages first,
  then unreferenced prefix-cache blocks oldest first, and never a block in
  use.

Only idle memory moves, and only to a request that waits for it: an
instance that yields loses reserve (remapped on its next growth) and cached
prefixes (recomputed on their next hit), never a request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvcached.log import get_logger

log = get_logger("kvcached.control")

#: At most one log line about yields (and one about calls) per this many seconds.
YIELD_LOG_S = 30.0
#: How long an instance that answered a call maps no reserve. A neighbour that
#: misses calls on every pass (0.2 s), and a busy instance refills its reserve
#: at its next allocation: without a hold the pages it gave would go straight
#: back to it. Ten passes outlive the gaps inside one episode of calls and end
#: soon after it.
RESERVE_HOLD_S = 2.0


def growth_unit(virtual_bytes: int, blocks_total: int, page_bytes: int) -> int:
    """Headroom below which an instance is short of memory: 32 of its blocks, or
    one page where a page is larger. Growth is granted a whole page at a time,
    so an 8B Llama (128 MiB pages of 64 blocks) misses with 100 MiB of headroom
    left, which 32 blocks (64 MiB) alone would not call pressure."""
    block = max(1, virtual_bytes // max(1, blocks_total))
    return max(32 * block, page_bytes)


def wanted_bytes(usage: Any) -> int:
    """What a pool that missed lacked: its own ``short_bytes`` where it knows
    them, else one growth unit (a page of a pool with pages mapped)."""
    if usage.short_bytes > 0:
        return usage.short_bytes
    page = usage.bytes_mapped // usage.pages_mapped if usage.pages_mapped else 0
    return growth_unit(usage.virtual_bytes, usage.blocks_total, page)


def _calls(watch: Any) -> bool:
    """Whether ``watch`` (a ledger account) can carry calls: a test's stand-in may not."""
    return all(hasattr(watch, a) for a in ("post_want", "neighbour_wants", "device_room"))


@dataclass
class YieldPass:
    """The state one instance's yield pass keeps between passes."""

    name: str  #: the instance's, for the log
    misses_seen: dict[int, int] = field(default_factory=dict)  #: id(source) -> misses
    wants_seen: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    calls: int = 0  #: calls this instance posted
    by_device: dict[str, int] = field(default_factory=dict)  #: bytes yielded, per device
    _logged: dict[str, float] = field(default_factory=dict)

    @property
    def yielded_bytes(self) -> int:
        """Bytes released to neighbours' calls, on every device."""
        return sum(self.by_device.values())

    def run(self, groups: dict[str, list[tuple[Any, Any, Any]]], flush: Any) -> int:
        """One pass over ``groups`` (device -> ``(source, watch, usage)`` of each
        pool there); ``flush(source)`` writes a pool's batched refunds. Returns
        the bytes released to neighbours."""
        released = 0
        for device, members in groups.items():
            members = [m for m in members if m[1] is not None and _calls(m[1])]
            if not members:
                continue
            missed = self._call(device, members)
            got = self._yield(device, members, missed, flush)
            if got:
                self.by_device[device] = self.by_device.get(device, 0) + got
            released += got
        return released

    def _call(self, device: str, members: list[tuple[Any, Any, Any]]) -> bool:
        """Post calls for this instance's pools that missed; whether any missed."""
        missed = False
        for source, watch, usage in members:
            before = self.misses_seen.get(id(source), 0)
            self.misses_seen[id(source)] = usage.misses
            if usage.misses <= before:
                continue
            missed = True
            need = wanted_bytes(usage)
            if usage.virtual_bytes - usage.bytes_mapped < need:
                continue  # its own virtual space is full: no neighbour can help
            if watch.post_want(need):
                self.calls += 1
                self._log(
                    "call",
                    "instance %s: allocations on %s miss with the device's budget spent; "
                    "called on its neighbours for %d B of their idle memory (%d calls so far)",
                    self.name,
                    device,
                    need,
                    self.calls,
                )
        return missed

    def _yield(
        self, device: str, members: list[tuple[Any, Any, Any]], missed: bool, flush: Any
    ) -> int:
        watch = members[0][1]
        path = getattr(watch, "ledger_path", device)
        fresh = 0
        for want in watch.neighbour_wants():
            key = (path, want.slot)
            if self.wants_seen.get(key) != want.key:
                self.wants_seen[key] = want.key
                fresh += want.nbytes
        if not fresh or missed:
            return 0  # nothing new, or short here itself: its idle memory is its own reserve
        for source, _, _ in members:
            hold = getattr(source, "hold_reserve", None)
            if hold is not None:
                hold(RESERVE_HOLD_S)
        need = fresh - max(0, watch.device_room())
        released = 0
        for source, _, _ in members:
            if need <= 0:
                break
            got = source.reclaim(need)
            flush(source)
            need -= got
            released += got
        if released:
            self._log(
                "yield",
                "instance %s: released %d B of idle memory on %s to a neighbour whose "
                "allocations miss (%d B so far)",
                self.name,
                released,
                device,
                self.yielded_bytes + released,
            )
        return released

    def _log(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get(kind, -YIELD_LOG_S) >= YIELD_LOG_S:
            self._logged[kind] = now
            log.info(msg, *args)
