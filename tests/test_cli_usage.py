"""``kvcached`` and ``kvctl`` answer a bad or bare command line alike: a usage error
is one line on stderr (``PROG: message (see PROG --help)``), exit 2; a bare command
prints its help to stderr, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLIS = {
    "kvcached": [sys.executable, "-m", "kvcached"],
    "kvctl": [sys.executable, "-m", "kvcached.cli.kvctl"],
}


def run(cli: str, *argv: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [*CLIS[cli], *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


@pytest.mark.parametrize(
    "cli, argv, prog",
    [
        ("kvcached", ["frobnicate"], "kvcached"),
        ("kvctl", ["frobnicate"], "kvctl"),
        ("kvcached", ["demo", "--instances", "many"], "kvcached demo"),
        ("kvctl", ["watch", "-n", "soon"], "kvctl watch"),
        ("kvcached", ["info", "--pages", "0"], "kvcached info"),
    ],
)
def test_a_usage_error_is_one_line_in_one_style(cli, argv, prog):
    done = run(cli, *argv)
    assert done.returncode == 2 and done.stdout == "", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: ") and lines[0].endswith(f"(see {prog} --help)"), lines


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_a_bare_command_prints_its_help_to_stderr(cli):
    done = run(cli)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith(f"usage: {cli}") and "COMMAND" in done.stderr, done.stderr
