"""How the vLLM patch is installed: groups, signature checks, one on/off switch.

A :class:`PatchGroup` patches one vLLM module when it finishes importing (at
once if it already has; see :mod:`kvcached.integrations.import_hook`). Before
it replaces anything it checks the parameter names of every function it wraps
(:func:`check_params`); a mismatch means vLLM's internals moved, and kvcached
then switches itself off for the whole process: :data:`STATE` becomes inactive
and every wrapper already installed passes straight through to vLLM's own
function, so a process is never half patched. One ``[kvcached]`` line says so.

Every replaced attribute keeps the original in ``__kvcached_original__``, and
installing a group whose target already carries that marker does nothing, so
applying twice changes nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvcached.log import get_logger

log = get_logger("integrations.vllm")

MARKER = "__kvcached_original__"
_MISSING = object()


class State:
    """Whether kvcached is on in this process, and why not when it is off."""

    def __init__(self) -> None:
        self.active = False
        self.off_reason: str | None = None
        self.vllm_version = ""
        self.installed: list[str] = []
        self.lock = threading.RLock()

    def switch_off(self, reason: str) -> None:
        with self.lock:
            first = self.off_reason is None
            self.active = False
            if first:
                self.off_reason = reason
        if first:
            log.warning("vLLM %s: kvcached is off in this process (%s); vLLM runs with its "
                        "own KV cache", self.vllm_version or "?", reason)


STATE = State()


def original(fn: Any) -> Any:
    """The vLLM function behind a kvcached wrapper (``fn`` itself if unwrapped)."""
    return getattr(fn, MARKER, fn)


def check_params(owner: Any, name: str, expected: Sequence[str]) -> str | None:
    """``None`` if ``owner.name`` takes exactly the parameters ``expected``
    (names, in order, ``self`` included for methods), else what differs."""
    fn = inspect.getattr_static(owner, name, _MISSING)
    if fn is _MISSING:
        return f"{getattr(owner, '__name__', owner)}.{name} does not exist"
    fn = original(getattr(fn, "__func__", fn))
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"{name} has no readable signature"
    if params != list(expected):
        return f"{getattr(owner, '__name__', owner)}.{name}{tuple(params)} is not {tuple(expected)}"
    return None


class Patcher:
    """Replaces attributes, remembering the originals for :meth:`undo`."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name = value`` (marking ``value`` with the original);
        returns the original (the owner's own entry, or the inherited one)."""
        own = vars(owner).get(name, _MISSING)
        current = getattr(owner, name, None)
        if hasattr(current, MARKER):
            return getattr(current, MARKER)
        if callable(value) and not isinstance(value, type):
            with contextlib.suppress(AttributeError):
                setattr(value, MARKER, current)
        self._undo.append((owner, name, own))
        setattr(owner, name, value)
        return current

    def add(self, owner: Any, name: str, value: Any) -> None:
        """Add a new attribute (a method vLLM does not have)."""
        if name in vars(owner):
            return
        self._undo.append((owner, name, _MISSING))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, own = self._undo.pop()
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


@dataclass(frozen=True)
class PatchGroup:
    """Patches of one module, checked and installed together.

    ``check(module)`` returns ``None`` or why the module cannot be patched;
    ``install(patcher, module)`` makes every change through the patcher.
    """

    name: str
    module: str
    check: Callable[[ModuleType], str | None]
    install: Callable[[Patcher, ModuleType], None]


def install_group(group: PatchGroup, module: ModuleType) -> bool:
    """Check and install one group; on any problem switch kvcached off."""
    if not STATE.active:
        return False
    try:
        reason = group.check(module)
    except Exception as exc:  # a class or function the check looks for is gone
        reason = repr(exc)
    if reason is not None:
        STATE.switch_off(f"{group.module} changed: {reason}")
        return False
    patcher = Patcher()
    try:
        group.install(patcher, module)
    except Exception as exc:  # leave this module native, and the process with it
        patcher.undo()
        STATE.switch_off(f"installing into {group.module} failed: {exc!r}")
        return False
    with STATE.lock:
        STATE.installed.append(group.name)
    return True
