"""SGLang tests: make ``sglang.srt`` importable on the CPU test machines.

``sglang.srt.configs`` imports torchvision at module level (for vision models
these tests never build). PyPI's torchvision does not load beside the torch
2.13.0 CPU wheel, so the SGLang venvs leave it out and run these tests with the
test-only stand-in ``stubs/`` first on ``PYTHONPATH`` (``ci_run.sh`` and
``tests/compat/run.sh`` set it; by hand:
``PYTHONPATH=tests/integration/sglang/stubs python -m pytest tests/integration/sglang``).
Through the environment, every child a test starts sees it too, and an environment
without SGLang (the vLLM one) never does. Without it, ``import sglang`` fails and
tests/engines.py skips (or, where SGLang is required, fails) saying so.

SGLang 0.5.17, 0.5.20 and 0.5.21's paged allocator has no torch path: it always
launches its Triton kernels, which no CPU device runs. There Triton's
interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined, so before
SGLang is imported) runs those same kernels on CPU tensors, for SGLang's class
and kvcached's alike; child interpreters inherit it.
"""

from __future__ import annotations

import os
from importlib import metadata

TRITON_ONLY = ("0.5.17", "0.5.20", "0.5.21")


def _sglang_release() -> str | None:
    try:
        return metadata.version("sglang").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


if _sglang_release() in TRITON_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
