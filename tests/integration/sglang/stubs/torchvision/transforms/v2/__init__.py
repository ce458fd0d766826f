"""Test-only stand-in for ``torchvision.transforms.v2`` (see ``_stub.py``)."""

from torchvision._stub import InterpolationMode, module_getattr
from torchvision.transforms.v2 import functional  # noqa: F401

__all__ = ["InterpolationMode", "functional"]
__getattr__ = module_getattr(__name__)
