"""kvcached.driver.tensor.device_tensor, on memory the CPU can reach (the GPU
routes run in tests/gpu/test_cuda_driver.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvcached.driver.tensor import device_tensor, view_as


def test_storage_route_aliases_without_copying():
    buf = (ctypes.c_uint8 * 4096)()
    va = ctypes.addressof(buf)
    raw = device_tensor(va, 4096, torch.device("cpu"), via="storage")
    assert raw.dtype == torch.uint8 and raw.shape == (4096,) and raw.data_ptr() == va
    view_as(raw, torch.int32, (16, 64)).fill_(0x01020304)
    assert bytes(buf[:4]) == b"\x04\x03\x02\x01"
    buf[4095] = 7
    assert raw[4095].item() == 7


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nbytes=0"):
        device_tensor(4096, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="via='dlpack'"):
        device_tensor(4096, 16, torch.device("cpu"), via="dlpack")
