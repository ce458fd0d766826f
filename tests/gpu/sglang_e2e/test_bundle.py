"""The gpu-sglang bundle's inputs, checked without building it (CI): the pinned
wheel list, the shell scripts' syntax, and that the runner and the bundle ask
SGLang for the same backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.gpu.sglang_e2e import checks as ck

TOOL = Path(__file__).resolve().parents[3] / "tools" / "gpu-sglang"
WHEEL = re.compile(
    r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def _lock() -> list[tuple[str, str]]:
    rows = []
    for line in (TOOL / "wheels.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            sha, name = line.split()
            rows.append((sha, name))
    return rows


def test_every_pinned_wheel_is_for_the_device() -> None:
    """sha256 pins, one version per distribution, and only what installs on the
    device's CPython 3.12 x86-64 (cp312, abi3 or pure wheels, manylinux)."""
    rows = _lock()
    names = []
    for sha, file in rows:
        assert re.fullmatch(r"[0-9a-f]{64}", sha), sha
        m = WHEEL.match(file)
        assert m, f"wheels.lock: {file} is not a wheel file name"
        assert m["py"] in ("cp312", "cp310", "cp39", "cp38", "py3", "py2.py3"), file
        assert m["abi"] in ("cp312", "abi3", "none"), file
        assert m["plat"] == "any" or "x86_64" in m["plat"], file
        names.append(m["name"].lower().replace("_", "-"))
    assert len(names) == len(set(names)), "two versions of one distribution stop the install"
    pins = {n: WHEEL.match(f)["version"] for n, (_, f) in zip(names, rows, strict=True)}
    # SGLang 0.5.17's own pins (README.md, "How the set was found").
    assert pins["sglang"] == "0.5.17" and pins["sglang-kernel"] == "0.4.5"
    assert pins["transformers"] == "5.12.1" and pins["xgrammar"] == "0.2.1"
    assert pins["posix-ipc"], "kvcached needs posix-ipc"


def test_scripts_parse_and_ask_for_the_runners_backends() -> None:
    for script in ("build.sh", "install.sh", "selftest.sh"):
        done = subprocess.run(["bash", "-n", str(TOOL / script)], capture_output=True, text=True)
        assert done.returncode == 0, (script, done.stderr)
    install = (TOOL / "install.sh").read_text()
    gs_args = re.search(r'^GS_ARGS="([^"]*)"', install, re.M)
    assert gs_args and gs_args[1].split() == list(ck.BUNDLE_ARGS)


def test_the_xgrammar_stand_in_names_what_is_missing() -> None:
    text = (TOOL / "xgrammar_lite_init.py").read_text()
    compile(text, "xgrammar_lite_init.py", "exec")
    # What SGLang 0.5.17 imports from xgrammar at module level.
    assert "StructuralTag" in text and "get_model_structural_tag" in text
    assert "--grammar-backend none" in text


def test_the_build_edit_replaces_exactly_one_line(tmp_path: Path) -> None:
    """build.sh switches sgl_kernel off FlashInfer's JIT norms by editing one line;
    a wheel where that line is missing or doubled stops the build instead of
    shipping a bundle whose first forward fails on the device."""
    tool = [sys.executable, str(TOOL / "buildtool.py"), "edit"]
    old, new = "    _has_flashinfer = True", "    _has_flashinfer = False"
    one = tmp_path / "one.py"
    one.write_text(f"try:\n    import flashinfer.norm\n{old}\nexcept ImportError:\n{new}\n")
    done = subprocess.run([*tool, str(one), old, new], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert one.read_text().count(new) == 2 and old not in one.read_text()
    for body in ("nothing here\n", f"{old}\n{old}\n"):
        bad = tmp_path / "bad.py"
        bad.write_text(body)
        done = subprocess.run([*tool, str(bad), old, new], capture_output=True, text=True)
        assert done.returncode != 0 and "not one" in done.stderr
        assert bad.read_text() == body
    build = (TOOL / "build.sh").read_text()
    assert "_has_flashinfer = True" in build and "elementwise sampling" in build
