"""Sleep levels: what putting a model to sleep, and waking it, does.

* ``kv`` (any engine that runs kvcached, the CPU build included): the
  instance's limit is lowered to :data:`HOLD_AT_ZERO` (one byte: no page fits
  under it) through :func:`kvcached.control.limits.set_limit`; the instance
  then releases its idle memory (reserved pages, unreferenced prefix-cache
  blocks) and grows no more. Waking writes back the limit the user had,
  unless someone (``kvctl limit``) changed it meanwhile: then theirs stays.
* ``weights``: the engine's own sleep API (its row in
  :mod:`kvcached.serve.engines`), then ``kv``.
* ``stop`` is the supervisor's: ``kv`` first, then the process is stopped.

These calls block on the ledgers (a few ms), so the router runs them in a
thread. Nothing here imports an engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvcached.errors import InstanceNotFoundError
from kvcached.log import get_logger

log = get_logger("kvcached.serve")

#: The limit that holds an instance at zero pages (0 means "unlimited" in the ledger).
HOLD_AT_ZERO = 1


def configured_ledger_dir() -> str:
    """The ledger directory serve's engines inherit (``KVCACHED_LEDGER_DIR``): serve
    is an entry point, so it reads the setting and hands it to the control layer."""
    from kvcached.config import get_config

    return get_config().ledger_dir


@dataclass(frozen=True)
class KvReading:
    """An instance's memory on every device, summed, from its ledgers and snapshots."""

    charged_bytes: int  #: the ledgers' charge (what a sleep must bring to zero)
    limit_bytes: int  #: the limit on its first device (0: unlimited)
    devices: tuple[str, ...]
    limits: tuple[int, ...]  #: per device, in ``devices`` order
    headroom_bytes: int  #: the smallest budget headroom over its devices
    ledgers: tuple[str, ...] = ()  #: the ledger files, in ``devices`` order


def read_kv(name: str, directory: str | None = None) -> KvReading | None:
    """Where instance ``name`` holds memory now; ``None`` when no ledger has a pool
    of it (``directory``: only the ledgers there)."""
    from kvcached.control.limits import ledger_snapshots

    charged = 0
    devices, limits, headrooms, paths = [], [], [], []
    for snap in ledger_snapshots(directory, problems=[], configured_dir=configured_ledger_dir()):
        inst = snap.instance(name)
        if inst is None or inst.pools == 0:
            continue
        charged += inst.charged
        devices.append(snap.header.device_id)
        limits.append(inst.limit)
        headrooms.append(snap.header.budget - snap.header.charged)
        paths.append(snap.header.path)
    if not devices:
        return None
    return KvReading(
        charged, limits[0], tuple(devices), tuple(limits), min(headrooms), tuple(paths)
    )


def kv_sleep(name: str, settle_s: float = 3.0) -> KvReading | None:
    """Hold instance ``name`` at zero and wait up to ``settle_s`` for its memory to go.
    Returns the reading before (``None``: it holds no pool anywhere: nothing to do)."""
    from kvcached.control.limits import set_limit

    before = read_kv(name)
    if before is None:
        log.info(
            "model %s: no kvcached instance holds memory; the kv sleep has nothing to release", name
        )
        return None
    try:
        result = set_limit(
            name, HOLD_AT_ZERO, configured_dir=configured_ledger_dir(), wait_s=settle_s
        )
    except InstanceNotFoundError:
        return None
    if result.status.value != "applied":
        log.info(
            "model %s: kv sleep %s (%s still held)",
            name,
            result.status.value,
            ", ".join(f"{d.gpu}: {d.charged_bytes} B" for d in result.devices),
        )
    return before


def kv_wake(name: str, restore_limit: int, ledgers: tuple[str, ...] = ()) -> bool:
    """Give instance ``name`` back ``restore_limit`` (0: unlimited) where it is
    still held at zero. False when it holds no pool or someone changed the limit.

    ``ledgers``: the files it slept on (:attr:`KvReading.ledgers`): when they
    share a directory only that one is read, a few ms on the request's path
    instead of a scan of every snapshot and ledger on the machine; otherwise
    (or if the instance is no longer found there) the scan. Written through
    :func:`kvcached.control.limits.set_limit`, as ``kvctl limit`` would."""
    from kvcached.control.limits import set_limit

    dirs = {os.path.dirname(p) for p in ledgers}
    directory = dirs.pop() if len(dirs) == 1 else None
    now = read_kv(name, directory)
    if now is None and directory is not None:
        directory, now = None, read_kv(name)
    if now is None:
        return False
    if any(limit != HOLD_AT_ZERO for limit in now.limits):
        log.info(
            "model %s: its limit was changed while it slept (%s); leaving it", name, now.limits
        )
        return False
    try:
        set_limit(
            name,
            restore_limit or None,
            directory=directory,
            configured_dir=configured_ledger_dir(),
        )
    except InstanceNotFoundError:
        return False
    return True


def retire_dead_pools(name: str) -> int:
    """Return to the budget what instance ``name``'s ended processes left charged
    in the ledgers: pools they never closed, because serve stopped or lost their
    engine (vLLM's own shutdown SIGKILLs its workers, pools open) or it died.
    The next registration or calibration would retire them too; serve does it
    now, so no charge outlives its engine. Only this instance's pools: serve
    stopped these processes itself, which is routine (logged at debug), while a
    dead process of another instance is left to the ledger, which says so when
    it retires it. Returns how many."""
    from kvcached.control.limits import ledger_dirs
    from kvcached.errors import LedgerError
    from kvcached.ledger.file import list_ledgers
    from kvcached.ledger.ledger import Ledger

    retired = 0
    dirs = ledger_dirs(configured_dir=configured_ledger_dir())
    paths = [path for directory in dirs for path in list_ledgers(directory)]
    for path in paths:
        try:
            ledger = Ledger.open_existing(path)
        except (LedgerError, OSError) as exc:
            log.warning("model %s: ledger %s unreadable (%s)", name, path, exc)
            continue
        try:
            dead = [p for p in ledger.snapshot().pools if p.instance == name and not p.alive]
            if not dead:
                continue
            with ledger.locked():
                for pool in dead:
                    # The same token under the data lock: still that dead owner's record
                    # (a record is re-claimed only after its retirement, with a new token).
                    if ledger.tokens[pool.slot] != pool.token:
                        continue  # retired meanwhile, by a registration or a calibration
                    charge = ledger.close_pool_locked(pool.slot, pool.token)
                    retired += 1
                    log.debug(
                        "model %s: ledger %s: pool %d of its ended process %d retired "
                        "(%d bytes back in the budget)",
                        name,
                        path,
                        pool.slot,
                        pool.pid,
                        charge,
                    )
        finally:
            ledger.close()
    return retired


def wait_released(name: str, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for instance ``name``'s charge to reach zero; the charge then."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = read_kv(name)
        held = now.charged_bytes if now is not None else 0
        if held == 0 or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)
