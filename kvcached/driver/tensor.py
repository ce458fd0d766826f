"""Typed views of the raw ``uint8`` tensors a driver hands out over its VA."""

from __future__ import annotations

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
