"""The driver layer: the only code in kvcached that talks to a device.

:func:`get_driver` returns the process-wide driver of one device, on the
backend its caller names or the one ``config.driver`` names (``auto``: CUDA
when a CUDA device is present, HIP on a ROCm build of torch, else the ``host``
backend). This layer reads no environment: the entry point that parsed
``KVCACHED_*`` (:func:`kvcached.config.get_config`) passes its
:class:`~kvcached.config.Config` in; without one, the documented defaults apply.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvcached.driver.base import DeviceInfo, Driver, Handle

if TYPE_CHECKING:
    from kvcached.config import Config

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


def _settings(config: Config | None) -> Config:
    from kvcached.config import defaults

    return defaults() if config is None else config


def resolve_backend(name: str | None = None, *, config: Config | None = None) -> str:
    """``cuda``, ``hip`` or ``host`` for ``name`` (default ``config.driver``)."""
    name = (name or _settings(config).driver).lower()
    if name != "auto":
        return name
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip"
    if torch.version.cuda and torch.cuda.is_available():
        return "cuda"
    return "host"


def default_driver(backend: str | None = None, *, config: Config | None = None) -> Driver:
    """The process' default device on ``backend`` (default ``config.driver``):
    ``host-N`` with N = ``config.host_device`` on the host backend, device 0
    on a GPU (an engine passes its own device)."""
    settings = _settings(config)
    backend = resolve_backend(backend, config=settings)
    return get_driver(settings.host_device if backend == "host" else 0, backend, config=settings)


def make_driver(backend: str, index: int = 0, *, config: Config | None = None) -> Driver:
    """A new driver object (tests; everything else shares :func:`get_driver`).
    The host backend's capacity is ``config.host_capacity``."""
    if backend == "host":
        from kvcached.driver.host import HostDriver

        return HostDriver(index, capacity=_settings(config).host_capacity)
    if backend == "cuda":
        from kvcached.driver.cuda import CudaDriver

        return CudaDriver(index)
    if backend == "hip":
        from kvcached.driver.hip import HipDriver

        return HipDriver(index)
    raise ValueError(f"backend={backend!r}: must be one of cuda, hip, host")


def get_driver(
    index: int = 0, backend: str | None = None, *, config: Config | None = None
) -> Driver:
    """The shared driver of device ``index`` on ``backend`` (default: resolved
    from ``config.driver``). The first call for a device makes its driver, with
    that call's ``config`` (the host backend's capacity)."""
    backend = resolve_backend(backend, config=config)
    key = (backend, index)
    with _lock:
        driver = _drivers.get(key)
        if driver is None:
            driver = _drivers[key] = make_driver(backend, index, config=config)
        return driver
