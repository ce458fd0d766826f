"""The one patcher both engine integrations use: groups, install and undo, and
the failure policy as a parameter. Mechanism only: nothing here imports an
engine, and each engine's package keeps its own groups and version list.

The contract (vLLM and SGLang alike):

* :meth:`Patcher.replace` sets ``owner.name = value`` and returns the
  *original*: what ``owner.name`` resolved to before (the owner's own entry or
  an inherited one). A callable ``value`` is marked with that original
  (:data:`MARKER`), so a wrapper finds what it wraps with :func:`original`.
* Replacing an attribute that already holds a kvcached wrapper changes nothing
  and returns that wrapper's original: a group installed twice is installed
  once, never stacked.
* :meth:`Patcher.undo` puts each owner's own entry back (or deletes ours, so an
  inherited attribute shows through again), newest first.
* A :class:`PatchGroup` is installed as one transaction when its module
  finishes importing (at once if it already has): its ``check`` first, then its
  ``install``; a group that raises halfway is undone.
* What a failed group does to the rest is the engine's :class:`FailurePolicy`:
  ``SWITCH_OFF`` turns kvcached off in the whole process (vLLM: its wrappers
  pass through to the engine's own functions, a process is never half
  patched); ``GROUP_NATIVE`` leaves only that group native (SGLang: the pools
  then decide from :meth:`Patches.states` whether they may be elastic). A bad
  ``KVCACHED_*`` value (:class:`~kvcached.errors.ConfigError`) is raised either
  way: the user asked for kvcached and must learn what to fix.
* Versions are gated one way, by exact released version (:func:`supported`;
  a local label such as ``+cpu`` is ignored): a release nobody ran the tests on
  stays native. A group may name the versions it is for (``versions``), which
  is how patches differ between engine releases.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvcached.integrations.import_hook import when_imported
from kvcached.log import get_logger

MARKER = "__kvcached_original__"
_MISSING = object()
_LOCAL_LABEL = re.compile(r"\+.*$")


def release(version: str) -> str:
    """``version`` as released: ``"0.32.0+cpu"`` -> ``"0.32.0"``."""
    return _LOCAL_LABEL.sub("", version.strip())


def supported(version: str, versions: Collection[str]) -> bool:
    """Whether ``version`` (local label ignored) is exactly one of ``versions``."""
    return release(version) in versions


def is_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a kvcached wrapper (carries its own :data:`MARKER`)."""
    fn = getattr(obj, "__func__", obj)  # a bound or class method: its function
    own = getattr(fn, "__dict__", None)
    return own is not None and MARKER in own


def original(fn: Any) -> Any:
    """The engine's object behind a kvcached wrapper (``fn`` itself if unwrapped)."""
    fn = getattr(fn, "__func__", fn)
    return vars(fn)[MARKER] if is_wrapper(fn) else fn


def wrapped(wrapper: Any) -> Any:
    """What the kvcached ``wrapper`` (a plain function, applied) wraps: the hot-path
    form of :func:`original`, one dict lookup for wrappers called on every
    scheduler step (``original`` costs two attribute probes more)."""
    return wrapper.__dict__[MARKER]


def check_params(owner: Any, name: str, expected: Sequence[str]) -> str | None:
    """``None`` if ``owner.name`` takes exactly the parameters ``expected``
    (names, in order, ``self`` included for methods), else what differs."""
    fn = inspect.getattr_static(owner, name, _MISSING)
    label = getattr(owner, "__name__", owner)
    if fn is _MISSING:
        return f"{label}.{name} does not exist"
    fn = original(getattr(fn, "__func__", fn))
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"{label}.{name} has no readable signature"
    if params != list(expected):
        return f"{label}.{name}{tuple(params)} is not {tuple(expected)}"
    return None


