"""The post-import hook that delivers the SGLang patch, on throwaway modules."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

from kvcached.integrations import import_hook


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write throwaway modules under tmp_path; forget them afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, body: str) -> None:
        parts = name.split(".")
        folder = tmp_path.joinpath(*parts[:-1])
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(1, len(parts)):
            init = tmp_path.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")
        target = folder / f"{parts[-1]}.py"
        target.write_text(textwrap.dedent(body))
        written.append(parts[0])
        importlib.invalidate_caches()

    yield write
    for name in list(sys.modules):
        if name.split(".")[0] in written:
            del sys.modules[name]
    import_hook._pending.clear()
    import_hook._remove_finder_if_idle()


def finder_installed() -> bool:
    return any(isinstance(f, import_hook._PostImportFinder) for f in sys.meta_path)


def test_callback_runs_after_the_body(modules) -> None:
    modules("hk_engine_a", "READY = True\n")
    seen: list[bool] = []
    import_hook.when_imported("hk_engine_a", lambda m: seen.append(m.READY))
    assert seen == [] and import_hook.pending() == ("hk_engine_a",) and finder_installed()
    import hk_engine_a  # noqa: F401

    assert seen == [True]
    assert import_hook.pending() == () and not finder_installed()


def test_module_keeps_its_real_loader_and_source(modules) -> None:
    modules("hk_engine_b", "def f():\n    return 1\n")
    import_hook.when_imported("hk_engine_b", lambda m: None)
    import hk_engine_b

    assert type(hk_engine_b.__loader__).__name__ == "SourceFileLoader"
    assert hk_engine_b.__spec__.loader is hk_engine_b.__loader__
    assert "return 1" in inspect.getsource(hk_engine_b.f)
    importlib.reload(hk_engine_b)  # a reload goes through the real loader


def test_already_imported_module_gets_the_callback_at_once(modules) -> None:
    modules("hk_engine_c", "X = 3\n")
    import hk_engine_c  # noqa: F401

    seen: list[int] = []
    import_hook.when_imported("hk_engine_c", lambda m: seen.append(m.X))
    assert seen == [3] and not finder_installed()


def test_submodule_and_callbacks_in_order(modules) -> None:
    modules("hk_pkg.sub.leaf", "VALUE = 'leaf'\n")
    order: list[str] = []
    import_hook.when_imported("hk_pkg.sub.leaf", lambda m: order.append("first:" + m.VALUE))
    import_hook.when_imported("hk_pkg.sub.leaf", lambda m: order.append("second"))
    import hk_pkg  # the parent alone does not fire the submodule's callbacks

    assert order == []
    import hk_pkg.sub.leaf  # noqa: F401

    assert order == ["first:leaf", "second"]


def test_callback_may_register_more_callbacks(modules) -> None:
    modules("hk_outer", "")
    modules("hk_inner", "")
    seen: list[str] = []

    def on_outer(module) -> None:
        seen.append("outer")
        import_hook.when_imported("hk_inner", lambda m: seen.append("inner"))

    import_hook.when_imported("hk_outer", on_outer)
    import hk_outer  # noqa: F401

    assert seen == ["outer"] and finder_installed()
    import hk_inner  # noqa: F401

    assert seen == ["outer", "inner"] and not finder_installed()


def test_failing_callback_fails_the_import_and_runs_once(modules) -> None:
    modules("hk_engine_d", "")

    def boom(module) -> None:
        raise RuntimeError("patch failed")

    import_hook.when_imported("hk_engine_d", boom)
    with pytest.raises(RuntimeError, match="patch failed"):
        import hk_engine_d  # noqa: F401
    assert "hk_engine_d" not in sys.modules  # as if the body had raised
    import hk_engine_d  # noqa: F401,F811  (the callback is spent: a retry imports plainly)


def test_unwatched_imports_are_untouched(modules) -> None:
    modules("hk_engine_e", "")
    import_hook.when_imported("hk_not_imported_here", lambda m: None)
    import hk_engine_e

    assert type(hk_engine_e.__spec__.loader).__name__ == "SourceFileLoader"
    assert import_hook.pending() == ("hk_not_imported_here",)


def test_missing_module_stays_pending_and_harmless(modules) -> None:
    import_hook.when_imported("hk_absent_engine", lambda m: None)
    with pytest.raises(ModuleNotFoundError):
        import hk_absent_engine  # noqa: F401
    assert import_hook.pending() == ("hk_absent_engine",)


def test_bad_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="name="):
        import_hook.when_imported("", lambda m: None)
