"""The single seam between the memory layer and whatever says how much physical
memory a pool may still take.

Every physical growth of a pool goes ``grant -> create/map -> (on failure)
refund``; every release goes ``unmap/release -> refund``. A refund follows a
*confirmed* release only: a release that failed is not refunded (the memory
may still be held).

Two implementations satisfy :class:`PhysicalBudget`:

* the per-GPU ledger's pool account (``kvcached.ledger``), shared by every
  process on the device: the default wherever a ledger can be opened;
* :class:`DriverFreeBudget` in this package, which reads the driver's free
  memory minus the safety margin: a single process with no ledger.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PhysicalBudget(Protocol):
    """How much physical memory one pool may still grow by."""

    def grant(self, nbytes: int) -> bool:
        """Charge ``nbytes`` before creating them. ``False`` is a denial (the
        device or the instance's limit is full): a scheduling miss upstream,
        never an exception. Raises only when the budget itself is broken."""

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` of one handle whose release was confirmed. Small
        refunds may be batched; a handle of 64 MiB or more is refunded at once."""

    def headroom(self) -> int:
        """Bytes :meth:`grant` would give now. Cheap (a cached figure is fine,
        refreshed by this pool's own grants and refunds and by calibration):
        ``available_size()`` calls it on the scheduler's hot path."""

    def flush(self) -> None:
        """Push batched refunds out now (trim, limit changes, shutdown)."""

    def close(self) -> None:
        """Flush and detach. Idempotent."""