class Patcher:
    """Replaces and adds attributes, remembering what to put back.

    Invariant: :meth:`undo` restores every attribute this patcher changed to
    exactly the object (or absence) its owner had before, newest first, and
    leaves the patcher empty, so calling it twice is harmless.
    """

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name = value`` and return the original (see the module
        docstring); a no-op returning the wrapped original if ``owner.name``
        already is a kvcached wrapper."""
        _check_target(owner, name)
        current = getattr(owner, name, None)
        if is_wrapper(current):
            return original(current)
        # A staticmethod's function carries the mark: the class hands out the function.
        target = value.__func__ if isinstance(value, staticmethod) else value
        if callable(target) and not isinstance(target, type):
            # A class is not marked (its subclasses would inherit the mark). A
            # wrapper keeps its mark after undo: the same wrapper may still be
            # installed elsewhere, and there its original() must still resolve.
            try:
                setattr(target, MARKER, current)
            except AttributeError as exc:
                raise TypeError(
                    f"value={value!r}: a wrapper must accept attributes (a function, not a builtin)"
                ) from exc
        self._undo.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)
        return current

    def add(self, owner: Any, name: str, value: Any) -> None:
        """Add an attribute the engine does not have (nothing if it has)."""
        _check_target(owner, name)
        if name in vars(owner):
            return
        self._undo.append((owner, name, _MISSING))
        setattr(owner, name, value)

    @property
    def changed(self) -> int:
        """How many attributes this patcher has changed and not yet put back."""
        return len(self._undo)

    def undo(self) -> None:
        """Put every changed attribute back, newest first."""
        while self._undo:
            owner, name, own = self._undo.pop()
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _check_target(owner: Any, name: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name={name!r}: must be an attribute name")
    if not hasattr(owner, "__dict__"):
        raise TypeError(f"owner={owner!r}: only modules, classes and plain objects are patched")


@dataclass(frozen=True)
class PatchGroup:
    """Patches of one module that only make sense together.

    ``module`` is the module whose import completes the group's targets.
    ``check(module)`` returns ``None`` or why the module cannot be patched (the
    engine's internals moved); ``install(patcher, module)`` makes every change
    through the patcher. ``versions``: the engine releases the group is for
    (``None``: every supported release).
    """

    name: str
    module: str
    install: Callable[[Patcher, ModuleType], None]
    check: Callable[[ModuleType], str | None] | None = None
    versions: frozenset[str] | None = None

    def applies_to(self, version: str) -> bool:
        return self.versions is None or release(version) in self.versions


class FailurePolicy(enum.Enum):
    """What a group that fails its check or its install does to the rest."""

    SWITCH_OFF = "switch kvcached off in the whole process"
    GROUP_NATIVE = "leave that group native"


class Patches:
    """One engine's patch in this process: on or off, and each group's state.

    ``states()`` maps every registered group to ``"pending"``, ``"installed"``
    or ``"failed: ..."``. Under ``SWITCH_OFF`` a failure makes :attr:`active`
    false for good and logs one warning; under ``GROUP_NATIVE`` it logs one
    error naming the group, and the rest stays on.
    """

    def __init__(self, engine: str, policy: FailurePolicy, logger: str) -> None:
        if not isinstance(policy, FailurePolicy):
            raise TypeError(f"policy={policy!r}: must be a FailurePolicy")
        self.engine = engine
        self.policy = policy
        self._logger = logger
        self.lock = threading.RLock()
        self.active = False
        self.off_reason: str | None = None
        self.version = ""
        self._states: dict[str, str] = {}

    @property
    def log(self) -> Any:
        return get_logger(self._logger)  # on use: the logger reads the config

    @property
    def installed(self) -> list[str]:
        """The groups installed in this process, in install order."""
        with self.lock:
            return [name for name, state in self._states.items() if state == "installed"]

    def states(self) -> dict[str, str]:
        with self.lock:
            return dict(self._states)

    def switch_off(self, reason: str) -> None:
        """Turn kvcached off in this process (the first reason is kept and logged)."""
        with self.lock:
            first = self.off_reason is None
            self.active = False
            if first:
                self.off_reason = reason
        if first:
            self.log.warning(
                "%s %s: kvcached is off in this process (%s); %s runs with its own KV cache",
                self.engine,
                self.version or "?",
                reason,
                self.engine,
            )

    def start(self, groups: Iterable[PatchGroup]) -> bool:
        """Turn on and register ``groups`` (those for :attr:`version`), each to
        install when its module imports. Under ``SWITCH_OFF`` the modules
        already imported are checked all together first, so a mismatch leaves
        the process wholly native. Returns :attr:`active`."""
        table = [g for g in groups if g.applies_to(self.version)]
        with self.lock:
            self.active = True
            for group in table:
                self._states.setdefault(group.name, "pending")
        if self.policy is FailurePolicy.SWITCH_OFF:
            for group in table:
                module = sys.modules.get(group.module)
                reason = self._check(group, module) if module is not None else None
                if reason is not None:
                    self._fail(group, f"{group.module} changed: {reason}")
                    return False
        for group in table:
            when_imported(group.module, lambda module, g=group: self.install(g, module))
        return self.active

    def install(self, group: PatchGroup, module: ModuleType) -> bool:
        """Check and install one group as a transaction; on failure apply the
        policy. Returns whether the group is installed."""
        from kvcached.errors import ConfigError

        if not self.active:
            return False
        reason = self._check(group, module)
        if reason is not None:
            self._fail(group, f"{group.module} changed: {reason}")
            return False
        patcher = Patcher()
        try:
            group.install(patcher, module)
        except ConfigError:
            patcher.undo()
            self._fail(group, "a KVCACHED_* variable is not valid", quiet=True)
            raise
        except Exception as exc:  # the engine's internals moved: undone, policy applies
            patcher.undo()
            self._fail(group, f"{type(exc).__name__}: {exc}")
            return False
        with self.lock:
            self._states[group.name] = "installed"
        return True

    @staticmethod
    def _check(group: PatchGroup, module: ModuleType) -> str | None:
        if group.check is None:
            return None
        try:
            return group.check(module)
        except Exception as exc:  # a class or function the check looks for is gone
            return repr(exc)

    def _fail(self, group: PatchGroup, reason: str, quiet: bool = False) -> None:
        with self.lock:
            self._states[group.name] = f"failed: {reason}"
        if self.policy is FailurePolicy.SWITCH_OFF:
            self.switch_off(f"patch group {group.name!r} ({group.module}): {reason}")
        elif not quiet:
            self.log.error(
                "patch group %r failed on %s and was undone; that part of %s stays native: %s",
                group.name,
                group.module,
                self.engine,
                reason,
            )

    def reset(self) -> None:
        """Forget every state (tests only: a real process patches once)."""
        with self.lock:
            self.active = False
            self.off_reason = None
            self.version = ""
            self._states.clear()
