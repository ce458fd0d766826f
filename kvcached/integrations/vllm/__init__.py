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

#: vLLM releases the patch groups were written against and tested on (the
#: real engine, ``tests/compat/run.sh vllm VERSION``); any other runs native.
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.30.0", "0.31.0", "0.32.0")

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
    apply()


def groups() -> tuple:
    """Every patch group, in install order. A group keyed by ``versions``
    applies to those releases only; where 0.30/0.31 differ from 0.32 the
    group of the same name comes from :mod:`.older` (docs/vllm-integration.md,
    "Versions")."""
    from kvcached.integrations.patching import PatchGroup as G
    from kvcached.integrations.vllm import engine, older, worker

    new, old, oldest = (
        frozenset({"0.32.0"}),
        frozenset({"0.30.0", "0.31.0"}),
        frozenset({"0.30.0"}),
    )
    return (
        G(
            "worker_utils",
            "vllm.v1.worker.utils",
            worker.install_utils,
            worker.check_utils,
            versions=new,
        ),
        G(
            "worker_utils",
            "vllm.v1.worker.utils",
            older.install_utils,
            older.check_utils,
            versions=old,
        ),
        G(
            "worker_base",
            "vllm.v1.worker.worker_base",
            worker.install_worker_base,
            worker.check_worker_base,
        ),
        G(
            "gpu_model_runner",
            "vllm.v1.worker.gpu_model_runner",
            worker.install_runner,
            worker.check_runner,
        ),
        G(
            "gpu_attn_utils",
            "vllm.v1.worker.gpu.attn_utils",
            worker.install_runner,
            worker.check_runner,
        ),
        G(
            "gpu_worker",
            "vllm.v1.worker.gpu_worker",
            worker.install_gpu_worker,
            worker.check_gpu_worker,
            versions=new,
        ),
        G(
            "gpu_worker",
            "vllm.v1.worker.gpu_worker",
            older.install_gpu_worker,
            older.check_gpu_worker,
            versions=old,
        ),
        G(
            "xpu_worker",
            "vllm.v1.worker.xpu_worker",
            worker.install_request_memory,
            worker.check_request_memory,
            versions=new,
        ),
        G(
            "xpu_worker",
            "vllm.v1.worker.xpu_worker",
            older.install_request_memory,
            older.check_request_memory,
            versions=old,
        ),
        G(
            "cpu_worker",
            "vllm.v1.worker.cpu_worker",
            worker.install_cpu_worker,
            worker.check_cpu_worker,
        ),
        G(
            "kv_cache_utils",
            "vllm.v1.core.kv_cache_utils",
            engine.install_kv_cache_utils,
            engine.check_kv_cache_utils,
        ),
        G(
            "kv_cache_coordinator",
            "vllm.v1.core.kv_cache_coordinator",
            engine.install_coordinator,
            engine.check_coordinator,
            versions=frozenset({"0.31.0", "0.32.0"}),
        ),
        G(
            "kv_cache_coordinator",
            "vllm.v1.core.kv_cache_coordinator",
            engine.install_coordinator,
            older.check_coordinator,
            versions=oldest,
        ),
        G(
            "kv_cache_manager",
            "vllm.v1.core.kv_cache_manager",
            engine.install_kv_cache_manager,
            engine.check_kv_cache_manager,
            versions=new,
        ),
        G(
            "kv_cache_manager",
            "vllm.v1.core.kv_cache_manager",
            older.install_kv_cache_manager,
            older.check_kv_cache_manager,
            versions=old,
        ),
        G(
            "scheduler",
            "vllm.v1.core.sched.scheduler",
            engine.install_scheduler,
            engine.check_scheduler,
        ),
        G(
            "engine_core",
            "vllm.v1.engine.core",
            engine.install_engine_core,
            engine.check_engine_core,
        ),
    )


def apply() -> bool:
    """Install the patch in this process (idempotent). Returns whether
    kvcached is on here."""
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
    from kvcached.control.naming import instance_name

    instance_name("vllm")  # resolved here, inherited by every process this one starts
    return STATE.start(groups())


def _top_level_process() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is None


__all__ = ["SUPPORTED_VERSIONS", "apply", "plugin"]
