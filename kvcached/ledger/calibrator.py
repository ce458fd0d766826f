"""A background thread that calibrates a ledger on a cadence, off the hot path.

Any process may run one; the ledger's calibrator lease makes sure only one
process samples at a time (the others' ticks come back ``busy`` and only
refresh their own pools' cached headroom). No driver call runs under the data
lock: the sample is taken before it is acquired.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvcached.log import get_logger

if TYPE_CHECKING:
    from kvcached.ledger.ledger import Calibration, Ledger, MemInfo

log = get_logger("kvcached.ledger")


class Calibrator:
    """Calls :meth:`Ledger.calibrate` every ``interval_s`` seconds (default
    ``KVCACHED_CALIBRATION_INTERVAL_S``) in a daemon thread.

    :meth:`start` and :meth:`stop` may be called from any thread; :meth:`stop`
    is idempotent and waits for the thread to end. A failing sample (a driver
    error) is logged, at most once a minute, and retried on the next tick.
    """

    def __init__(self, ledger: Ledger, sampler: MemInfo, interval_s: float | None = None) -> None:
        if interval_s is None:
            from kvcached.config import get_config

            interval_s = get_config().calibration_interval_s
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
