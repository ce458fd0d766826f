"""Instance names: ``KVCACHED_IPC_NAME``, or a distinct readable default.

All processes of one server share one instance name. Without
``KVCACHED_IPC_NAME``, the first process of a server that asks for a name gets
``<engine>-<pid>`` (unique among live processes, so two servers started side
by side never collide) and exports it in ``os.environ``, so the engine's
workers, spawned or forked after it, inherit the same name.
"""

from __future__ import annotations

import os
import re

from kvcached.config import reload_config

ENV = "KVCACHED_IPC_NAME"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def default_name(engine: str = "kvcached", pid: int | None = None) -> str:
    """``<engine>-<pid>``, cleaned to the characters an instance name allows."""
    stem = _UNSAFE.sub("-", engine).strip("-._")[:24] or "kvcached"
    return f"{stem}-{os.getpid() if pid is None else pid}"


def instance_name(engine: str, configured: str | None) -> str:
    """The instance name of this process (see the module docstring):
    ``configured`` (the caller's ``config.ipc_name``) when set, else the default,
    exported for the children and reloaded into this process' configuration."""
    if configured:
        return configured
    name = default_name(engine)
    os.environ[ENV] = name  # children inherit it: one server, one instance
    reload_config()  # and this process' configuration says so too
    return name
