"""The per-GPU ledger: one physical budget shared by every process on a device.

Start here:

* :func:`open_pool_budget` — what the memory layer calls: a
  :class:`PoolBudget` (the :class:`~kvcached.memory.budget.PhysicalBudget` of
  one pool) on the shared ledger of the driver's device, with this process'
  background calibrator running while any such pool is open;
* :func:`open_ledger` — the process' shared :class:`Ledger` of a device, for
  limits (:meth:`Ledger.set_limit`) and snapshots (:meth:`Ledger.snapshot`).

See :mod:`kvcached.ledger.ledger` for the rules the ledger keeps and
:mod:`kvcached.ledger.layout` for the file.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from kvcached.ledger.calibrator import Calibration, Calibrator, MemInfo
from kvcached.ledger.file import ledger_path
from kvcached.ledger.ledger import Ledger, check_instance_name
from kvcached.ledger.pool import REFUND_FLUSH_BYTES, PoolBudget
from kvcached.ledger.snapshot import (
    HeaderView,
    InstanceView,
    LedgerSnapshot,
    LimitStatus,
    PoolView,
)

if TYPE_CHECKING:
    from kvcached.driver.base import Driver

__all__ = [
    "Calibration",
    "Calibrator",
    "HeaderView",
    "InstanceView",
    "Ledger",
    "LedgerSnapshot",
    "LimitStatus",
    "MemInfo",
    "check_instance_name",
    "PoolBudget",
    "PoolView",
    "REFUND_FLUSH_BYTES",
    "ledger_path",
    "open_ledger",
    "open_pool_budget",
]

_lock = threading.Lock()
_ledgers: dict[str, Ledger] = {}


def open_ledger(
    driver: Driver, *, directory: str | None = None, gpu_utilization: float | None = None
) -> Ledger:
    """The process' shared ledger of ``driver``'s device (opened or created on
    first use, keyed by its PCI bus id, in ``directory``, default
    ``KVCACHED_LEDGER_DIR``)."""
    from kvcached.config import get_config

    directory = get_config().ledger_dir if directory is None else directory
    device_id = driver.info().pci_bus_id
    key = ledger_path(directory, device_id)
    with _lock:
        ledger = _ledgers.get(key)
        # A ledger refused (replaced at its path, or corrupt) serves no new pool:
        # open the file at the path again (which refuses a corrupt one).
        if ledger is None or ledger.closed or ledger.refusal is not None:
            ledger = Ledger.open(
                device_id, driver, directory=directory, gpu_utilization=gpu_utilization
            )
            _ledgers[key] = ledger
        return ledger


def open_pool_budget(
    driver: Driver,
    instance_name: str | None = None,
    *,
    calibrate: bool = True,
    directory: str | None = None,
) -> PoolBudget:
    """Register a pool of ``instance_name`` (default ``KVCACHED_IPC_NAME``, else
    ``kvcached-<pid>``) on the ledger of ``driver``'s device and return its
    :class:`PoolBudget`. With ``calibrate`` the process' calibrator thread runs
    while any pool opened this way is open. Close the pool when the KV cache
    goes away (:meth:`PoolBudget.close`)."""
    from kvcached.config import get_config

    name = instance_name or get_config().ipc_name or f"kvcached-{os.getpid()}"
    ledger = open_ledger(driver, directory=directory)
    return ledger.register_pool(name, calibrate=calibrate)


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _ledgers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
