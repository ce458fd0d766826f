"""Test-only stand-in for ``torchvision.transforms.functional`` (see ``_stub.py``)."""

from torchvision._stub import InterpolationMode, module_getattr

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr(__name__)
