"""What the package metadata promises is there: the license text, the project's
URLs, and a use in kvcached for every runtime dependency."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
#: Distribution name -> the module kvcached imports it as.
IMPORT_NAME = {"torch": "torch", "cuda-python": "cuda", "posix-ipc": "posix_ipc"}


@pytest.fixture(scope="module")
def project() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_apache_2_text_the_metadata_names(project):
    text = (ROOT / "LICENSE").read_text()
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_project_names_its_urls(project):
    assert {"Homepage", "Repository", "Issues"} <= set(project["urls"])
    assert all(u.startswith("https://") for u in project["urls"].values())


def test_every_runtime_dependency_is_imported_by_kvcached(project):
    source = "\n".join(p.read_text() for p in (ROOT / "kvcached").rglob("*.py"))
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        module = IMPORT_NAME.get(name)
        assert module is not None, f"{name}: say in IMPORT_NAME which module kvcached imports"
        assert re.search(rf"^\s*(import|from) {module}\b", source, re.M), (
            f"{name} is a dependency, but nothing in kvcached imports {module}"
        )


def test_the_version_is_written_once_in_kvcached_init(project):
    """pyproject.toml takes the version from kvcached/__init__.py; nothing else in the
    package writes one, and the docs' wheel names carry the same."""
    import kvcached

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "version" not in project and "version" in project["dynamic"]
    assert tool["dynamic"]["version"] == {"attr": "kvcached.__version__"}
    init = (ROOT / "kvcached" / "__init__.py").read_text()
    assert re.findall(r'^__version__ = "([^"]+)"$', init, re.M) == [kvcached.__version__]
    for path in (ROOT / "kvcached").rglob("*.py"):
        if path != ROOT / "kvcached" / "__init__.py":
            assert "__version__ =" not in path.read_text(), f"{path}: a second version"
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for named in re.findall(r"kvcached-(\d+\.\d+\.\d+)-py3", doc.read_text()):
            assert named == kvcached.__version__, f"{doc.name} names kvcached-{named}"


def test_the_installed_metadata_carries_the_source_version():
    import kvcached

    try:
        installed = metadata.version("kvcached")
    except metadata.PackageNotFoundError:
        pytest.skip('kvcached is not installed here: pip install -e ".[test]"')
    assert installed == kvcached.__version__
