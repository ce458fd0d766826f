"""kvcached's one patcher (``kvcached.integrations.patching``), engine-free:
the original it returns, the marks on its wrappers, installing twice, undo,
both failure policies and the version gate, on stand-in modules."""

from __future__ import annotations

import sys
import types

import pytest

from kvcached.config import reload_config
from kvcached.errors import ConfigError
from kvcached.integrations import import_hook
from kvcached.integrations.patching import (
    MARKER,
    FailurePolicy,
    Patcher,
    Patches,
    PatchGroup,
    check_params,
    is_wrapper,
    original,
    release,
    supported,
)


class Base:
    def run(self, x: int) -> str:
        return f"base {x}"


class Child(Base):
    def own(self) -> str:
        return "own"


def _wrap_run(self: Base, x: int) -> str:
    return "kv " + original(_wrap_run)(self, x)


def test_replace_returns_the_inherited_original_and_marks_the_wrapper() -> None:
    p = Patcher()
    got = p.replace(Child, "run", _wrap_run)
    try:
        assert got is Base.__dict__["run"]
        assert is_wrapper(Child.run) and vars(_wrap_run)[MARKER] is got
        assert original(Child.run) is got and original(got) is got
        assert Child().run(1) == "kv base 1" and Base().run(1) == "base 1"
    finally:
        p.undo()
    assert "run" not in vars(Child) and Child().run(2) == "base 2"


def test_installing_twice_wraps_once() -> None:
    def wrapper(self: Base, x: int) -> str:
        return "kv " + original(wrapper)(self, x)

    first, second = Patcher(), Patcher()
    native = first.replace(Child, "run", wrapper)
    again = second.replace(Child, "run", lambda self, x: "stacked")
    try:
        assert again is native and second.changed == 0
        assert Child().run(3) == "kv base 3", "the second install must change nothing"
    finally:
        second.undo()
        first.undo()
    assert Child().run(3) == "base 3"


def test_a_staticmethod_wrapper_is_marked_and_installs_once() -> None:
    class Checker:
        @staticmethod
        def check(x: int) -> int:
            return x

    native = Checker.check

    def wrapper(x: int) -> int:
        return original(wrapper)(x) + 1

    first, second = Patcher(), Patcher()
    assert first.replace(Checker, "check", staticmethod(wrapper)) is native
    again = second.replace(Checker, "check", staticmethod(lambda x: -1))
    try:
        assert is_wrapper(Checker.check) and original(Checker.check) is native
        assert again is native and second.changed == 0
        assert Checker.check(1) == 2 and Checker().check(1) == 2
    finally:
        second.undo()
        first.undo()
    assert Checker.check(1) == 1


def test_undo_restores_own_entries_newest_first_and_add_only_adds() -> None:
    module = types.ModuleType("stand_in")
    module.value = 1
    p = Patcher()
    assert p.replace(module, "value", 2) == 1
    assert p.replace(module, "value", 3) == 2  # a plain value is not a wrapper: replaced again
    p.add(module, "extra", "new")
    p.add(Child, "own", "not added: Child has its own")
    assert module.value == 3 and module.extra == "new" and Child().own() == "own"
    assert p.changed == 3
    p.undo()
    assert module.value == 1 and not hasattr(module, "extra") and p.changed == 0
    p.undo()


@pytest.mark.parametrize(
    ("owner", "name", "error"),
    [
        (Child, "not a name", ValueError),
        (Child, 3, ValueError),
        (3, "real", TypeError),
    ],
)
def test_misuse_names_the_argument(owner, name, error) -> None:
    with pytest.raises(error, match="name=|owner="):
        Patcher().replace(owner, name, lambda: None)


def test_a_builtin_cannot_be_a_wrapper() -> None:
    with pytest.raises(TypeError, match="value="):
        Patcher().replace(types.ModuleType("m"), "f", len)


def test_check_params_reads_through_wrappers() -> None:
    assert check_params(Base, "run", ("self", "x")) is None
    assert "does not exist" in check_params(Base, "gone", ("self",))
    assert "is not" in check_params(Base, "run", ("self", "y"))
    p = Patcher()
    p.replace(Child, "run", lambda *args: None)
    try:
        assert check_params(Child, "run", ("self", "x")) is None, "the original's signature"
    finally:
        p.undo()


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        (" 0.31.0 ", True),
        ("0.32.1", False),
        ("0.32", False),
        ("0.32.0rc1", False),
        ("0.32.0.post1", False),
    ],
)
def test_the_version_gate_is_exact(version: str, ok: bool) -> None:
    assert supported(version, ("0.31.0", "0.32.0")) is ok
    assert release("0.5.23+cu130") == "0.5.23"


