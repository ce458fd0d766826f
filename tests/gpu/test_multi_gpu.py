"""Two GPUs: one ledger per GPU, device selection, and TP agreement (the
``nvidia-h200-x2`` machine; never in CI).

* two processes, one per GPU, each growing and shrinking a KV cache with data
  checks; each GPU's ledger file is its own (keyed by PCI bus id) and charges
  only its own GPU's memory, checked against ``cuMemGetInfo`` on each GPU;
  ``kvctl gpus`` shows both;
* ``CUDA_VISIBLE_DEVICES=1`` makes device 0 of a process the second GPU: its
  bus id and its ledger are that GPU's;
* a TP=2 pair over NCCL and over gloo (``torch.distributed``, one process per
  GPU) runs the integrations' admission agreement; under a limit on one GPU
  both ranks admit the same batches.

The same scenarios run on two host devices in CI
(``tests/control/test_multi_device_host.py``). Run:
``KVCACHED_REQUIRE_GPU=1 python -m pytest tests/gpu/test_multi_gpu.py -m gpu -v``
(NVLink multicast stays off: the workers set ``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.multi_device_cases import (
    GPU_SLACK,
    Worker,
    tp_pair_agrees,
    two_devices_grow_and_shrink,
    worker_env,
)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


_REQUIRED = os.environ.get("KVCACHED_REQUIRE_GPU", "") == "1"
if _gpu_count() < 2 and not _REQUIRED:
    pytest.skip(
        "needs two CUDA devices (KVCACHED_REQUIRE_GPU=1 makes this a failure)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.gpu]

CAPACITY = 4 << 30


def test_at_least_two_gpus():
    assert _gpu_count() >= 2, "KVCACHED_REQUIRE_GPU=1: this test needs two CUDA devices"


def test_two_gpus_keep_their_own_ledgers(tmp_path):
    two_devices_grow_and_shrink("cuda", (0, 1), CAPACITY, str(tmp_path), GPU_SLACK)


def test_cuda_visible_devices_selects_the_second_gpu(tmp_path):
    ledger_dir = str(tmp_path)
    both = Worker("cuda", 1, CAPACITY, worker_env(ledger_dir, "visible-all"))
    try:
        second_bus_id = both.ready["bus_id"]
    finally:
        assert both.close() == 0
    only = Worker(
        "cuda", 0, CAPACITY, worker_env(ledger_dir, "visible-1", CUDA_VISIBLE_DEVICES="1")
    )
    try:
        assert only.ready["bus_id"] == second_bus_id
        assert only.ready["ledger"].endswith(second_bus_id)
        assert only.ready["torch_device"] == "cuda:0"
    finally:
        assert only.close() == 0


@pytest.mark.parametrize("dist_backend", ["nccl", "gloo"])
def test_tp_pair_admits_the_same_batches_under_a_one_gpu_limit(tmp_path, dist_backend):
    report = tp_pair_agrees("cuda", 0, dist_backend, str(tmp_path), str(tmp_path / "tp.json"))
    out = os.environ.get("OUT")
    if out:
        import json

        with open(os.path.join(out, f"tp-{dist_backend}.json"), "w") as f:
            json.dump(report, f, indent=1)
