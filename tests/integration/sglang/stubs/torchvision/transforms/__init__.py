"""Test-only stand-in for ``torchvision.transforms`` (see ``_stub.py``)."""

from torchvision._stub import InterpolationMode, module_getattr
from torchvision.transforms import functional  # noqa: F401

__all__ = ["InterpolationMode", "functional"]
__getattr__ = module_getattr(__name__)
