"""A background thread that calibrates a ledger on a cadence, off the hot path.

Any process may run one; the ledger's calibrator lease makes sure only one
process samples at a time (the others' ticks come back ``busy`` and only
refresh their own pools' cached headroom). No driver call runs under the data
lock: the sample is taken before it is acquired.

What a calibration returns (:class:`Calibration`) and what it samples
(:class:`MemInfo`) are defined here, and the ledger is known only by what the
thread calls (:class:`Calibrated`), so this module does not import
:mod:`kvcached.ledger.calibration`, which starts the thread and holds what
one calibration does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from kvcached.log import get_logger

log = get_logger("kvcached.ledger")


class MemInfo(Protocol):
    """Anything that reports a device's free memory: every :class:`~kvcached.driver.Driver`."""

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes."""
        ...


@dataclass(frozen=True)
class Calibration:
    """What one :meth:`~kvcached.ledger.ledger.Ledger.calibrate` call did."""

    published: bool
    #: "published", "busy" (another calibrator holds the lease), "stale" (a newer
    #: sample was published first) or "locked" (the data lock stayed held)
    reason: str
    retired: int = 0
    budget: int = 0
    free: int = 0
    charged: int = 0
    seq: int = 0


class Calibrated(Protocol):
    """What the thread calls on its ledger (:class:`~kvcached.ledger.ledger.Ledger` is one)."""

    path: str
    device_id: str
    closed: bool

    def calibrate(self, sampler: MemInfo | None = None) -> Calibration: ...

    def refresh_pools(self) -> None: ...


class Calibrator:
    """Calls ``ledger.calibrate()`` every ``interval_s`` seconds (the caller's
    ``KVCACHED_CALIBRATION_INTERVAL_S``; unset: its documented default) in a
    daemon thread.

    :meth:`start` and :meth:`stop` may be called from any thread; :meth:`stop`
    is idempotent and waits for the thread to end. A failing sample (a driver
    error) is logged, at most once a minute, and retried on the next tick.
    """

    def __init__(
        self, ledger: Calibrated, sampler: MemInfo, interval_s: float | None = None
    ) -> None:
        if interval_s is None:
            from kvcached.config import defaults

            interval_s = defaults().calibration_interval_s
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r}: must be a number of seconds above 0")
        self.ledger = ledger
        self.sampler = sampler
        self.interval_s = float(interval_s)
        self.ticks = 0
        self.published = 0
        self.last: Calibration | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_error_log = 0.0

    def start(self) -> Calibrator:
        with self._lock:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run,
                    name=f"kvcached-calibrator:{self.ledger.device_id}",
                    daemon=True,
                )
                self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def tick(self) -> Calibration | None:
        """One calibration attempt, then a refresh of this process' pools."""
        self.ticks += 1
        result = None
        try:
            result = self.ledger.calibrate(self.sampler)
            if result.published:
                self.published += 1
            else:
                self.ledger.refresh_pools()
            self.last = result
        except Exception as exc:
            if self.ledger.closed:
                self._stop.set()
                return None
            now = time.monotonic()
            if now - self._last_error_log > 60.0:
                self._last_error_log = now
                log.warning(
                    "ledger %s: calibration failed, retrying every %.2g s: %s",
                    self.ledger.path,
                    self.interval_s,
                    exc,
                )
        return result

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            if self._stop.wait(self.interval_s):
                break

    def __enter__(self) -> Calibrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
