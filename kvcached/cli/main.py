"""``kvcached``: the user's entry point (``info`` now; ``demo`` runs the elastic demo)."""

from __future__ import annotations

import argparse
import sys

from kvcached import __version__
from kvcached.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcached",
        description="Elastic KV cache for LLM serving: see what kvcached sees, run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"kvcached {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_info = sub.add_parser("info", help="name the backend and device and prove the driver works")
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_info.add_argument("--pages", type=int, default=8, help="pages to map in the check (default 8)")
    p_info.add_argument("--backend", choices=("auto", "cuda", "hip", "host"),
                        help="override KVCACHED_DRIVER for this run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from kvcached.config import get_config

        get_config()  # a bad variable is a usage error (exit 2), whatever the command
        if args.command == "info":
            from kvcached.cli.info import info

            if args.pages < 1:
                parser.error(f"--pages={args.pages}: must be at least 1")
            return info(as_json=args.json, pages=args.pages,
                        backend=None if args.backend in (None, "auto") else args.backend)
    except ConfigError as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
