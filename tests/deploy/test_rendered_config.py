"""The serve config each overlay renders into its ConfigMap is one serve accepts:
parsed as it is by serve's own loader, then through ``kvcached serve --check`` (the
real CLI: config, engines importable, model paths, ports) with the pod's two
machine-specific facts moved onto this machine: the weights volume's paths under a
temporary directory (holding each model's directory) and the router's port (0)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_manifests import kubectl, objects, serve_config

pytestmark = pytest.mark.skipif(
    kubectl() is None,
    reason="kubectl is not on PATH, so the manifests cannot be rendered here "
    "(kubectl >= 1.27 carries kustomize v5; CI's machine has v1.32)",
)
pytest.importorskip("yaml", reason='kvcached serve needs the serve extra: pip install ".[serve]"')

CONFIG_TARGETS = ("base", "overlays/single-gpu")  # the others take the base's config as is


@pytest.mark.parametrize("target", CONFIG_TARGETS)
def test_serve_loads_the_rendered_config_as_it_is(target: str, tmp_path: Path) -> None:
    from kvcached.serve.config import load_config

    text, _ = serve_config(objects(target))
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    config = load_config(str(path))
    assert config.host == "0.0.0.0" and config.public_metrics
    assert all(m.engine == "vllm" and m.kvcached for m in config.models)


@pytest.mark.parametrize("target", CONFIG_TARGETS)
def test_the_rendered_config_passes_kvcached_serve_check(target: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("--check requires the engine the config names (vLLM) to be importable")
    text, config = serve_config(objects(target))
    weights = tmp_path / "models"
    for m in config["models"]:
        assert m["model"].startswith("/models/"), m["model"]
        (weights / m["model"].removeprefix("/models/")).mkdir(parents=True)
    state = tmp_path / "state"
    text = text.replace(" /models/", f" {weights}/").replace(config["state_dir"], str(state))
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", "--check", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, f"kvcached serve --check refused {target}'s config:\n{out.stderr}"
    assert "checks passed" in out.stdout
    for m in config["models"]:
        assert m["name"] in out.stdout  # the plan names every model
