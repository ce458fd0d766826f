"""The shipped ``kvcached_sglang.pth`` in a real site directory of a throwaway
venv, with a stand-in ``sglang`` package: inert when disabled, harmless
without SGLang, one log line and the patch on ``import sglang`` otherwise, in
spawned children too. (The real SGLang: test_real_sglang_hook.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcached.config import _FALSE, _TRUE
from kvcached.integrations.sglang.autopatch import PTH_LINE

ROOT = Path(__file__).resolve().parents[3]
SHIPPED_PTH = ROOT / "kvcached" / "integrations" / "sglang" / "kvcached_sglang.pth"


def test_shipped_file_is_the_documented_line() -> None:
    assert SHIPPED_PTH.read_text() == PTH_LINE + "\n"
    # site only executes lines that start with "import" followed by a blank.
    assert PTH_LINE.startswith("import ") and "\n" not in PTH_LINE


@pytest.mark.parametrize("value", sorted(_TRUE | _FALSE | {"", " TRUE ", "Off", "maybe"}))
def test_prefilter_agrees_with_the_config_parser(value: str) -> None:
    """The .pth line's cheap test imports kvcached exactly for the values the
    config parser does not read as false (a bad value then fails loudly)."""
    imported: list[str] = []

    class Autopatch:  # what the line's __import__ hands back for kvcached's module
        @staticmethod
        def install() -> None:
            imported.append("install")

    class Os:  # what it hands back for os: ENABLE_KVCACHED set to the value
        environ = {"ENABLE_KVCACHED": value}

    def line_import(name, *args, **kwargs):
        if name == "os":
            return Os
        imported.append(name)
        return Autopatch

    # The shipped line itself, run as site.py runs it, with only __import__ in its builtins.
    exec(PTH_LINE, {"__builtins__": {"__import__": line_import}})
    expected = value.strip().lower() not in _FALSE | {""}
    assert imported == (["kvcached.integrations.sglang.autopatch", "install"] if expected else [])


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (no pip) whose site-packages holds the shipped .pth, kvcached
    from this tree, and a stand-in sglang package."""
    base = tmp_path_factory.mktemp("pth")
    env_dir = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    site_dir = Path(purelib)
    (site_dir / "kvcached_sglang.pth").write_text(SHIPPED_PTH.read_text())
    # Path lines are processed in name order: "aa_" sorts before "kvcached_"
    # as kvcached's own install (site-packages itself) would.
    (site_dir / "aa_kvcached_tree.pth").write_text(f"{ROOT}\n")
    fake = base / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text(
        "import os\n__version__ = os.environ.get('FAKE_SGLANG_VERSION', '0.5.23')\n"
    )
    return python


def run(
    python: Path, code: str, *, fake_sglang: bool = True, **env: str
) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))
    }
    environment.pop("PYTHONPATH", None)
    if fake_sglang:  # the stand-in sglang for this child (and the children it spawns)
        environment["PYTHONPATH"] = str(python.parents[2] / "fake")
    environment.update(env)
    # A file, not -c: spawned children must find __main__'s functions by path.
    script = python.parents[2] / f"script_{abs(hash(code))}.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [str(python), str(script)], env=environment, capture_output=True, text=True, timeout=120
    )


def kvcached_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[kvcached]")]


@pytest.mark.parametrize("value", [None, "", "0", "false", "off", "no"])
def test_disabled_imports_nothing(venv: Path, value: str | None) -> None:
    env = {} if value is None else {"ENABLE_KVCACHED": value}
    proc = run(
        venv,
        """
        import sys
        assert "kvcached" not in sys.modules, "the .pth imported kvcached while disabled"
        import sglang
        assert "kvcached" not in sys.modules
        print("ok")
    """,
        **env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and kvcached_lines(proc.stderr) == []


def test_enabled_patches_on_import_with_one_line(venv: Path) -> None:
    proc = run(
        venv,
        """
        import sys
        assert "kvcached.integrations.sglang.patch" not in sys.modules
        assert "torch" not in sys.modules
        import sglang
        from kvcached.integrations.sglang import patch
        result = patch.result()
        assert result is not None and result.applied, result
        assert patch.apply() is result
        import kvcached.integrations.sglang.autopatch as autopatch
        autopatch.install()  # a second install adds nothing
        print("torch" in sys.modules)
    """,
        ENABLE_KVCACHED="true",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"  # the hook never imported torch
    lines = kvcached_lines(proc.stderr)
    assert len(lines) == 1 and "SGLang 0.5.23: kvcached" in lines[0], proc.stderr


def test_enabled_without_sglang_is_harmless(venv: Path) -> None:
    proc = run(
        venv,
        """
        from kvcached.integrations import import_hook
        try:
            import sglang
        except ModuleNotFoundError as exc:
            assert exc.name == "sglang"
        else:
            raise AssertionError("sglang should not exist here")
        print(import_hook.pending())
    """,
        fake_sglang=False,
        ENABLE_KVCACHED="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "('sglang',)" and kvcached_lines(proc.stderr) == []


def test_unknown_version_stays_native(venv: Path) -> None:
    proc = run(
        venv,
        """
        import sglang
        from kvcached.integrations.sglang import patch
        assert not patch.result().applied
    """,
        ENABLE_KVCACHED="true",
        FAKE_SGLANG_VERSION="0.6.1",
    )
    assert proc.returncode == 0, proc.stderr
    lines = kvcached_lines(proc.stderr)
    assert len(lines) == 1 and "SGLang 0.6.1 is not supported" in lines[0]


def test_autopatch_off_leaves_it_to_the_application(venv: Path) -> None:
    proc = run(
        venv,
        """
        import sglang
        from kvcached.integrations.sglang import patch
        assert patch.result() is None
        import kvcached.integrations.sglang as kv
        assert kv.apply().applied
    """,
        ENABLE_KVCACHED="true",
        KVCACHED_AUTOPATCH="0",
    )
    assert proc.returncode == 0, proc.stderr
    assert len(kvcached_lines(proc.stderr)) == 1


def test_bad_value_fails_the_import_loudly(venv: Path) -> None:
    proc = run(venv, "import sglang\n", ENABLE_KVCACHED="maybe")
    assert proc.returncode != 0
    assert "ConfigError: ENABLE_KVCACHED='maybe' is not valid" in proc.stderr


def test_spawned_children_are_patched_too(venv: Path) -> None:
    proc = run(
        venv,
        """
        import multiprocessing as mp

        def child(queue):
            import sglang
            from kvcached.integrations.sglang import patch
            queue.put(bool(patch.result() and patch.result().applied))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            p = ctx.Process(target=child, args=(queue,))
            p.start()
            print(queue.get(timeout=100))
            p.join(60)
    """,
        ENABLE_KVCACHED="true",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert (
        len(kvcached_lines(proc.stderr)) == 1
    )  # the child's line; the parent never imported sglang
