"""The budget of a process with no ledger: the driver's free memory."""

from __future__ import annotations

import threading
import time

from kvcached.driver.base import Driver
from kvcached.errors import ConfigError

_monotonic = time.monotonic


class DriverFreeBudget:
    """A :class:`PhysicalBudget` for one process with no ledger: the driver's
    free memory minus the safety margin ``total * (1 - utilization)``.

    The free figure is sampled at most every ``sample_interval_s`` (a
    ``mem_info`` call: about a microsecond on CUDA, a few ms on the host
    backend) and adjusted by this pool's own grants and refunds in between, so
    :meth:`headroom` is an attribute read on the hot path. It is an estimate:
    other processes' allocations show up only at the next sample, and a grant
    whose memory is not yet created when a sample is taken is counted twice
    until the next one. The per-GPU ledger is the exact, shared alternative.

    ``utilization`` and ``sample_interval_s`` left unset take the documented
    defaults of ``KVCACHED_GPU_UTILIZATION`` and
    ``KVCACHED_CALIBRATION_INTERVAL_S`` (the caller passes its configured ones).
    """

    def __init__(
        self,
        driver: Driver,
        *,
        utilization: float | None = None,
        sample_interval_s: float | None = None,
    ) -> None:
        from kvcached.config import defaults

        if utilization is None:
            utilization = defaults().gpu_utilization
        if not 0.0 < utilization <= 1.0:
            raise ConfigError("utilization", utilization, "a number in (0, 1], e.g. 0.95")
        if sample_interval_s is None:
            sample_interval_s = defaults().calibration_interval_s
        self._driver = driver
        self._utilization = utilization
        self._interval = sample_interval_s
        self._lock = threading.Lock()
        self._margin = 0
        self._base = 0  # free - margin at the last sample
        self._delta = 0  # refunds - grants since the last sample
        self._resample_at = 0.0  # monotonic time of the next sample
        self._closed = False
        self.sample()

    @property
    def margin(self) -> int:
        """Bytes of the device kept free: ``total * (1 - utilization)``."""
        return self._margin

    def sample(self) -> int:
        """Read the driver's free memory now; returns the new headroom."""
        free, total = self._driver.mem_info()
        with self._lock:
            self._margin = round(total * (1.0 - self._utilization))
            self._base = free - self._margin
            self._delta = 0
            self._resample_at = time.monotonic() + self._interval
            return max(0, self._base)

    def headroom(self) -> int:
        if _monotonic() > self._resample_at:
            return self.sample()
        room = self._base + self._delta
        return room if room > 0 else 0

    # grant and refund are on the growth path (one per extent, or per batch):
    # acquire/release costs half of a `with` block here.
    def grant(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"grant(nbytes={nbytes}): must be >= 0")
        if self._closed:
            return False
        if _monotonic() > self._resample_at:
            self.sample()
        lock = self._lock
        lock.acquire()
        try:
            if self._base + self._delta < nbytes:
                return False
            self._delta -= nbytes
            return True
        finally:
            lock.release()

    def refund(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"refund(nbytes={nbytes}): must be >= 0")
        lock = self._lock
        lock.acquire()
        try:
            self._delta += nbytes
        finally:
            lock.release()

    def flush(self) -> None:
        """Nothing is batched here."""

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return (
            f"<DriverFreeBudget headroom={self.headroom()} margin={self._margin} "
            f"utilization={self._utilization}>"
        )
