"""A refreshing view in the terminal, for ``kvctl top``/``watch`` and the demo.

On a terminal, :class:`Screen` switches to the alternate screen, hides the
cursor, redraws each frame in place (home, then each line followed by
clear-to-end-of-line) and reads single keys without Enter (``q`` quits;
Ctrl-C stops the view between two refreshes). Everything is restored on exit.
When stdout is not a terminal, frames are simply printed one after another,
so the output of a pipe or a CI log stays readable. Plain ANSI sequences, no
curses: they work in every terminal emulator and under a pseudo-terminal.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from typing import TextIO

_ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide cursor
_LEAVE = "\x1b[?25h\x1b[?1049l"
_HOME, _EOL, _EOS = "\x1b[H", "\x1b[K", "\x1b[J"
QUIT_KEYS = frozenset("qQ")
_POLL_S = 0.1  # how often a wait looks at the stop event


class Screen:
    """See the module docstring. Use as a context manager."""

    def __init__(
        self, out: TextIO | None = None, inp: TextIO | None = None, full_screen: bool | None = None
    ) -> None:
        self.out = out or sys.stdout
        self.inp = inp or sys.stdin
        self.full = self.out.isatty() if full_screen is None else full_screen
        self._saved_tty: list | None = None
        self._in_fd: int | None = None

    def __enter__(self) -> Screen:
        if self.full:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                fd = self.inp.fileno()
                if os.isatty(fd):
                    self._saved_tty = termios.tcgetattr(fd)
                    tty.setcbreak(fd)  # keys arrive one by one; Ctrl-C still signals
                    self._in_fd = fd
            self.out.write(_ENTER)
            self.out.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.full:
            self.out.write(_LEAVE)
            self.out.flush()
            if self._saved_tty is not None and self._in_fd is not None:
                with contextlib.suppress(termios.error, OSError):
                    termios.tcsetattr(self._in_fd, termios.TCSADRAIN, self._saved_tty)

    def size(self) -> tuple[int, int]:
        """``(columns, lines)`` of the terminal (80x24 when unknown)."""
        size = shutil.get_terminal_size((100, 40))
        return size.columns, size.lines

    def draw(self, text: str) -> None:
        """Show one frame: in place on a terminal, else printed after the last."""
        if self.full:
            body = "".join(line + _EOL + "\n" for line in text.split("\n"))
            self.out.write(_HOME + body.rstrip("\n") + _EOS)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def wait(self, seconds: float, stop: threading.Event | None = None) -> bool:
        """Sleep up to ``seconds``; ``True`` as soon as a quit key is pressed
        or ``stop`` is set."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            left = deadline - time.monotonic()
            if stop is not None and stop.is_set():
                return True
            if left <= 0:
                return False
            step = min(left, _POLL_S)
            if self._in_fd is None:
                time.sleep(step)
                continue
            ready, _, _ = select.select([self._in_fd], [], [], step)
            if ready:
                try:
                    keys = os.read(self._in_fd, 64).decode(errors="replace")
                except OSError:
                    keys = ""
                if not keys:  # end of input: nobody will press q; just sleep
                    self._in_fd = None
                    continue
                if QUIT_KEYS & set(keys):
                    return True


def run_live(
    render: Callable[[int, int], str],
    interval_s: float,
    *,
    count: int | None = None,
    screen: Screen | None = None,
) -> int:
    """Draw ``render(columns, lines)`` every ``interval_s`` until ``q``,
    Ctrl-C, ``count`` frames or SIGTERM. Returns 0, or 143 after SIGTERM (the
    terminal is restored either way)."""
    screen = screen or Screen()
    frames = 0
    with ctrl_c_sets() as stop, screen:
        while not stop.is_set():
            cols, lines = screen.size()
            screen.draw(render(cols, lines))
            frames += 1
            if count is not None and frames >= count:
                break
            if screen.wait(interval_s, stop):
                break
    return 128 + signal.SIGTERM if getattr(stop, "signum", None) == signal.SIGTERM else 0


@contextlib.contextmanager
def ctrl_c_sets() -> Iterator[threading.Event]:
    """Within the block, Ctrl-C (SIGINT) and SIGTERM set the event instead of
    raising ``KeyboardInterrupt`` or killing the process: a refresh interrupted
    half way (inside a ledger's lock, say) would leave state behind that the exit
    then waits on, and a killed full-screen view would leave the terminal in the
    alternate screen with the cursor hidden. The loop checks the event at least
    every :data:`_POLL_S`; ``stop.signum`` is the signal that set it."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: object) -> None:
        stop.signum = signum  # type: ignore[attr-defined]
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
