"""``kvctl top`` and ``kvctl watch`` under a pseudo-terminal, against real instances."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import sys
import tempfile
import termios
import time
import uuid

import pytest

from tests.control.kvctl_helpers import REPO, Child, run_kvctl, unique_index

ALT_SCREEN_ON, ALT_SCREEN_OFF = b"\x1b[?1049h", b"\x1b[?1049l"


@pytest.fixture(scope="module")
def two():
    ledger_dir = tempfile.mkdtemp(prefix="kvtop-test-")
    index = unique_index()
    tag = uuid.uuid4().hex[:6]
    kids = []
    try:
        for suffix in ("x", "y"):
            kids.append(Child(ledger_dir, index, name=f"top-{tag}-{suffix}"))
        kids[0].cmd("alloc 600")
        yield kids[0], kids[1], index
    finally:
        for c in kids:
            c.close()
        shutil.rmtree(ledger_dir, ignore_errors=True)


class Terminal:
    """``python -m MODULE ARGS`` (default: kvctl) on a 120x40 pseudo-terminal."""

    def __init__(self, *args: str, module: str = "kvcached.cli.kvctl") -> None:
        pid, fd = pty.fork()
        if pid == 0:  # pragma: no cover - the child
            os.chdir(REPO)
            os.environ["PYTHONPATH"] = str(REPO)
            os.environ.pop("COLUMNS", None)  # the terminal's own size (set below) counts
            os.environ.pop("LINES", None)
            os.execv(sys.executable, [sys.executable, "-m", module, *args])
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.output = b""

    def read_until(self, pred, timeout: float = 30.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred(self.output):
                return True
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    self.output += os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    break
        return pred(self.output)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 10.0) -> int | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.read_until(lambda _: False, timeout=0.1)  # drain, so the child never blocks
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
        return None

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.mark.slow
def test_top_draws_bars_for_gpu_and_instances_and_quits_on_q(two):
    x, y, index = two
    term = Terminal("top", "--refresh", "0.2", x.name, y.name)
    try:
        frames = lambda out: out.count(b"kvcached top")  # noqa: E731
        assert term.read_until(lambda out: frames(out) >= 3), term.output[-2000:]
        out = term.output
        assert out.startswith(ALT_SCREEN_ON) or ALT_SCREEN_ON in out[:64]
        text = out.decode(errors="replace")
        assert "2 instance(s) on 1 GPU(s)" in text and x.name in text and y.name in text
        lines = text.split("\r\n")
        gpu_line = next(line for line in lines if line.startswith(f"host-{index} "))
        assert re.search(r"\[#+\.+\]", gpu_line)  # the GPU's bar: charged of its budget
        x_line = next(line for line in lines if line.startswith(x.name))
        assert re.search(r"\[[#+]+\.", x_line) and "live" in x_line  # x holds memory
        term.send(b"q")
        assert term.wait() == 0
        assert ALT_SCREEN_OFF in term.output  # the terminal is given back
    finally:
        term.close()


def test_top_gives_the_terminal_back_on_sigterm(two):
    x, _, _ = two
    term = Terminal("top", "--refresh", "0.2", x.name)
    try:
        assert term.read_until(lambda out: out.count(b"kvcached top") >= 2), term.output[-2000:]
        os.kill(term.pid, signal.SIGTERM)
        assert term.wait() == 143
        tail = term.output[term.output.rindex(b"kvcached top") :]
        assert ALT_SCREEN_OFF in tail and b"\x1b[?25h" in tail  # main screen, cursor shown
    finally:
        term.close()


def test_watch_refreshes_the_table_and_stops_on_ctrl_c(two):
    x, y, _ = two
    term = Terminal("watch", "-n", "0.2", x.name, y.name)
    try:
        assert term.read_until(lambda out: out.count(b"kvctl list") >= 3), term.output[-2000:]
        text = term.output.decode(errors="replace")
        assert "NAME" in text and x.name in text and y.name in text
        term.send(b"\x03")  # Ctrl-C through the terminal: SIGINT to the foreground group
        assert term.wait() == 0
        assert ALT_SCREEN_OFF in term.output
    finally:
        term.close()


def test_top_without_a_terminal_prints_frames_and_kvtop_is_top(two):
    x, _, index = two
    done = run_kvctl("kvtop", "--count", "2", "-r", "0.1", x.name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("kvcached top") == 2 and "\x1b[" not in done.stdout
    assert x.name in done.stdout and "1 instance(s) on 1 GPU(s)" in done.stdout
    assert re.search(rf"^host-{index} +\[#", done.stdout, re.M)
    from kvcached.cli.kvctl import kvtop_main

    assert kvtop_main(["--count", "1", "--json", x.name]) == 0


def test_kvtop_console_script_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    scripts = text[text.index("[project.scripts]") :].split("\n\n")[0]
    assert 'kvtop = "kvcached.cli.kvctl:kvtop_main"' in scripts
    assert 'kvctl = "kvcached.cli.kvctl:main"' in scripts
