"""Instance names: ``KVCACHED_IPC_NAME``, or a distinct readable default.

All processes of one server share one instance name. Without
``KVCACHED_IPC_NAME``, the first process of a server that asks for a name gets
``<engine>-<pid>`` (unique among live processes, so two servers started side
by side never collide) and exports it in ``os.environ``, so the engine's
workers, spawned after it, inherit the same name.
"""

from __future__ import annotations

import os
import re

from kvcached.config import get_config

ENV = "KVCACHED_IPC_NAME"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def instance_name(engine: str = "kvcached") -> str:
    """The instance name of this process (see the module docstring)."""
    configured = get_config().ipc_name
    inherited = os.environ.get(ENV)
    if configured:
        return configured
    if inherited:  # set by our parent after the config was read
        return inherited
    stem = _UNSAFE.sub("-", engine).strip("-.")[:24] or "kvcached"
    name = f"{stem}-{os.getpid()}"
    os.environ[ENV] = name
    return name
