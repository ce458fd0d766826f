"""The shipped .pth against the real SGLang: ``import sglang`` (here through a
deep submodule, as SGLang's scheduler process does) applies the patch with one
log line; with kvcached disabled nothing of kvcached is imported.

Skips without SGLang; fails instead under ``KVCACHED_REQUIRE_ENGINES=sglang``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engines import require_engine

sglang = require_engine("sglang")

ROOT = Path(__file__).resolve().parents[3]
SHIPPED_PTH = ROOT / "kvcached" / "integrations" / "sglang" / "kvcached_sglang.pth"
STUBS = Path(__file__).resolve().parent / "stubs"


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pip-less venv that sees this environment's packages through a path
    .pth, plus the shipped kvcached_sglang.pth and kvcached from this tree."""
    base = tmp_path_factory.mktemp("real-sglang")
    env_dir = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    exe = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(exe), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    site_dir = Path(purelib)
    (site_dir / "aa_kvcached_tree.pth").write_text(f"{ROOT}\n")
    (site_dir / "kvcached_sglang.pth").write_text(SHIPPED_PTH.read_text())
    # The child venv's environment: everything this interpreter imports from (its
    # site-packages, or a PYTHONPATH --target folder on the GPU machine), read here
    # and written after the hook; nothing in this process's path changes.
    inherited = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != ROOT]
    (site_dir / "zz_engine_env.pth").write_text("".join(f"{p}\n" for p in inherited))
    return exe


def run(python: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))
    }
    # The torchvision stand-in first, as tests/integration/sglang/conftest.py says.
    environment["PYTHONPATH"] = str(STUBS)
    environment.update(env)
    return subprocess.run(
        [str(python), "-W", "ignore", "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def kvcached_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[kvcached]")]


def test_enabled_patches_real_sglang_once(python: Path) -> None:
    proc = run(
        python,
        """
        import sglang.srt.mem_cache.memory_pool  # pulls in `sglang` first
        from kvcached.integrations.sglang import patch
        result = patch.result()
        assert result is not None and result.applied, result
        print(result.sglang_version)
    """,
        ENABLE_KVCACHED="true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == sglang.__version__
    lines = kvcached_lines(proc.stderr)
    assert len(lines) == 1 and f"SGLang {sglang.__version__}: kvcached" in lines[0], lines


def test_disabled_leaves_real_sglang_alone(python: Path) -> None:
    proc = run(
        python,
        """
        import sys
        import sglang
        assert "kvcached" not in sys.modules
    """,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kvcached_lines(proc.stderr) == []
