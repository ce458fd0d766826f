"""No folder or module of ours can stand in for an installed package.

pytest runs in its importlib mode and every test folder is a package, so the only
entries the suite puts on the import path are the two in ``pyproject.toml``: the
repository root and ``benchmarks/``. Once ``tests/integration`` was on it, and
without vLLM installed ``import vllm`` found the test folder ``tests/integration/vllm``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
#: Folders under tests/ that hold Python but are not packages, and why.
NOT_PACKAGES = {
    "tests/amx_permission": "a sitecustomize put on a child's PYTHONPATH",
    "tests/fakes": "scripts run as files against a fake libcuda",
    "tests/integration/sglang/stubs": "a torchvision stand-in put on PYTHONPATH",
}
#: Top-level names some careless distributions install too; ours shadowing theirs is
#: harmless (no engine imports them), and kvcached is this checkout itself.
OURS_ANYWAY = {"kvcached", "tests", "docs", "benchmarks", "setup"}


def _path_entries() -> list[Path]:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    return [ROOT / entry for entry in config["ini_options"]["pythonpath"]]


def test_pytest_adds_only_the_root_and_benchmarks_and_imports_by_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text()) if tomllib else None
    if config is None:
        pytest.skip("tomllib needs Python 3.11")
    options = config["tool"]["pytest"]["ini_options"]
    assert options["pythonpath"] == [".", "benchmarks"]
    assert "--import-mode=importlib" in options["addopts"].split()


def test_every_test_folder_is_a_package():
    for folder in sorted({p.parent for p in (ROOT / "tests").rglob("*.py")}):
        name = folder.relative_to(ROOT).as_posix()
        if any(name == n or name.startswith(n + "/") for n in NOT_PACKAGES):
            continue
        assert (folder / "__init__.py").is_file(), f"{name}: add an __init__.py"


def test_no_name_on_the_suites_path_is_an_installed_packages():
    ours: dict[str, Path] = {}
    for entry in _path_entries():
        for path in entry.iterdir():
            name = path.stem if path.suffix == ".py" else path.name
            if name.isidentifier() and (path.is_dir() or path.suffix == ".py"):
                ours[name] = path
    installed = importlib.metadata.packages_distributions()
    clashes = {
        name: (str(path.relative_to(ROOT)), installed[name])
        for name, path in ours.items()
        if name in installed and name not in OURS_ANYWAY
    }
    assert not clashes, f"ours shadow installed packages: {clashes}"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "torch"])
def test_an_engine_name_never_resolves_to_a_folder_of_ours(engine):
    spec = importlib.util.find_spec(engine)
    if spec is None:
        return  # not installed, and nothing of ours answers to the name either
    places = [spec.origin or "", *(spec.submodule_search_locations or [])]
    assert spec.origin is not None, f"{engine} is a namespace package: {places}"
    # A venv may live inside the checkout (.ci/run's do): its site-packages is not ours.
    ours = [
        p
        for p in places
        if p.startswith(str(ROOT) + "/")
        and not {"site-packages", "dist-packages"} & set(Path(p).parts)
    ]
    assert not ours, places


def test_no_test_or_benchmark_edits_the_import_path():
    """Shared code is imported from kvharness or tests.*, never found by editing
    sys.path (a child's environment may name PYTHONPATH instead, said where it does)."""
    edit = re.compile(r"sys\.path\s*(\.(insert|append|extend|remove)\b|\[[^\]]*\]\s*=|[+]?=(?!=))")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if edit.search(line)
    ]
    assert not found, f"sys.path edited at {found}"
