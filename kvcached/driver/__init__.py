"""The driver layer: the only code in kvcached that talks to a device.

:func:`get_driver` returns the process-wide driver of one device, chosen by
``KVCACHED_DRIVER`` (``auto``: CUDA when a CUDA device is present, HIP on a
ROCm build of torch, else the ``host`` backend).
"""

from __future__ import annotations

import threading

from kvcached.driver.base import DeviceInfo, Driver, Handle

__all__ = [
    "DeviceInfo",
    "Driver",
    "Handle",
    "default_driver",
    "get_driver",
    "resolve_backend",
    "make_driver",
]

_lock = threading.Lock()
_drivers: dict[tuple[str, int], Driver] = {}


def resolve_backend(name: str | None = None) -> str:
    """``cuda``, ``hip`` or ``host`` for ``name`` (default ``KVCACHED_DRIVER``)."""
    from kvcached.config import get_config

    name = (name or get_config().driver).lower()
    if name != "auto":
        return name
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip"
    if torch.version.cuda and torch.cuda.is_available():
        return "cuda"
    return "host"


def default_driver(backend: str | None = None) -> Driver:
    """The process' default device on ``backend`` (default ``KVCACHED_DRIVER``):
    ``host-N`` with N = ``KVCACHED_HOST_DEVICE`` on the host backend, device 0
    on a GPU (an engine passes its own device)."""
    from kvcached.config import get_config

    backend = resolve_backend(backend)
    return get_driver(get_config().host_device if backend == "host" else 0, backend)


def make_driver(backend: str, index: int = 0) -> Driver:
    """A new driver object (tests; everything else shares :func:`get_driver`)."""
    from kvcached.config import get_config

    if backend == "host":
        from kvcached.driver.host import HostDriver

        return HostDriver(index, capacity=get_config().host_capacity)
    if backend == "cuda":
        from kvcached.driver.cuda import CudaDriver

        return CudaDriver(index)
    if backend == "hip":
        from kvcached.driver.hip import HipDriver

        return HipDriver(index)
    raise ValueError(f"backend={backend!r}: must be one of cuda, hip, host")


def get_driver(index: int = 0, backend: str | None = None) -> Driver:
    """The shared driver of device ``index`` on ``backend`` (default: resolved
    from ``KVCACHED_DRIVER``)."""
    backend = resolve_backend(backend)
    key = (backend, index)
    with _lock:
        driver = _drivers.get(key)
        if driver is None:
            driver = _drivers[key] = make_driver(backend, index)
        return driver
