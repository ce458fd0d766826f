"""The SGLang patch's gate, idempotence and transactions, on a stand-in
``sglang`` module (no SGLang needed)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvcached.config import reload_config
from kvcached.errors import ConfigError
from kvcached.integrations import import_hook
from kvcached.integrations.patching import Patcher, PatchGroup
from kvcached.integrations.sglang import patch


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    """Set variables, re-parse the config, and undo everything afterwards."""

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)
        reload_config()

    patch._reset_for_tests()
    yield set_env
    monkeypatch.undo()
    reload_config()
    patch._reset_for_tests()
    import_hook._pending.clear()
    import_hook._remove_finder_if_idle()


@pytest.fixture
def log():
    from kvcached.log import get_logger

    root = get_logger()
    handler = _Records()
    root.addHandler(handler)
    yield handler.lines
    root.removeHandler(handler)


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch):
    def install(version: str) -> types.ModuleType:
        module = types.ModuleType("sglang")
        module.__version__ = version
        monkeypatch.setitem(sys.modules, "sglang", module)
        return module

    return install


def test_disabled_is_silent_and_registers_nothing(env, log, fake_sglang) -> None:
    env(ENABLE_KVCACHED="false")
    fake_sglang("0.5.23")
    result = patch.apply()
    assert not result.applied and log == [] and import_hook.pending() == ()


def test_supported_version_logs_exactly_one_line(env, log, fake_sglang) -> None:
    env(ENABLE_KVCACHED="true")
    fake_sglang("0.5.23")
    # No groups: the real SGLang's modules may already be imported in this
    # session, and the stand-in's version need not be theirs (on 0.5.21,
    # 0.5.23's pools group fails there and logs a second line).
    result = patch._apply(())
    assert result.applied and result.sglang_version == "0.5.23"
    assert len(log) == 1 and log[0].startswith("INFO SGLang 0.5.23: kvcached")
    # Idempotent: the same result, no second line.
    assert patch.apply() is result and len(log) == 1


@pytest.mark.parametrize("version", ["0.5.19", "0.5.24", "0.6.0", "0.5.23rc1"])
def test_unknown_version_stays_native_with_one_warning(env, log, fake_sglang, version) -> None:
    env(ENABLE_KVCACHED="true")
    fake_sglang(version)
    seen: list[str] = []
    groups = (PatchGroup("g", "sglang", lambda p, m: seen.append("installed")),)
    result = patch._apply(groups)
    assert not result.applied and seen == []
    assert len(log) == 1 and log[0].startswith(f"WARNING SGLang {version} is not supported")
    assert "runs with its own KV cache" in log[0]


@pytest.mark.parametrize("version", patch.SUPPORTED_VERSIONS)
def test_each_supported_release_gets_each_group_exactly_once(version: str) -> None:
    """Groups keyed by release (pools, scheduler) must cover every supported
    release once: none missing (SGLang half patched), none twice."""
    from kvcached.integrations.sglang.groups import GROUPS

    names = [g.name for g in GROUPS if g.applies_to(version)]
    assert sorted(names) == sorted({g.name for g in GROUPS}), names


def test_local_version_label_is_ignored() -> None:
    assert patch.is_supported("0.5.23+cu130") and not patch.is_supported("0.5.230")


def test_sglang_absent(env, log, monkeypatch: pytest.MonkeyPatch) -> None:
    env(ENABLE_KVCACHED="true")
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(patch, "sglang_version", lambda: None)
    result = patch.apply()
    assert not result.applied and result.reason == "SGLang is not installed"


def test_bad_variable_is_a_config_error(env, fake_sglang) -> None:
    fake_sglang("0.5.23")
    with pytest.raises(ConfigError, match="ENABLE_KVCACHED"):
        env(ENABLE_KVCACHED="maybe")


def test_group_installs_when_trigger_imports(env, fake_sglang, monkeypatch) -> None:
    env(ENABLE_KVCACHED="true")
    fake_sglang("0.5.23")
    target = types.SimpleNamespace(value="native")
    group = PatchGroup(
        "pools", "kv_fake_trigger", lambda p, m: p.replace(target, "value", "elastic")
    )
    patch._apply((group,))
    assert patch.group_states() == {"pools": "pending"} and target.value == "native"
    monkeypatch.setitem(sys.modules, "kv_fake_trigger", types.ModuleType("kv_fake_trigger"))
    import_hook._fire("kv_fake_trigger", sys.modules["kv_fake_trigger"])
    assert patch.group_states() == {"pools": "installed"} and target.value == "elastic"


def test_failing_group_is_undone(env, log, fake_sglang) -> None:
    env(ENABLE_KVCACHED="true")
    fake_sglang("0.5.23")

    class Native:
        def alloc(self) -> str:
            return "native"

    def install(p: Patcher, module: types.ModuleType) -> None:
        p.replace(Native, "alloc", lambda self: "elastic")
        p.replace(module, "marker", True)
        raise LookupError("target moved in this SGLang")

    patch._apply((PatchGroup("allocators", "sglang", install),))
    assert Native().alloc() == "native" and not hasattr(sys.modules["sglang"], "marker")
    assert patch.group_states()["allocators"].startswith("failed: LookupError")
    assert any(line.startswith("ERROR patch group 'allocators' failed") for line in log)


def test_patcher_undo_restores_inherited_and_own_attributes() -> None:
    class Base:
        def f(self) -> str:
            return "base"

    class Child(Base):
        def g(self) -> str:
            return "child"

    p = Patcher()
    base_f = Base.__dict__["f"]
    assert p.replace(Child, "f", lambda self: "patched-f") is base_f  # the inherited original
    own_g = Child.__dict__["g"]
    assert p.replace(Child, "g", lambda self: "patched-g") is own_g
    assert Child().f() == "patched-f" and Child().g() == "patched-g" and p.changed == 2
    p.undo()
    assert "f" not in Child.__dict__ and Child().f() == "base" and Child().g() == "child"
    p.undo()  # twice is harmless
    with pytest.raises(ValueError, match="name="):
        p.replace(Child, "not a name", 1)


def test_world_size_reads_each_releases_field() -> None:
    """The virtual budget's collective runs when the launch has more than one
    rank: 0.5.22 on name it ``launch_world_size``; 0.5.17-0.5.21's
    ``ParallelContext`` has no such field and raises ``AttributeError``."""
    from kvcached.integrations.sglang.groups import _world_size

    class Before:  # 0.5.17-0.5.21
        world_size = 2

        def __getattr__(self, name: str) -> int:
            raise AttributeError(f"ParallelContext has no {name!r}")

    class After:  # 0.5.22 on: fixed at launch across elastic scale-up
        launch_world_size = 4
        world_size = 1

    assert _world_size(Before()) == 2 and _world_size(After()) == 4
