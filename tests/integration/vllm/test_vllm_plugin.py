"""The ``vllm.general_plugins`` entry point: off unless ENABLE_KVCACHED is true,
a version gate with one clear line, idempotent, the instance name resolved in
the first process. Each case runs in a fresh interpreter against a stand-in
``vllm`` package (only its version matters before any vLLM module loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.integrations.vllm import SUPPORTED_VERSIONS

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, os, sys
from kvcached.integrations.vllm import plugin, apply
from kvcached.integrations import import_hook
plugin()
first = import_hook.pending()
config_loaded = "kvcached.config" in sys.modules
name = os.environ.get("KVCACHED_IPC_NAME")
again = apply()
from kvcached.integrations.vllm.state import STATE
from kvcached.config import get_config
print(json.dumps({"active": STATE.active, "pending": list(first),
                  "pending_again": list(import_hook.pending()), "again": again,
                  "name": name, "pid": os.getpid(), "config_loaded": config_loaded,
                  "page_size": STATE.settings.page_size,
                  "settings_are_the_parse": STATE.settings == get_config()}))
"""


def run_probe(tmp_path: Path, version: str, **env: str) -> tuple[dict, str]:
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True, exist_ok=True)
    (fake / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))
    }
    clean.update(env)
    clean["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=clean,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_nothing_happens_without_enable_kvcached(tmp_path: Path) -> None:
    out, err = run_probe(tmp_path, "0.32.0")
    assert out["pending"] == [] and not out["config_loaded"] and out["name"] is None
    assert "[kvcached]" not in err


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_enable_kvcached_off_spellings(tmp_path: Path, value: str) -> None:
    out, err = run_probe(tmp_path, "0.32.0", ENABLE_KVCACHED=value)
    assert out["pending"] == [] and "[kvcached]" not in err


def test_autopatch_off_leaves_it_to_the_embedder(tmp_path: Path) -> None:
    out, err = run_probe(tmp_path, "0.32.0", ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="0")
    assert out["pending"] == [] and "[kvcached]" not in err
    assert out["active"] is True and out["pending_again"], (
        "an explicit apply() still installs the patch"
    )


def test_unknown_version_is_refused_with_one_line(tmp_path: Path) -> None:
    out, err = run_probe(tmp_path, "0.33.1", ENABLE_KVCACHED="true")
    lines = [line for line in err.splitlines() if "[kvcached]" in line]
    assert len(lines) == 1, err
    supported = ", ".join(SUPPORTED_VERSIONS)
    assert (
        f"vLLM 0.33.1 is not supported (supported: {supported}); vLLM runs without kvcached"
        in lines[0]
    )
    assert out["active"] is False and out["pending"] == [] and out["pending_again"] == []


def test_supported_version_waits_for_vllm_modules_and_applies_once(tmp_path: Path) -> None:
    out, err = run_probe(tmp_path, "0.32.0", ENABLE_KVCACHED="true")
    assert out["active"] is True and out["again"] is True
    assert "vllm.v1.engine.core" in out["pending"] and "vllm.v1.worker.utils" in out["pending"]
    assert out["pending_again"] == out["pending"], "a second apply() must add nothing"
    assert out["name"] == f"vllm-{out['pid']}", "the first process names the instance"
    assert "[kvcached]" not in err, "nothing to say before vLLM builds its KV cache"


@pytest.mark.parametrize("autopatch", ["1", "0"], ids=["plugin", "embedder-apply"])
def test_the_entry_point_hands_its_settings_to_the_patch(tmp_path: Path, autopatch: str) -> None:
    """The settings every patch of the process uses (``STATE.settings``) are the
    ones its entry point parsed (the plugin's, or ``apply()``'s for an
    embedder), with the instance name ``apply()`` resolved: what the process'
    own configuration says after it."""
    out, _ = run_probe(
        tmp_path,
        "0.32.0",
        ENABLE_KVCACHED="true",
        KVCACHED_AUTOPATCH=autopatch,
        KVCACHED_PAGE_SIZE_MB="4",
    )
    assert out["active"] is True and out["page_size"] == 4 << 20
    assert out["settings_are_the_parse"] is True


def test_a_configured_name_is_kept(tmp_path: Path) -> None:
    out, _ = run_probe(tmp_path, "0.32.0", ENABLE_KVCACHED="true", KVCACHED_IPC_NAME="srv-a")
    assert out["name"] == "srv-a"


def test_a_bad_variable_stops_vllm_naming_it(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("__version__ = '0.32.0'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_"))}
    env.update(
        ENABLE_KVCACHED="true",
        KVCACHED_PAGE_SIZE_MB="3",
        PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", "from kvcached.integrations.vllm import plugin; plugin()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0 and "KVCACHED_PAGE_SIZE_MB='3' is not valid" in proc.stderr
