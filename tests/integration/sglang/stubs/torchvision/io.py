"""Test-only stand-in for ``torchvision.io`` (see ``_stub.py``)."""

from torchvision._stub import module_getattr

__getattr__ = module_getattr(__name__)
