"""Shared pieces of the test-only ``torchvision`` stand-in.

PyPI's torchvision does not load beside the torch 2.13.0 CPU wheel these tests
use ("operator torchvision::nms does not exist"), yet ``sglang.srt.configs``
imports it at module level for vision models these tests never build. This
stand-in lets those imports succeed; anything actually *called* raises, so a
test that strays into image code fails loudly instead of computing nonsense.

Only the SGLang test runs put the ``stubs`` folder on ``PYTHONPATH``
(tests/integration/sglang/conftest.py says where): it never reaches a user's
environment.
"""

from __future__ import annotations

import enum
from typing import Any

STUB_VERSION = "0.0.0+kvcached.test.stub"


class InterpolationMode(enum.Enum):
    """The names of torchvision's enum (SGLang reads them at import time)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class Unavailable:
    """A name from torchvision that exists for import but fails when used."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._qualname} comes from the kvcached test stub of torchvision; "
            "the SGLang tests must not run image code"
        )

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<kvcached torchvision stub {self._qualname}>"


def module_getattr(module_name: str):
    """A module-level ``__getattr__`` handing out :class:`Unavailable` names."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return Unavailable(f"{module_name}.{name}")

    return __getattr__
