"""Fixtures of the memory-layer tests (helpers live in kvmem_helpers.py)."""

from __future__ import annotations

import pytest
from kvmem_helpers import HOST_INDEX

from kvcached.driver.host import HostDriver
from kvcached.units import MIB


@pytest.fixture
def host():
    driver = HostDriver(HOST_INDEX, capacity=1024 * MIB)
    yield driver
    driver.close()
