"""The GPU runners make their models in a child process (benchmarks/kvharness/gpu_models.py):
the bundle's make_model.py creates the weights on the GPU, and the caching allocator
would keep them reserved in the runner's own process for the whole device call.
Checked here with a stand-in make_model.py that records the process it ran in."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from kvharness.gpu_models import MISTRAL_HYBRID, make_model

FAKE = textwrap.dedent(
    """
    import json, os, sys
    SHAPES = {"qwen2.5-0.5b": {"model_type": "qwen2"}}

    def main():
        shape, out = sys.argv[sys.argv.index("--shape") + 1], sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**SHAPES[shape], "made_by_pid": os.getpid()}, f)
        open(os.path.join(out, "model.safetensors"), "wb").close()
    """
)


def test_a_model_is_made_in_a_child_process_once(tmp_path: Path) -> None:
    script = tmp_path / "make_model.py"
    script.write_text(FAKE)
    out = make_model("qwen2.5-0.5b", tmp_path / "m", str(script))
    made = json.loads((out / "config.json").read_text())
    assert made["model_type"] == "qwen2" and made["made_by_pid"] != os.getpid()
    (out / "config.json").write_text("{}")  # an existing folder is reused, not made again
    assert make_model("qwen2.5-0.5b", out, str(script)) == out
    assert (out / "config.json").read_text() == "{}"


def test_a_shape_the_bundle_lacks_travels_to_the_child(tmp_path: Path) -> None:
    script = tmp_path / "make_model.py"
    script.write_text(FAKE)
    out = make_model("mistral-7b-hybrid-swa", tmp_path / "swa", str(script))
    made = json.loads((out / "config.json").read_text())
    assert made["sliding_window"] == MISTRAL_HYBRID["sliding_window"]


def test_a_missing_make_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--make-model .*nowhere.py"):
        make_model("qwen2.5-0.5b", tmp_path / "m", str(tmp_path / "nowhere.py"))
