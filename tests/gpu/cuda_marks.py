"""Skip marks of the GPU tests: each skips cleanly where there is no GPU."""

from __future__ import annotations

import pytest


def has_cuda() -> bool:
    """A CUDA device that torch (a CUDA build) can use."""
    try:
        import torch

        return bool(torch.version.cuda) and torch.cuda.is_available()
    except Exception:
        return False


def has_cuda_driver() -> bool:
    """A device torch can use, and cuda-python for kvcached's own driver calls."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


requires_cuda = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA device")
requires_cuda_driver = pytest.mark.skipif(
    not has_cuda_driver(), reason="needs a CUDA device, torch with CUDA and cuda-python")
