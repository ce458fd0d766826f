"""Tensors over driver memory: typed views of the raw ``uint8`` tensors a
driver hands out, and the one way a device VA becomes a torch tensor."""

from __future__ import annotations

import importlib.util
import math

import torch


def view_as(
    raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0
) -> torch.Tensor:
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
    return raw[offset : offset + nbytes].view(dtype).view(shape)


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


def _has_storage_route() -> bool:
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def device_tensor(
    va: int, nbytes: int, device: torch.device, *, via: str | None = None
) -> torch.Tensor:
    """A 1-D ``uint8`` tensor on ``device`` (a CUDA or ROCm device) aliasing
    ``[va, va+nbytes)``, without copying.

    Two routes, chosen by ``via`` (tests cover both):

    * ``"storage"`` (the default where torch has it, 2.1+): a non-owning storage
      on ``device`` over the pointer (``torch._C._construct_storage_from_data_pointer``,
      what torch's CUDA-graph trees use). The device is given, not looked up, so
      the range may be reserved but not yet mapped, which is how KV tensors are
      made; and it needs no NumPy.
    * ``"cai"``: ``torch.as_tensor`` over a ``__cuda_array_interface__``. Torch
      parses that with NumPy and asks the driver which device owns the pointer,
      so the first byte must already be mapped; if the answer were another
      device it would copy, which the check below turns into an error.

    The driver, not the tensor, owns the memory: keep the mapping while a
    kernel may touch the tensor.
    """
    if nbytes <= 0:
        raise ValueError(f"tensor(nbytes={nbytes}): needs at least one byte")
    if via is None:
        via = "storage" if _has_storage_route() else "cai"
    if via == "storage":
        storage = torch._C._construct_storage_from_data_pointer(va, device, nbytes)
        tensor = torch.empty(0, dtype=torch.uint8, device=device)
        tensor.set_(storage, 0, (nbytes,), (1,))
    elif via == "cai":
        if importlib.util.find_spec("numpy") is None:
            raise RuntimeError(
                "this torch has no _construct_storage_from_data_pointer, and its "
                "__cuda_array_interface__ reader needs NumPy: pip install numpy"
            )
        tensor = torch.as_tensor(CudaArray(va, nbytes), device=device)
    else:
        raise ValueError(f"via={via!r}: must be 'storage', 'cai' or None")
    # torch.as_tensor copies silently when it places the pointer on another device.
    assert tensor.data_ptr() == va and tensor.device == device, (
        f"a tensor over {va:#x} must alias it on {device}; torch gave "
        f"{tensor.data_ptr():#x} on {tensor.device}"
    )
    return tensor
