"""SGLang tests: make ``sglang.srt`` importable on the CPU test machines.

``sglang.srt.configs`` imports torchvision at module level (for vision models
these tests never build). PyPI's torchvision does not load beside the torch
2.13.0 CPU wheel, so where SGLang is installed and torchvision does not import,
the test-only stand-in in ``stubs/`` goes first on ``sys.path``. It is added
only then: an environment without SGLang (the vLLM one) never sees it.

SGLang 0.5.17, 0.5.20 and 0.5.21's paged allocator has no torch path: it always
launches its Triton kernels, which no CPU device runs. There Triton's
interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined, so before
SGLang is imported) runs those same kernels on CPU tensors, for SGLang's class
and kvcached's alike; child interpreters inherit it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

STUBS = Path(__file__).resolve().parent / "stubs"
TRITON_ONLY = ("0.5.17", "0.5.20", "0.5.21")


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    # In a child: a torchvision that fails half-way leaves torch's operator
    # registry half-written in the process that tried.
    probe = subprocess.run(
        [sys.executable, "-c", "import torchvision"],
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


if importlib.util.find_spec("sglang") is not None and not _torchvision_imports():
    sys.path.insert(0, str(STUBS))


def _sglang_release() -> str | None:
    try:
        return metadata.version("sglang").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


if _sglang_release() in TRITON_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
