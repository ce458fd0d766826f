"""Two host devices standing in for two GPUs: per-device ledgers, growth
charged to its own device only, and a TP=2 pair agreeing on one admission
under a limit on one device (gloo). The same scenarios run on two real GPUs in
``tests/gpu/test_multi_gpu.py``; see ``tests/gpu/multi_device_cases.py``.
"""

from __future__ import annotations

import pytest

from tests.control.kvctl_helpers import unique_index
from tests.gpu.multi_device_cases import HOST_SLACK, tp_pair_agrees, two_devices_grow_and_shrink

pytestmark = pytest.mark.slow

CAPACITY = 512 << 20


def test_two_host_devices_keep_their_own_ledgers(tmp_path):
    first = unique_index()
    two_devices_grow_and_shrink("host", (first, first + 1), CAPACITY, str(tmp_path), HOST_SLACK)


def test_tp_pair_over_gloo_admits_the_same_batches_under_a_one_device_limit(tmp_path):
    report = tp_pair_agrees(
        "host", unique_index(), "gloo", str(tmp_path), str(tmp_path / "tp.json")
    )
    assert report["dist_backend"] == "gloo"
