"""Settings are read at the entry points and handed down, never fetched below them.

``control/``, ``driver/``, ``memory/`` and ``ledger/`` take a
:class:`~kvcached.config.Config` or single values as arguments; an argument left
unset there is the documented default (:func:`kvcached.config.defaults`), not the
environment. Only the entry points (the engine integrations, the CLIs, ``serve``)
call :func:`~kvcached.config.get_config`. The first test reads the modules'
source with :mod:`ast` (calls hidden inside functions count too).
The vLLM integration reads them only in its entry points (``plugin()``,
``apply()``) and parks none in its engine-core or worker state.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvcached import config as config_module
from kvcached.units import MIB

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("control", "driver", "memory", "ledger")
#: The one write below the entry points: control/naming.py settles a process'
#: default instance name and exports it, so the engine's children inherit it.
EXPORTS = {
    ("kvcached/control/naming.py", "environ"),
    ("kvcached/control/naming.py", "reload_config"),
}
#: Names that read the process' settings or its environment.
FORBIDDEN = {"get_config", "reload_config", "environ", "getenv", "environb"}


def settings_reads(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line name`` (relative to ``root``) for every use of a name in
    :data:`FORBIDDEN` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name.rpartition(".")[2]
        else:
            continue
        if name in FORBIDDEN:
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')} {name}")
    return found


def test_no_layer_below_the_entry_points_reads_the_settings():
    paths = [p for layer in LOWER for p in sorted((ROOT / "kvcached" / layer).rglob("*.py"))]
    assert len(paths) > 20  # the four layers are where this test thinks
    hits = [hit for p in paths for hit in settings_reads(p)]
    found = [h for h in hits if (h.split(":")[0], h.split(" ")[1]) not in EXPORTS]
    assert not found, (
        "control/, driver/, memory/ and ledger/ take their settings as arguments (a Config "
        "passed in, or values); an entry point calls get_config() and hands them down: "
        + ", ".join(found)
    )
    assert len(hits) - len(found) == 3  # naming.py's import, export and reload, no more
    text = "".join(p.read_text() for p in paths)
    assert "get_config(" not in text


VLLM = ROOT / "kvcached" / "integrations" / "vllm"
#: The vLLM integration's entry points: vLLM's plugin hook and ``apply()`` (an
#: embedder's), in its ``__init__.py``; the only code there that reads settings.
VLLM_ENTRY_POINTS = {"plugin", "apply"}


def readers(path: Path) -> set[str]:
    """The top-level functions of ``path`` that use a name in :data:`FORBIDDEN`
    (``"<module>"`` for a use outside any function)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for top in tree.body:
        name = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef) else "<module>"
        for node in ast.walk(top):
            used = getattr(node, "id", None) or getattr(node, "attr", None)
            if isinstance(node, ast.alias):
                used = node.name.rpartition(".")[2]
            if used in FORBIDDEN:
                found.add(name)
    return found


def test_the_vllm_patch_reads_its_settings_only_at_its_entry_points():
    """Every vLLM patch (engine core, workers, executor, ...) takes its settings
    from what the entry point handed in (``STATE.settings``, then parameters);
    only ``plugin()`` and ``apply()`` read the environment."""
    paths = sorted(VLLM.glob("*.py"))
    assert len(paths) > 8 and VLLM / "engine.py" in paths
    found = [hit for p in paths if p.name != "__init__.py" for hit in settings_reads(p)]
    assert not found, (
        "the vLLM patch takes its settings from STATE.settings (handed in by plugin()/"
        "apply()) and passes them on as parameters: " + ", ".join(found)
    )
    assert readers(VLLM / "__init__.py") == VLLM_ENTRY_POINTS


def test_no_setting_is_parked_in_the_vllm_patch_state():
    """The engine core's and the workers' module state hold no setting (the page
    size once sat in ``ENGINE.rounding_page_size`` while vLLM sized the cache):
    settings live in ``STATE.settings`` alone."""
    import dataclasses

    from kvcached.config import Config
    from kvcached.integrations.vllm import engine, worker

    settings = {f.name for f in dataclasses.fields(Config)}
    for state in (engine.ENGINE, worker.WORKER):
        names = set(vars(type(state))) | set(vars(state))
        parked = sorted(n for n in names if n in settings or "page_size" in n)
        assert not parked, f"{type(state).__name__} holds settings {parked}"
    text = "".join(p.read_text() for p in VLLM.glob("*.py"))
    assert "rounding_page_size" not in text


def test_the_check_finds_a_hidden_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n"
        "    from kvcached.config import get_config\n"
        "    import os\n"
        "    return get_config().page_size, os.environ['X']\n"
    )
    found = [hit.split(" ")[1] for hit in settings_reads(module, tmp_path)]
    assert found.count("get_config") == 2 and "environ" in found
    assert readers(module) == {"f"}


def test_defaults_ignore_the_environment(monkeypatch):
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "8")
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.5")
    config_module.reload_config()
    assert config_module.get_config().page_size == 8 * MIB
    assert config_module.defaults().page_size == 2 * MIB
    assert config_module.defaults().gpu_utilization == 0.95
    assert config_module.defaults() == config_module.Config.from_env({})


@pytest.fixture
def host_driver():
    from kvcached.driver.host import HostDriver

    return HostDriver(index=400_000 + __import__("os").getpid() % 10_000, capacity=256 * MIB)


def test_the_cache_takes_the_settings_it_is_given(monkeypatch, host_driver):
    """A KVCache built with no settings follows the documented defaults even where
    the environment says otherwise; given the entry point's Config, it follows it."""
    from kvcached.memory import KVCache, KVCacheSpec

    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.5")
    config_module.reload_config()
    import torch

    # a block is 32 KiB in each of K and V: a 2 MiB page holds 64 of them
    spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=8, head_dim=128, dtype=torch.float16)
    kw = {"driver": host_driver, "capacity_bytes": 64 * MIB, "background": False}
    with KVCache(spec, **kw) as plain:
        assert plain.geometry.blocks_per_page == 64
        assert plain.budget.margin == round(256 * MIB * (1 - 0.95))
    with KVCache(spec, config=config_module.get_config(), **kw) as configured:
        assert configured.geometry.blocks_per_page == 128
        assert configured.budget.margin == round(256 * MIB * 0.5)


def test_open_ledger_takes_its_directory_and_margin_from_the_config(tmp_path, host_driver):
    from kvcached.ledger import open_ledger

    settings = config_module.defaults().replace(
        ledger_dir=str(tmp_path), gpu_utilization=0.5, calibration_interval_s=7.0
    )
    ledger = open_ledger(host_driver, config=settings)
    try:
        assert Path(ledger.path).parent == tmp_path
        assert ledger.safety_margin == 128 * MIB
        assert ledger.calibrator().interval_s == 7.0
    finally:
        ledger.close()
