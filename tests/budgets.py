"""The physical budget the CPU tests share: a fixed capacity, exact accounting."""

from __future__ import annotations

import threading


class ExactBudget:
    """A PhysicalBudget with a fixed capacity and exact accounting, so tests can
    assert that every grant is matched by a refund after a confirmed release."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.grants = 0
        self.denials = 0
        self.flushes = 0
        self.closed = False
        self._lock = threading.Lock()

    def grant(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.capacity:
                self.denials += 1
                return False
            self.used += nbytes
            self.grants += 1
            return True

    def refund(self, nbytes: int) -> None:
        with self._lock:
            assert 0 < nbytes <= self.used, f"refund of {nbytes} with {self.used} charged"
            self.used -= nbytes

    def headroom(self) -> int:
        return self.capacity - self.used

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True
