"""A fault-injecting wrapper over any backend, for tests.

It speaks the real language: failures are raised with the real call names of
the wrapped backend (``cuMemCreate`` on CUDA, ``memfd_create`` on the host) and
real status names (``CUDA_ERROR_OUT_OF_MEMORY``), so code written against
CUDA's errors handles them unchanged. An injected failure is raised *before*
the wrapped call runs, so the device is exactly as it was: no half-made
handle, no half-mapped range.

Failures are chosen by call count (``fail_nth={"map": 3}``: the 3rd map fails),
by an explicit schedule (``fail_calls={"unmap": {2, 5}}``), or at random with a
seeded probability (``probability={"create": 0.1}``, ``seed=7``). ``delay_s``
adds latency to chosen calls. One ``unmap_range`` over K mappings counts as
K unmaps and fails whole if any of them is chosen.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from kvcached.driver.base import DeviceInfo, Driver, Handle
from kvcached.errors import DriverError, OutOfPhysicalMemoryError

CALLS = ("reserve", "free_reservation", "create", "release", "map", "set_access", "unmap")

# call -> (cuda name, cuda status, code), (host name, host status, code)
_NAMES = {
    "reserve": (("cuMemAddressReserve", "CUDA_ERROR_OUT_OF_MEMORY", 2), ("mmap", "ENOMEM", 12)),
    "free_reservation": (
        ("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", 1),
        ("munmap", "EINVAL", 22),
    ),
    "create": (("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", 2), ("memfd_create", "ENOMEM", 12)),
    "release": (("cuMemRelease", "CUDA_ERROR_INVALID_VALUE", 1), ("close", "EIO", 5)),
    "map": (("cuMemMap", "CUDA_ERROR_OUT_OF_MEMORY", 2), ("mmap", "ENOMEM", 12)),
    "set_access": (("cuMemSetAccess", "CUDA_ERROR_OUT_OF_MEMORY", 2), ("mprotect", "ENOMEM", 12)),
    "unmap": (("cuMemUnmap", "CUDA_ERROR_ILLEGAL_STATE", 401), ("mmap", "EINVAL", 22)),
}


class InjectedFault:
    """Marker mixed into injected errors so tests can tell them from real ones."""


class InjectedDriverError(DriverError, InjectedFault):
    pass


class InjectedOutOfMemoryError(OutOfPhysicalMemoryError, InjectedFault):
    pass


class FaultyDriver(Driver):
    """Wraps ``inner``; every call counts, and the chosen ones fail or wait."""

    def __init__(
        self,
        inner: Driver,
        *,
        fail_nth: Mapping[str, int | Iterable[int]] | None = None,
        probability: Mapping[str, float] | None = None,
        seed: int = 0,
        delay_s: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(inner.index)
        self.inner = inner
        self.backend = inner.backend  # type: ignore[misc]
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._fail_at: dict[str, set[int]] = {}
        for call, nth in (fail_nth or {}).items():
            self._check_call(call)
            self._fail_at[call] = {nth} if isinstance(nth, int) else set(nth)
        self._probability = dict(probability or {})
        for call in self._probability:
            self._check_call(call)
        self._delay = dict(delay_s or {})
        for call in self._delay:
            self._check_call(call)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.enabled = True

    # -- control ---------------------------------------------------------------------
    def fail_next(self, call: str, count: int = 1) -> None:
        """Make the next ``count`` calls of ``call`` fail."""
        self._check_call(call)
        with self._lock:
            done = self.calls[call]
            self._fail_at.setdefault(call, set()).update(range(done + 1, done + 1 + count))

    def set_probability(self, call: str, p: float) -> None:
        self._check_call(call)
        with self._lock:
            self._probability[call] = p

    def heal(self) -> None:
        """Stop injecting anything (calls are still counted)."""
        with self._lock:
            self._fail_at.clear()
            self._probability.clear()
            self._delay.clear()

    # -- the wrapped calls -------------------------------------------------------------
    def _before(self, call: str, count: int = 1) -> None:
        with self._lock:
            first = self.calls[call] + 1
            self.calls[call] += count
            n = self.calls[call]
            fail = False
            if self.enabled:
                fail_at, p = self._fail_at.get(call, ()), self._probability.get(call, 0.0)
                for k in range(first, n + 1):
                    if k in fail_at or self._random.random() < p:
                        fail, n = True, k
                        break
            if fail:
                self.injected[call] += 1
        delay = self._delay.get(call)
        if delay:
            time.sleep(delay)
        if fail:
            cuda, host = _NAMES[call]
            name, status, code = cuda if self.inner.backend in ("cuda", "hip") else host
            if status in ("CUDA_ERROR_OUT_OF_MEMORY", "ENOMEM"):
                raise InjectedOutOfMemoryError(name, code, status, f"injected fault #{n} of {call}")
            raise InjectedDriverError(name, code, status, f"injected fault #{n} of {call}")

    @property
    def granularity(self) -> int:
        return self.inner.granularity

    @property
    def torch_device(self) -> torch.device:
        return self.inner.torch_device

    def info(self) -> DeviceInfo:
        return self.inner.info()

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()

    def reserve(self, size: int) -> int:
        self._before("reserve")
        return self.inner.reserve(size)

    def free_reservation(self, va: int, size: int) -> None:
        self._before("free_reservation")
        self.inner.free_reservation(va, size)

    def create(self, size: int) -> Handle:
        self._before("create")
        return self.inner.create(size)

    def release(self, handle: Handle) -> None:
        self._before("release")
        self.inner.release(handle)

    def map(self, va: int, size: int, handle: Handle) -> None:
        self._before("map")
        self.inner.map(va, size, handle)

    def set_access(self, va: int, size: int) -> None:
        self._before("set_access")
        self.inner.set_access(va, size)

    def unmap(self, va: int, size: int) -> None:
        self._before("unmap")
        self.inner.unmap(va, size)

    def unmap_range(self, va: int, size: int, count: int) -> None:
        """Counts as ``count`` unmaps and fails, before anything is unmapped,
        when any of them is chosen to fail (the one call is all or nothing)."""
        self._before("unmap", count)
        self.inner.unmap_range(va, size, count)

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return self.inner.tensor(va, nbytes)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # backend extras (own_bytes, capacity, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @staticmethod
    def _check_call(call: str) -> None:
        if call not in CALLS:
            raise ValueError(f"fault call {call!r} is not one of {', '.join(CALLS)}")
