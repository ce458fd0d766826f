"""Skip marks of the GPU tests: each skips cleanly where there is no GPU.

On the GPU machine set ``KVCACHED_REQUIRE_GPU=1``: a test whose GPU is missing then
fails instead of skipping (``tests/conftest.py`` turns the mark into a failure), so
a GPU run cannot pass by skipping everything because the device was not seen.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_VARIABLE = "KVCACHED_REQUIRE_GPU"
#: The mark a missing-but-required GPU becomes; tests/conftest.py fails such a test.
MISSING_MARK = "kvcached_gpu_missing"


def gpu_required() -> bool:
    """Whether ``KVCACHED_REQUIRE_GPU`` asks for a GPU (1/true/yes/on)."""
    value = os.environ.get(REQUIRE_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{REQUIRE_VARIABLE}={value!r}: use 1 (a missing GPU fails) or 0")


def has_torch_gpu() -> bool:
    """A device torch can use (CUDA, or ROCm through torch.cuda)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


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


def gpu_mark(available: bool, reason: str) -> pytest.MarkDecorator:
    """Skip with ``reason`` where ``available`` is false, or fail there under
    ``KVCACHED_REQUIRE_GPU=1``."""
    if available:
        return pytest.mark.skipif(False, reason=reason)
    if gpu_required():
        return getattr(pytest.mark, MISSING_MARK)(f"{REQUIRE_VARIABLE}=1, but this test {reason}")
    return pytest.mark.skipif(True, reason=reason)


requires_torch_gpu = gpu_mark(has_torch_gpu(), "needs a GPU torch can use")
requires_cuda = gpu_mark(has_cuda(), "needs a CUDA device")
requires_cuda_driver = gpu_mark(
    has_cuda_driver(), "needs a CUDA device, torch with CUDA and cuda-python"
)
