"""Tensors over driver memory: typed views of the raw ``uint8`` tensors a
driver hands out, and the one way a device VA becomes a torch tensor."""

from __future__ import annotations

import importlib.util
import math

import torch


def view_as(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
            offset: int = 0) -> torch.Tensor:
    """View ``raw`` (1-D ``uint8``, from :meth:`Driver.tensor`) starting at byte
    ``offset`` as a contiguous tensor of ``dtype`` and ``shape``. No copy: writes
    through the view land in the same memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if offset % itemsize:
        raise ValueError(f"offset={offset} is not a multiple of {dtype}'s size ({itemsize})")
    if offset < 0 or offset + nbytes > raw.numel():
        raise ValueError(
            f"a {dtype} tensor of shape {tuple(shape)} at byte {offset} needs "
            f"{offset + nbytes} bytes; the range has {raw.numel()}"
        )
    return raw[offset:offset + nbytes].view(dtype).view(shape)


class CudaArray:
    """A bare ``__cuda_array_interface__`` (v3) over ``nbytes`` of device memory
    at ``va``: what torch needs to wrap a VA without copying. torch keeps a
    reference to it for the tensor's life."""

    __slots__ = ("va", "nbytes")

    def __init__(self, va: int, nbytes: int) -> None:
        self.va = va
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.va, False),
            "strides": None,
            "stream": None,  # nothing to wait for: kvcached writes no data itself
            "version": 3,
        }


_numpy_present: bool | None = None


def _has_numpy() -> bool:
    global _numpy_present
    if _numpy_present is None:
        _numpy_present = importlib.util.find_spec("numpy") is not None
    return _numpy_present


def device_tensor(va: int, nbytes: int, device: torch.device, *,
                  via: str | None = None) -> torch.Tensor:
    """A 1-D ``uint8`` tensor on ``device`` (a CUDA or ROCm device) aliasing
    ``[va, va+nbytes)``, without copying.

    The documented route is ``__cuda_array_interface__`` (``torch.as_tensor``),
    but torch parses that interface with NumPy, which torch does not require;
    without NumPy the tensor is built on a non-owning storage
    (``torch._C._construct_storage_from_data_pointer``). ``via`` forces one
    route (``"cai"`` or ``"storage"``; tests use it to cover both). The driver,
    not the tensor, owns the memory: keep the mapping until the tensor is gone.
    """
    if nbytes <= 0:
        raise ValueError(f"tensor(nbytes={nbytes}): needs at least one byte")
    if via is None:
        via = "cai" if _has_numpy() else "storage"
    if via == "cai":
        tensor = torch.as_tensor(CudaArray(va, nbytes), device=device)
    elif via == "storage":
        storage = torch._C._construct_storage_from_data_pointer(va, device, nbytes)
        tensor = torch.empty(0, dtype=torch.uint8, device=device)
        tensor.set_(storage, 0, (nbytes,), (1,))
    else:
        raise ValueError(f"via={via!r}: must be 'cai', 'storage' or None")
    # torch.as_tensor copies silently when it places the pointer on another device.
    assert tensor.data_ptr() == va and tensor.device == device, (
        f"a tensor over {va:#x} must alias it on {device}; torch gave "
        f"{tensor.data_ptr():#x} on {tensor.device}"
    )
    return tensor
