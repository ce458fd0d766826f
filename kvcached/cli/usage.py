"""How ``kvcached`` and ``kvctl`` answer a command line they cannot run: one style.

A usage error is one line on stderr, ``PROG: message (see PROG --help)``, and exit
code 2 (argparse would print its usage block first); a bare command with no
subcommand prints the help to stderr and exits 2, like any other incomplete line.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (pass it as ``parser_class``
    to ``add_subparsers`` too, so subcommands answer alike)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def bare_command(parser: argparse.ArgumentParser) -> int:
    """No subcommand given: the help, on stderr; the exit code to return (2)."""
    parser.print_help(sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
