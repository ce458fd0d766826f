"""Test-only stand-in for torchvision (see ``_stub.py``)."""

from torchvision import io, transforms  # noqa: F401  (submodules SGLang reaches as attributes)
from torchvision._stub import STUB_VERSION, module_getattr

__version__ = STUB_VERSION
__getattr__ = module_getattr(__name__)