def test_groups_keyed_by_version() -> None:
    group = PatchGroup("g", "m", lambda p, m: None, versions=frozenset({"0.30.0"}))
    assert group.applies_to("0.30.0+cpu") and not group.applies_to("0.31.0")
    assert PatchGroup("all", "m", lambda p, m: None).applies_to("9.9.9")


@pytest.fixture
def fresh_hooks():
    yield
    import_hook._pending.clear()
    import_hook._remove_finder_if_idle()


def _stand_in(monkeypatch, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.f = lambda: "native"
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _groups(fail: str):
    def good(p: Patcher, m: types.ModuleType) -> None:
        p.replace(m, "f", lambda: "kv")

    def bad(p: Patcher, m: types.ModuleType) -> None:
        p.replace(m, "f", lambda: "half")
        raise LookupError("moved")

    return (
        PatchGroup("good", "kv_test_good", good),
        PatchGroup(
            "bad",
            "kv_test_bad",
            bad if fail == "install" else good,
            check=(lambda m: "f changed") if fail == "check" else None,
        ),
    )


@pytest.mark.parametrize("fail", ["install", "check"])
def test_switch_off_turns_the_process_off(monkeypatch, fresh_hooks, fail) -> None:
    good, bad = _stand_in(monkeypatch, "kv_test_good"), _stand_in(monkeypatch, "kv_test_bad")
    patches = Patches("Engine", FailurePolicy.SWITCH_OFF, "integrations.test")
    patches.version = "1.0.0"
    if fail == "check":  # an already-imported module that moved: nothing is installed at all
        assert not patches.start(_groups(fail))
        assert good.f() == "native" and bad.f() == "native"
    else:
        patches.start(_groups(fail))
        assert good.f() == "kv", "installed before the failing group"
        assert bad.f() == "native", "the failing group is undone"
    assert not patches.active and "bad" in patches.off_reason
    assert patches.states()["bad"].startswith("failed:")
    assert not patches.install(_groups("")[0], types.ModuleType("kv_test_good")), (
        "nothing more installs once off"
    )


@pytest.mark.parametrize("fail", ["install", "check"])
def test_group_native_leaves_only_that_group_native(monkeypatch, fresh_hooks, fail) -> None:
    good, bad = _stand_in(monkeypatch, "kv_test_good"), _stand_in(monkeypatch, "kv_test_bad")
    patches = Patches("Engine", FailurePolicy.GROUP_NATIVE, "integrations.test")
    assert patches.start(_groups(fail))
    assert good.f() == "kv" and bad.f() == "native"
    assert patches.active and patches.off_reason is None
    assert patches.states()["good"] == "installed" and patches.installed == ["good"]
    assert patches.states()["bad"].startswith("failed: ")


def test_a_pending_group_installs_when_its_module_imports(monkeypatch, fresh_hooks) -> None:
    patches = Patches("Engine", FailurePolicy.GROUP_NATIVE, "integrations.test")
    patches.start(_groups("")[:1])
    assert patches.states() == {"good": "pending"}
    module = _stand_in(monkeypatch, "kv_test_good")
    import_hook._fire("kv_test_good", module)
    assert patches.states() == {"good": "installed"} and module.f() == "kv"


@pytest.mark.parametrize("policy", list(FailurePolicy))
def test_a_config_error_is_raised_under_either_policy(monkeypatch, fresh_hooks, policy) -> None:
    def install(p: Patcher, m: types.ModuleType) -> None:
        p.replace(m, "f", lambda: "kv")
        monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "3")
        reload_config()

    module = _stand_in(monkeypatch, "kv_test_cfg")
    patches = Patches("Engine", policy, "integrations.test")
    patches.active = True
    try:
        with pytest.raises(ConfigError, match="KVCACHED_PAGE_SIZE_MB"):
            patches.install(PatchGroup("cfg", "kv_test_cfg", install), module)
    finally:
        monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB")
        reload_config()
    assert module.f() == "native" and patches.states()["cfg"].startswith("failed:")


def test_the_policy_must_be_a_policy() -> None:
    with pytest.raises(TypeError, match="policy="):
        Patches("Engine", "off", "integrations.test")  # type: ignore[arg-type]
