"""The per-GPU ledger: one physical budget shared by every process on a device.

Start here:

* :func:`open_pool_budget` — what the memory layer calls: a
  :class:`PoolBudget` (the :class:`~kvcached.memory.budget.PhysicalBudget` of
  one pool) on the shared ledger of the driver's device, with this process'
  background calibrator running while any such pool is open;
* :func:`open_ledger` — the process' shared :class:`Ledger` of a device, for
  limits (:meth:`Ledger.set_limit`) and snapshots (:meth:`Ledger.snapshot`).

See :mod:`kvcached.ledger.ledger` for the rules the ledger keeps (each one
points to the module that keeps it: ``datalock``, ``journal``, ``registry``,
``limits``, ``calibration``, ``snapshot``) and :mod:`kvcached.ledger.layout`
for the file.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from kvcached.ledger.calibrator import Calibration, Calibrator, MemInfo
from kvcached.ledger.file import ledger_path
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.limits import check_instance_name
from kvcached.ledger.pool import REFUND_FLUSH_BYTES, PoolBudget
from kvcached.ledger.snapshot import (
    HeaderView,
    InstanceView,
    LedgerSnapshot,
    LimitStatus,
    PoolView,
)

if TYPE_CHECKING:
    from kvcached.config import Config
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
    driver: Driver,
    *,
    config: Config | None = None,
    directory: str | None = None,
    gpu_utilization: float | None = None,
) -> Ledger:
    """The process' shared ledger of ``driver``'s device (opened or created on
    first use, keyed by its PCI bus id).

    ``config`` is the caller's settings (:func:`kvcached.config.get_config` at
    an entry point; ``None``: the documented defaults, as the ledger reads no
    environment): the ledger lives in ``config.ledger_dir``, its safety margin
    follows ``config.gpu_utilization`` and this process calibrates it every
    ``config.calibration_interval_s``. ``directory`` and ``gpu_utilization``
    override those two. The first open in a process decides for every later one."""
    from kvcached.config import defaults

    settings = defaults() if config is None else config
    directory = settings.ledger_dir if directory is None else directory
    util = settings.gpu_utilization if gpu_utilization is None else gpu_utilization
    device_id = driver.info().pci_bus_id
    key = ledger_path(directory, device_id)
    with _lock:
        ledger = _ledgers.get(key)
        # A ledger refused (replaced at its path, or corrupt) serves no new pool:
        # open the file at the path again (which refuses a corrupt one).
        if ledger is None or ledger.closed or ledger.refusal is not None:
            ledger = Ledger.open(
                device_id,
                driver,
                directory=directory,
                gpu_utilization=util,
                calibration_interval_s=settings.calibration_interval_s,
            )
            _ledgers[key] = ledger
        return ledger


def open_pool_budget(
    driver: Driver,
    instance_name: str | None = None,
    *,
    calibrate: bool = True,
    config: Config | None = None,
    directory: str | None = None,
) -> PoolBudget:
    """Register a pool of ``instance_name`` (default ``config.ipc_name``, else
    ``kvcached-<pid>``) on the ledger of ``driver``'s device (:func:`open_ledger`
    with ``config`` and ``directory``) and return its :class:`PoolBudget`. With
    ``calibrate`` the process' calibrator thread runs while any pool opened this
    way is open. Close the pool when the KV cache goes away
    (:meth:`PoolBudget.close`)."""
    ipc_name = None if config is None else config.ipc_name
    name = instance_name or ipc_name or f"kvcached-{os.getpid()}"
    ledger = open_ledger(driver, config=config, directory=directory)
    return ledger.register_pool(name, calibrate=calibrate)


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _ledgers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
