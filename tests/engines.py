"""Engine availability for tests: skip where an engine is absent, fail in CI.

Engine tests (vLLM, SGLang) run where the engine is installed and skip with a
reason elsewhere. ``KVCACHED_REQUIRE_ENGINES`` turns that skip into a failure,
so a CI job that installed an engine cannot pass by silently skipping its
tests:

* ``1`` / ``true`` / ``all``: every engine asked for must import;
* a comma list (``sglang`` or ``vllm,sglang``): those engines must import.

This variable is read here and not in ``kvcached.config`` because it steers the
test suite, not kvcached.

Use at the top of a test module::

    from tests.engines import require_engine

    sglang = require_engine("sglang")          # the imported module
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

REQUIRE_VARIABLE = "KVCACHED_REQUIRE_ENGINES"
_ALL = {"1", "true", "yes", "on", "all"}
_NONE = {"", "0", "false", "no", "off"}


def required_engines(value: str | None = None) -> frozenset[str] | None:
    """The engines ``KVCACHED_REQUIRE_ENGINES`` requires: ``None`` for all,
    an empty set for none."""
    text = (os.environ.get(REQUIRE_VARIABLE, "") if value is None else value).strip().lower()
    if text in _ALL:
        return None
    if text in _NONE:
        return frozenset()
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def engine_required(name: str) -> bool:
    """Whether a missing ``name`` must fail rather than skip."""
    required = required_engines()
    return required is None or name in required


def require_engine(name: str, module: str | None = None) -> ModuleType:
    """Import engine ``name`` (the module ``module``, default ``name``) for a test.

    Returns the module. When it cannot be imported: skips the calling test
    module (or test) with the reason, or fails it when the engine is required
    by ``KVCACHED_REQUIRE_ENGINES``.
    """
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"name={name!r}: an engine name such as 'sglang' or 'vllm'")
    target = module or name
    if importlib.util.find_spec(name) is None:
        reason = f"{name} is not installed in this environment ({_interpreter()})"
    else:
        try:
            return importlib.import_module(target)
        except Exception as exc:  # an installed engine that does not import
            reason = f"{name} is installed but `import {target}` failed: {type(exc).__name__}: {exc}"
    if engine_required(name):
        pytest.fail(f"{REQUIRE_VARIABLE} requires {name}: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
    raise AssertionError("unreachable: pytest.skip raises")


def _interpreter() -> str:
    import sys

    return sys.executable
