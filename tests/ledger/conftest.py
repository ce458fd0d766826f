"""Fixtures of the ledger tests: a private ledger directory and a fake device."""

from __future__ import annotations

import fcntl
import os

import pytest

from kvcached.ledger import Ledger, _hooks
from kvcached.units import GIB


class FakeDevice:
    """A device reduced to what calibration reads: ``mem_info() -> (free, total)``."""

    def __init__(self, free: int = 8 * GIB, total: int = 10 * GIB) -> None:
        self.free = free
        self.total = total
        self.samples = 0

    def mem_info(self) -> tuple[int, int]:
        self.samples += 1
        return self.free, self.total


@pytest.fixture
def ledger_dir(tmp_path) -> str:
    path = tmp_path / "ledger"
    path.mkdir()
    return str(path)


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice()


@pytest.fixture
def ledger(ledger_dir, device):
    """A fresh ledger: budget 7 GiB (8 GiB free - 10% of 10 GiB), margin 1 GiB."""
    led = Ledger.open("fake-0", device, directory=ledger_dir, gpu_utilization=0.9)
    yield led
    led.close()


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    _hooks.point = None


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def is_root() -> bool:
    return os.geteuid() == 0


def data_lock_is_free(fd: int) -> bool:
    """Whether the data lock (a whole-file flock) can be taken through ``fd``, a
    descriptor of the ledger file opened by the test (its own description)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True
