"""Run a callback right after a module finishes importing ("post-import hook").

An engine without a plugin entry point (SGLang) is patched this way: a ``.pth``
line registers a callback for ``sglang``; when any code later imports it, the
callback runs once the module's body has executed, in every process, spawned
or forked, whoever imports it first.

How it works: one :class:`importlib.abc.MetaPathFinder` sits first on
``sys.meta_path`` while callbacks are pending. For a watched name it asks the
finders behind it for the real spec and wraps only the loader's
``exec_module``; the module object, its ``__spec__`` and ``__loader__`` are the
real ones (the original loader is put back before the body runs, so
``importlib.resources``, ``inspect`` and ``pkgutil`` see nothing of us). For
any other name it returns ``None`` at the cost of one dict lookup, and it
removes itself once nothing is pending.

Rules this module keeps:

* only cheap standard modules are imported here (not even ``importlib.abc``,
  which drags in ``importlib.resources``): the ``.pth`` path must stay cheap,
  so the finder and loader are duck-typed as the import system allows;
* a callback runs at most once, after the module body completed (never on a
  half-initialised module), in registration order;
* a module already imported when a callback is registered gets it at once;
* an exception from a callback propagates out of the ``import`` statement that
  triggered it (the import then fails as if the module body had raised), so a
  callback that must never break the engine catches its own errors.
"""

from __future__ import annotations

import _thread
import sys

# Not ``from typing import TYPE_CHECKING``: typing alone costs ~8 ms at start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]

# RLock: a callback may register further callbacks (SGLang's patch does, for
# its submodules) while the import machinery holds no lock of ours.
_lock = _thread.RLock()  # _thread, not threading: ~5 ms less at interpreter start
_pending: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is).

    ``name`` is a full dotted module name (``"sglang"``,
    ``"sglang.srt.mem_cache.memory_pool"``).
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"name={name!r}: must be a dotted module name such as 'sglang'")
    with _lock:
        module = sys.modules.get(name)
        if module is None or _initializing(module):
            # A module still executing its body is caught by nothing here (its
            # loader is already running); it gets the callback on a later import
            # only if it fails and is imported again. That only happens when
            # the hook is installed from inside that very import.
            _pending.setdefault(name, []).append(callback)
            _ensure_finder()
            return
    callback(module)


def pending() -> tuple[str, ...]:
    """Names that still have callbacks waiting (tests, diagnostics)."""
    with _lock:
        return tuple(_pending)


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _ensure_finder() -> None:
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _remove_finder_if_idle() -> None:
    if not _pending:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
        _remove_finder_if_idle()
    for callback in callbacks:
        callback(module)


class _ChainedLoader:
    """The real loader, plus the callbacks once its ``exec_module`` returns."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back before the body runs: code in the module
        # (and inspect/pkgutil later) must see the loader it would have seen.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _fire(module.__name__, module)


class _PostImportFinder:
    """Finds nothing itself; wraps the loader of a watched module."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _PostImportFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            # Namespace packages (no loader) and legacy loaders without
            # exec_module cannot be chained; their callbacks wait for a later
            # import (see the module docstring).
            if loader is not None and hasattr(loader, "exec_module"):
                spec.loader = _ChainedLoader(loader)
            return spec
        return None
