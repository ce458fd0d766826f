"""The SGLang patch: version gate, one log line, idempotent, undoable.

:func:`apply` decides once per process whether SGLang gets patched:

* ``ENABLE_KVCACHED`` not true: nothing, not even a log line (the engine's log
  must show no ``[kvcached]`` line when kvcached is off);
* SGLang not installed, or a version not in :data:`SUPPORTED_VERSIONS`: one
  ``[kvcached]`` warning line and SGLang stays native;
* otherwise one ``[kvcached]`` info line, and every patch group is installed
  when its trigger module finishes importing (at once if it already has).

The groups go through kvcached's one patcher
(:mod:`kvcached.integrations.patching`) under the ``GROUP_NATIVE`` policy: a
group is one transaction, undone if it raises halfway, and a failed group logs
one error line and leaves only its part of SGLang native; whether the elastic
pools may then be built is decided at pool-build time from
:func:`~.state.group_states` (see docs/sglang-integration.md). The patch state
itself lives in :mod:`.state`, which the groups read.

Calling :func:`apply` again returns the first result and changes nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvcached.integrations.patching import PatchGroup, supported
from kvcached.integrations.sglang.state import PATCHES, group_states, sglang_version

#: SGLang releases the patch groups were written against and tested on (their
#: real classes, ``tests/compat/run.sh sglang VERSION``). Pool, allocator and
#: scheduler code moves between releases: a version not listed here is left
#: native rather than patched on a guess.
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.17", "0.5.20", "0.5.21", "0.5.22", "0.5.23")

__all__ = [
    "PATCHES",
    "SUPPORTED_VERSIONS",
    "ApplyResult",
    "apply",
    "group_states",
    "is_supported",
    "result",
    "sglang_version",
]


@dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` decided for this process."""

    applied: bool
    sglang_version: str | None
    reason: str
    groups: tuple[str, ...] = ()


_lock = threading.RLock()
_result: ApplyResult | None = None


def is_supported(version: str) -> bool:
    """Whether ``version`` (a local label such as ``+cu130`` is ignored) is one
    this patch was written for."""
    return supported(version, SUPPORTED_VERSIONS)


def apply() -> ApplyResult:
    """Patch SGLang in this process if ``ENABLE_KVCACHED`` is true and the
    installed SGLang is supported. Idempotent: later calls return the first
    result. Raises :class:`~kvcached.errors.ConfigError` on a bad variable."""
    from kvcached.integrations.sglang.groups import GROUPS

    return _apply(GROUPS)


def _apply(groups: tuple[PatchGroup, ...]) -> ApplyResult:
    global _result
    from kvcached.config import get_config

    with _lock:
        if _result is not None:
            return _result
        if not get_config().enabled:
            # Inert: no log line, nothing registered.
            _result = ApplyResult(False, None, "ENABLE_KVCACHED is not true")
            return _result

        from kvcached import __version__ as kvcached_version
        from kvcached.log import get_logger

        log = get_logger("integrations.sglang")
        version = sglang_version()
        supported = ", ".join(SUPPORTED_VERSIONS)
        if version is None:
            _result = ApplyResult(False, None, "SGLang is not installed")
            log.warning("SGLang is not installed; nothing to patch")
            return _result
        if not is_supported(version):
            _result = ApplyResult(
                False, version, f"SGLang {version} is not supported (supported: {supported})"
            )
            log.warning(
                "SGLang %s is not supported by kvcached %s (supported: %s); "
                "SGLang runs with its own KV cache",
                version,
                kvcached_version,
                supported,
            )
            return _result

        PATCHES.version = version
        table = tuple(g for g in groups if g.applies_to(version))
        names = tuple(group.name for group in table)
        _result = ApplyResult(True, version, "patched", names)
        log.info(
            "SGLang %s: kvcached %s patch on (groups: %s)",
            version,
            kvcached_version,
            ", ".join(names) if names else "none yet",
        )
    # Outside the lock: a trigger already imported installs right here, and an
    # installing group may itself import modules.
    PATCHES.start(table)
    return _result


def result() -> ApplyResult | None:
    """The decision :func:`apply` made, or ``None`` if it has not run."""
    return _result


def _reset_for_tests() -> None:
    """Forget the decision (tests only: real processes apply once)."""
    global _result
    with _lock:
        _result = None
        PATCHES.reset()
