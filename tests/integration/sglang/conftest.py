"""SGLang tests: make ``sglang.srt`` importable on the CPU test machines.

``sglang.srt.configs`` imports torchvision at module level (for vision models
these tests never build). PyPI's torchvision does not load beside the torch
2.13.0 CPU wheel, so where SGLang is installed and torchvision does not import,
the test-only stand-in in ``stubs/`` goes first on ``sys.path``. It is added
only then: an environment without SGLang (the vLLM one) never sees it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

STUBS = Path(__file__).resolve().parent / "stubs"


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
