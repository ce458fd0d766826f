"""What the package metadata promises is there: the license text, the project's
URLs, and a use in kvcached for every runtime dependency."""

from __future__ import annotations

import re
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
