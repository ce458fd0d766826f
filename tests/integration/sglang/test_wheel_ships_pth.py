"""The built wheel carries ``kvcached_sglang.pth`` at its root (which pip
unpacks into site-packages), and nowhere else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcached.integrations.sglang.autopatch import PTH_LINE

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_wheel_root_holds_the_pth(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools")
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(
        ROOT / "kvcached", tree / "kvcached", ignore=shutil.ignore_patterns("__pycache__")
    )
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(tree),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("kvcached-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert [n for n in names if n.endswith(".pth")] == ["kvcached_sglang.pth"]
        assert zf.read("kvcached_sglang.pth").decode() == PTH_LINE + "\n"
        meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        assert "Root-Is-Purelib: true" in zf.read(meta).decode()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert any(
            line.startswith("kvcached_sglang.pth,")
            for line in zf.read(record).decode().splitlines()
        )

    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "kvcached_sglang.pth").read_text() == PTH_LINE + "\n"
    assert (target / "kvcached" / "integrations" / "sglang" / "autopatch.py").is_file()
