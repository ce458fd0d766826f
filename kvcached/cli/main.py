"""``kvcached``: the user's entry point: ``demo`` (the main job), ``info`` and ``serve``."""

from __future__ import annotations

import argparse
import sys

from kvcached import __version__
from kvcached.cli.usage import OneLineParser, bare_command, positive_int
from kvcached.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvcached",
        description="Elastic KV cache for LLM serving: run the demo, see what kvcached sees.",
    )
    parser.add_argument("--version", action="version", version=f"kvcached {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    p_demo = sub.add_parser(
        "demo",
        help="watch several instances share one memory budget (no GPU needed)",
        description="Run instances in separate processes, each with its burst of requests at "
        "its own time, sharing one budget through the real block manager and "
        "ledger on the host backend; show them live, then a summary against a "
        "static split of the budget.",
    )
    p_demo.add_argument(
        "--duration",
        type=float,
        default=20.0,
        metavar="SEC",
        help="seconds of load (default 20; 5 to 600)",
    )
    p_demo.add_argument(
        "--instances",
        type=int,
        default=3,
        metavar="N",
        help="instances sharing the budget (default 3; 2 to 8)",
    )
    p_demo.add_argument(
        "--budget",
        default="1G",
        metavar="SIZE",
        help="memory they share (default 1G; 512M, 2G, ...)",
    )
    p_demo.add_argument("--seed", type=int, default=1, help="seed of the request traces")
    p_demo.add_argument(
        "--json", action="store_true", help="no live view; print the summary as one JSON object"
    )
    p_info = sub.add_parser("info", help="name the backend and device and prove the driver works")
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_info.add_argument(
        "--pages", type=positive_int, default=8, help="pages to map in the check (default 8)"
    )
    p_info.add_argument(
        "--backend",
        choices=("auto", "cuda", "hip", "host"),
        help="override KVCACHED_DRIVER for this run",
    )
    p_serve = sub.add_parser(
        "serve",
        help="one OpenAI-compatible router in front of several engines",
        description="Start every model of CONFIG.yaml as a supervised engine with kvcached, "
        "route OpenAI requests to them by model name, put idle models to sleep "
        "and wake them on request (docs/serve.md). Needs the serve extra. Exits 0 after "
        "Ctrl-C or SIGTERM, 1 when a model failed past its restart policy, 2 when it "
        "cannot start (the reason in one line per problem).",
    )
    p_serve.add_argument("config", metavar="CONFIG.yaml", help="the serve configuration")
    p_serve.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration and what it needs (engines importable, model "
        "paths, free ports), print the plan, start nothing",
    )
    p_serve.add_argument("--host", help="override the config's host (the router's address)")
    p_serve.add_argument("--port", type=int, help="override the config's port")
    return parser


def _serve(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401 - the extra's packages, checked before anything runs
        import yaml  # noqa: F401

        from kvcached.serve.config import ServeConfigError, describe, load_config
    except ImportError as exc:
        print(
            f"kvcached serve: needs the serve extra ({exc.name} is missing): "
            'pip install ".[serve]" in a checkout of kvcached (docs/serve.md)',
            file=sys.stderr,
        )
        return 2
    import dataclasses

    from kvcached.serve.preflight import preflight
    from kvcached.serve.state import ServeError

    try:
        config = load_config(args.config)
    except ServeConfigError as exc:
        print(f"kvcached serve: {exc}", file=sys.stderr)
        return 2
    if args.host:
        config = dataclasses.replace(config, host=args.host)
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            print(f"kvcached serve: --port={args.port}: must be 0-65535", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, port=args.port)
    if args.check:
        print(describe(config))
    problems = preflight(config)
    for problem in problems:
        print(f"kvcached serve: {config.source}: {problem}", file=sys.stderr)
    if problems:
        return 2
    if args.check:
        print("\nchecks passed: nothing found that would stop these engines from starting")
        return 0
    from kvcached.serve import run

    try:
        return run(config)
    except ServeError as exc:
        print(f"kvcached serve: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from kvcached.config import get_config

        get_config()  # a bad variable is a usage error (exit 2), whatever the command
        if args.command == "info":
            from kvcached.cli.info import info

            return info(
                as_json=args.json,
                pages=args.pages,
                backend=None if args.backend in (None, "auto") else args.backend,
            )
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            from kvcached.cli.demo import run_demo
            from kvcached.units import parse_size

            try:
                budget = parse_size(args.budget)
            except ValueError as exc:
                print(f"kvcached demo: --budget {exc}", file=sys.stderr)
                return 2
            return run_demo(
                duration_s=args.duration,
                instances=args.instances,
                budget=budget,
                seed=args.seed,
                as_json=args.json,
            )
    except ConfigError as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 2
    return bare_command(parser)


if __name__ == "__main__":
    sys.exit(main())
