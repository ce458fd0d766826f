"""The SGLang patch: version gate, one log line, idempotent, undoable.

:func:`apply` decides once per process whether SGLang gets patched:

* ``ENABLE_KVCACHED`` not true: nothing, not even a log line (the engine's log
  must show no ``[kvcached]`` line when kvcached is off);
* SGLang not installed, or a version not in :data:`SUPPORTED_VERSIONS`: one
  ``[kvcached]`` warning line and SGLang stays native;
* otherwise one ``[kvcached]`` info line, and every :class:`PatchGroup` is
  installed when its trigger module finishes importing (at once if it already
  has).

A group is installed as one transaction: every attribute it replaces goes
through a :class:`Patcher`, and if the group raises halfway the patcher puts
the originals back in reverse order, so SGLang is never left half patched. A
failed group logs one error line and leaves its part of SGLang native; whether
the elastic pools may then be built is decided at pool-build time from
:func:`group_states` (see docs/sglang-integration.md).

Calling :func:`apply` again returns the first result and changes nothing.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from kvcached.integrations.import_hook import when_imported

#: SGLang releases whose internals the patch groups were written against.
#: Pool, allocator and scheduler code moves between minor releases: a version
#: not listed here is left native rather than patched on a guess.
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.23",)

_MISSING = object()
_LOCAL_LABEL = re.compile(r"\+.*$")


class Patcher:
    """Replaces attributes and remembers the originals so they can be put back.

    Invariant: :meth:`undo` restores every replaced attribute to exactly the
    object (or absence) it had before, newest first, and leaves the patcher
    empty, so calling it twice is harmless.
    """

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name = value``; return ``owner``'s own previous entry
        (``None`` when the name was absent or only inherited)."""
        if not name.isidentifier():
            raise ValueError(f"name={name!r}: must be an attribute name")
        if not hasattr(owner, "__dict__"):
            raise TypeError(f"owner={owner!r}: only modules, classes and plain objects are patched")
        # The owner's own entry, not an inherited one: undo must re-expose the
        # base class' attribute by deleting ours, not copy it onto the subclass.
        original = vars(owner).get(name, _MISSING)
        self._undo.append((owner, name, original))
        setattr(owner, name, value)
        return None if original is _MISSING else original

    @property
    def replaced(self) -> int:
        """How many attributes this patcher has replaced and not yet put back."""
        return len(self._undo)

    def undo(self) -> None:
        """Put every replaced attribute back, newest first."""
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@dataclass(frozen=True)
class PatchGroup:
    """Patches that only make sense together, installed as one transaction.

    ``trigger`` is the module whose import completes the group's targets (for
    the pools: ``sglang.srt.mem_cache.kv_cache_configurator``, which has
    imported ``memory_pool`` and ``allocator`` by then). ``install`` receives a
    :class:`Patcher` and the trigger module, and must make every change
    through the patcher.
    """

    name: str
    trigger: str
    install: Callable[[Patcher, ModuleType], None]


# The patch groups themselves live in ``groups.py`` (they import this module
# for Patcher / PatchGroup); ``apply`` loads them when it runs.


@dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` decided for this process."""

    applied: bool
    sglang_version: str | None
    reason: str
    groups: tuple[str, ...] = ()


_lock = threading.RLock()
_result: ApplyResult | None = None
_group_states: dict[str, str] = {}


def sglang_version() -> str | None:
    """SGLang's version from the imported module, else from its metadata;
    ``None`` when SGLang is not installed. Never imports SGLang."""
    module = sys.modules.get("sglang")
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version:
        return version
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def is_supported(version: str) -> bool:
    """Whether ``version`` (a local label such as ``+cu130`` is ignored) is one
    this patch was written for."""
    return _LOCAL_LABEL.sub("", version.strip()) in SUPPORTED_VERSIONS


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
                version, kvcached_version, supported,
            )
            return _result

        names = tuple(group.name for group in groups)
        _result = ApplyResult(True, version, "patched", names)
        for group in groups:
            _group_states[group.name] = "pending"
        log.info(
            "SGLang %s: kvcached %s patch on (groups: %s)",
            version, kvcached_version, ", ".join(names) if names else "none yet",
        )
    # Outside the lock: a trigger already imported installs right here, and an
    # installing group may itself import modules.
    for group in groups:
        when_imported(group.trigger, _installer(group))
    return _result


def _installer(group: PatchGroup) -> Callable[[ModuleType], None]:
    def install(module: ModuleType) -> None:
        _install_group(group, module)

    return install


def _install_group(group: PatchGroup, module: ModuleType) -> None:
    from kvcached.errors import ConfigError
    from kvcached.log import get_logger

    patcher = Patcher()
    try:
        group.install(patcher, module)
    except ConfigError:
        patcher.undo()
        with _lock:
            _group_states[group.name] = "failed: configuration"
        raise
    except Exception as exc:  # the engine keeps running, natively for this group
        patcher.undo()
        with _lock:
            _group_states[group.name] = f"failed: {type(exc).__name__}: {exc}"
        get_logger("integrations.sglang").error(
            "patch group %r failed on %s and was undone; that part of SGLang stays native: %s",
            group.name, group.trigger, exc,
        )
        return
    with _lock:
        _group_states[group.name] = "installed"


def group_states() -> dict[str, str]:
    """``{group: "pending" | "installed" | "failed: ..."}`` for this process."""
    with _lock:
        return dict(_group_states)


def result() -> ApplyResult | None:
    """The decision :func:`apply` made, or ``None`` if it has not run."""
    return _result


def _reset_for_tests() -> None:
    """Forget the decision (tests only: real processes apply once)."""
    global _result
    with _lock:
        _result = None
        _group_states.clear()
