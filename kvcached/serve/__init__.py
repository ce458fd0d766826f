"""``kvcached serve``: an OpenAI-compatible front door for several models on one GPU.

It starts each configured engine (vLLM, SGLang, or any HTTP command) as a
supervised child with kvcached enabled, routes requests to them by model name,
puts idle models to sleep and wakes them on request. Engines are reached over
HTTP and kvcached instances through :mod:`kvcached.control`; no engine is
imported. Needs the ``serve`` extra (aiohttp, PyYAML: ``pip install ".[serve]"`` in a
checkout of this repository); the core package never imports this one.

From a script::

    from kvcached.serve import load_config, run
    run(load_config("serve.yaml"))          # blocks until SIGINT/SIGTERM

or ``async with Serve(config) as serve: ...`` inside an event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcached.serve.config import (
    ModelConfig,
    RestartConfig,
    ServeConfig,
    ServeConfigError,
    SleepConfig,
    load_config,
    parse_config,
)
from kvcached.serve.state import ServeError

if TYPE_CHECKING:
    from kvcached.serve.app import Serve

__all__ = [
    "ModelConfig",
    "RestartConfig",
    "Serve",
    "ServeConfig",
    "ServeConfigError",
    "ServeError",
    "SleepConfig",
    "load_config",
    "parse_config",
    "run",
]


def run(config: ServeConfig, ready: Any = None) -> int:  # noqa: ANN401
    """Serve ``config`` until SIGINT or SIGTERM (see :func:`kvcached.serve.app.run`)."""
    from kvcached.serve.app import run as _run

    return _run(config, ready)


def __getattr__(name: str) -> Any:  # noqa: ANN401
    if name == "Serve":
        from kvcached.serve.app import Serve

        return Serve
    raise AttributeError(name)
