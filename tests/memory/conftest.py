"""Fixtures of the memory-layer tests (helpers live in kvmem_helpers.py)."""

from __future__ import annotations

import pytest

from kvcached.driver.host import HostDriver
from kvcached.units import MIB
from tests.memory.kvmem_helpers import HOST_INDEX


@pytest.fixture
def host():
    driver = HostDriver(HOST_INDEX, capacity=1024 * MIB)
    yield driver
    driver.close()
