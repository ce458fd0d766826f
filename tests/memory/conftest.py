"""Fixtures of the memory-layer tests (helpers live in kvmem_helpers.py)."""

from __future__ import annotations

import pytest

from kvcached.driver.host import HostDriver
from kvcached.units import MIB


@pytest.fixture
def host():
    driver = HostDriver(0, capacity=1024 * MIB)
    yield driver
    driver.close()
