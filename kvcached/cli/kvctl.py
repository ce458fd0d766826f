"""``kvctl``: see and limit the kvcached instances on this machine.

Commands: ``list``, ``status NAME``, ``limit NAME SIZE|none`` (or
``--percent P``; ``limit-percent NAME P`` as upstream wrote it), ``watch``,
``top`` (also ``kvtop``), ``gpus``, ``metrics``. Each takes ``--json``.

kvctl reads instance snapshots from ``/dev/shm`` and the per-GPU ledgers; it
needs no GPU, no engine, and imports neither torch nor a device library. It
never hangs on a ledger: a data lock that another process holds (stopped, in
a debugger) for ``--timeout`` seconds (default 2, all ledgers together) is
read around, and kvctl says which pid holds it.
Exit codes: 0 done; 1 a limit was not written (``stale`` or ``conflict``); 2 an
error (unknown instance, bad size, no permission, no kvcached running, a
ledger refused by ``gpus``), said in one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvcached.cli.usage import OneLineParser, bare_command
from kvcached.units import format_bytes, parse_size

PROG = "kvctl"


class UsageError(Exception):
    """A command cannot run as asked: one line for stderr, exit 2."""


# One line, like every other kvctl error, in the same style as ``kvcached``'s.
_Parser = OneLineParser


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument(
        "--ledger-dir",
        metavar="DIR",
        help="read the ledgers in DIR only (default: KVCACHED_LEDGER_DIR and "
        "the directories live instances publish)",
    )
    common.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        metavar="SEC",
        help="seconds to wait for ledgers whose lock another process holds, "
        "before reading them without it (default 2)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(
        prog=PROG,
        description="See and limit the kvcached instances on this "
        "machine (no GPU or engine needed).",
    )
    from kvcached import __version__

    parser.add_argument("--version", action="version", version=f"kvctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "list", parents=[common], help="a table of instances (alias: ls)", aliases=["ls"]
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="only these instances")

    p = sub.add_parser("status", parents=[common], help="everything about one instance")
    p.add_argument("name", metavar="NAME")

    p = sub.add_parser(
        "limit",
        parents=[common],
        help="set an instance's limit on each GPU it uses: SIZE (512M, 2G, "
        "1.5g, bytes), none to remove it, or --percent P",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "size", metavar="SIZE", nargs="?", help="512M, 2G, 1.5g or bytes; none removes the limit"
    )
    p.add_argument(
        "--percent", type=float, metavar="P", help="P percent of each GPU's memory instead of SIZE"
    )
    _limit_options(p)

    p = sub.add_parser(
        "limit-percent",
        parents=[common],
        help="set an instance's limit to P percent of each GPU's memory",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("percent", type=float, metavar="P")
    _limit_options(p)

    _view_commands(sub, common)

    sub.add_parser(
        "gpus",
        parents=[common],
        help="each GPU's ledger: budget, margin, charges, last calibration",
    )
    sub.add_parser(
        "metrics", parents=[common], help="instances and GPUs in the Prometheus text format"
    )
    return parser


def _view_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The commands that refresh a view: watch, top and kvtop."""
    p = sub.add_parser("watch", parents=[common], help="the list table, refreshed")
    _refresh_options(p, "-n", "--interval")
    for name in ("top", "kvtop"):
        p = sub.add_parser(
            name,
            parents=[common],
            help="full-screen live view: a usage bar per GPU and instance"
            if name == "top"
            else "same as top (upstream's name)",
        )
        _refresh_options(p, "-r", "--refresh", "-n", "--interval")


def _refresh_options(p: argparse.ArgumentParser, *interval_flags: str) -> None:
    """A refreshed view's options: the interval (under ``interval_flags``), how
    many refreshes, which instances."""
    p.add_argument(
        *interval_flags,
        dest="interval",
        type=float,
        default=1.0,
        metavar="SEC",
        help="seconds between refreshes (default 1)",
    )
    p.add_argument("--count", type=int, metavar="N", help="stop after N refreshes")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these instances")


def _limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--revision",
        type=int,
        metavar="N",
        help="write at revision N (default: the stored one + 1); an older N is "
        "'stale', the same N with another value a 'conflict'",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=3.0,
        metavar="SEC",
        help="seconds to wait for usage to come within the limit (default 3)",
    )


# -- helpers -----------------------------------------------------------------------------------
def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _gather(args: argparse.Namespace, names: list[str] | tuple[str, ...] = ()):
    from kvcached.control.view import gather

    if not args.timeout > 0:
        raise UsageError(f"{args.command}: --timeout {args.timeout:g} must be above 0 seconds")
    problems: list[str] = []
    rows, gpus = gather(
        args.ledger_dir, names, problems, timeout=args.timeout, configured_dir=args.configured_dir
    )
    _warn_held(gpus)
    return rows, gpus, problems


def _warn(problems: list[str]) -> None:
    for p in problems:
        print(f"{PROG}: warning: skipped a ledger: {p}", file=sys.stderr)


def _warn_held(gpus) -> None:
    for g in gpus:
        if g.locked_by:
            print(f"{PROG}: warning: {g.held_note}", file=sys.stderr)


def _running_names() -> list[str]:
    from kvcached.control.snapshot import read_snapshots

    return sorted({s.instance for s in read_snapshots() if s.alive})


def _not_running(names: list[str] | tuple[str, ...]) -> UsageError:
    running = _running_names()
    if not running:
        return UsageError("no kvcached instance is running on this machine")
    wanted = ", ".join(repr(n) for n in names)
    return UsageError(
        f"no kvcached instance named {wanted} is running; running: {', '.join(running)}"
    )


def parse_limit(text: str | None) -> int | None:
    """A SIZE argument: bytes, or ``None`` for none/unlimited/off."""
    if text is None:
        raise UsageError("limit: give SIZE (512M, 2G, 1.5g, bytes), none, or --percent P")
    if text.strip().lower() in ("none", "unlimited", "off", "no"):
        return None
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise UsageError(f"limit: SIZE {exc}") from None
    from kvcached.control.limits import MAX_LIMIT_BYTES

    if not 0 < value <= MAX_LIMIT_BYTES:
        raise UsageError(
            f"limit: SIZE {text!r} is out of range: give 1 byte to "
            f"{MAX_LIMIT_BYTES} bytes (8 EiB), or none to remove the limit"
        )
    return value


# -- commands ----------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    from kvcached.control.view import render_table

    rows, _gpus, problems = _gather(args, args.names)
    _warn(problems)
    missing = [n for n in dict.fromkeys(args.names) if n not in {r.name for r in rows}]
    if not rows and (missing or not args.json):
        raise (
            _not_running(missing)
            if missing
            else UsageError("no kvcached instance is running on this machine")
        )
    if args.json:
        _print_json([r.as_dict() for r in rows])  # nothing running: [] (an answer, not an error)
    else:
        print(render_table(rows))
    if missing:  # the ones found are listed; each unknown one is an error, as ls does
        raise _not_running(missing)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvcached.control.view import render_status

    rows, _gpus, problems = _gather(args, [args.name])
    _warn(problems)
    if not rows:
        raise _not_running([args.name])
    if args.json:
        _print_json({"instance": args.name, "gpus": [r.as_dict() for r in rows]})
    else:
        print(render_status(rows))
    return 0


def cmd_limit(args: argparse.Namespace) -> int:
    from kvcached.control.limits import set_limit
    from kvcached.errors import InstanceNotFoundError
    from kvcached.ledger.snapshot import LimitStatus

    if args.command == "limit-percent":
        percent, limit = args.percent, None
    elif args.percent is not None:
        if args.size is not None:
            raise UsageError("limit: give SIZE or --percent P, not both")
        percent, limit = args.percent, None
    else:
        percent, limit = None, parse_limit(args.size)
    if percent is not None and not 0 < percent <= 100:
        raise UsageError(f"limit: percent {percent:g} must be in (0, 100]")
    if args.revision is not None and args.revision < 1:
        raise UsageError(f"limit: --revision {args.revision} must be 1 or more")
    if args.wait < 0:
        raise UsageError(f"limit: --wait {args.wait:g} must be 0 or more seconds")
    try:
        if not args.timeout > 0:
            raise UsageError(f"limit: --timeout {args.timeout:g} must be above 0 seconds")
        result = set_limit(
            args.name,
            limit,
            percent=percent,
            revision=args.revision,
            directory=args.ledger_dir,
            configured_dir=args.configured_dir,
            wait_s=args.wait,
            timeout=args.timeout,
        )
    except InstanceNotFoundError:
        raise _not_running([args.name]) from None
    if args.json:
        _print_json(result.as_dict())
    else:
        for d in result.devices:
            what = format_bytes(d.limit_bytes) if d.limit_bytes else "none"
            line = f"{result.instance}: limit {what} (revision {d.revision}) on {d.gpu}: "
            if d.status == LimitStatus.APPLIED:
                line += f"applied, {format_bytes(d.charged_bytes)} in use"
            elif d.status == LimitStatus.DEFERRED:
                line += (
                    f"deferred, {format_bytes(d.charged_bytes)} still in use: growth is "
                    "blocked and memory is released as its blocks are freed"
                )
            elif d.status == LimitStatus.STALE:
                line += "stale, a newer revision is stored; nothing written"
            else:
                line += "conflict, this revision already holds another limit; nothing written"
            print(line)
    return 1 if result.status in (LimitStatus.STALE, LimitStatus.CONFLICT) else 0


def _live(args: argparse.Namespace, render_text) -> int:
    from kvcached.cli.screen import Screen, ctrl_c_sets, run_live

    if not args.interval > 0:
        raise UsageError(f"{args.command}: the refresh interval must be above 0 seconds")
    if args.count is not None and args.count < 1:
        raise UsageError(f"{args.command}: --count must be 1 or more")
    if args.json:  # one JSON document per refresh, a line each
        n = 0
        with ctrl_c_sets() as stop:
            while not stop.is_set():
                rows, gpus, _ = _gather(args, args.names)
                print(
                    json.dumps(
                        {
                            "time": time.time(),
                            "instances": [r.as_dict() for r in rows],
                            "gpus": [g.as_dict() for g in gpus],
                        }
                    ),
                    flush=True,
                )
                n += 1
                if args.count is not None and n >= args.count:
                    return 0
                stop.wait(args.interval)
        return 0
    return run_live(render_text, args.interval, count=args.count, screen=Screen())


def cmd_watch(args: argparse.Namespace) -> int:
    from kvcached.control.view import render_table

    def render(cols: int, lines: int) -> str:
        rows, _gpus, problems = _gather(args, args.names)
        head = f"Every {args.interval:g}s: kvctl list   {time.strftime('%H:%M:%S')}   (q quits)"
        body = render_table(rows) if rows else "no kvcached instance is running"
        text = "\n".join([head, "", body] + [f"warning: {p}" for p in problems])
        return "\n".join(line[:cols] for line in text.split("\n")[:lines]) + "\n"

    return _live(args, render)


def cmd_top(args: argparse.Namespace) -> int:
    from kvcached.control.view import render_top

    def render(cols: int, lines: int) -> str:
        rows, gpus, problems = _gather(args, args.names)
        return render_top(
            rows, gpus, width=cols, height=lines, footer=[f"warning: {p}" for p in problems]
        )

    return _live(args, render)


def cmd_gpus(args: argparse.Namespace) -> int:
    from kvcached.control.limits import ledger_dirs
    from kvcached.control.view import render_gpus

    _rows, gpus, problems = _gather(args)
    if not gpus:
        where = ", ".join(ledger_dirs(args.ledger_dir, configured_dir=args.configured_dir))
        if problems:
            raise UsageError(problems[0])
        raise UsageError(
            f"no kvcached ledger in {where} (no kvcached instance has used a GPU "
            "here; KVCACHED_LEDGER_DIR or --ledger-dir names the directory)"
        )
    if args.json:
        _print_json([g.as_dict() for g in gpus])
    else:
        print(render_gpus(gpus))
    # A refused ledger (another layout, corrupt, unreadable) is an error here, the
    # command's whole subject, even when others could be shown.
    for p in problems:
        print(f"{PROG}: {p}", file=sys.stderr)
    return 2 if problems else 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from kvcached.control.metrics import prometheus

    rows, gpus, problems = _gather(args)
    _warn(problems)
    if args.json:
        _print_json({"instances": [r.as_dict() for r in rows], "gpus": [g.as_dict() for g in gpus]})
    else:
        sys.stdout.write(prometheus(rows, gpus))
    return 0


COMMANDS = {
    "list": cmd_list,
    "ls": cmd_list,
    "status": cmd_status,
    "limit": cmd_limit,
    "limit-percent": cmd_limit,
    "watch": cmd_watch,
    "top": cmd_top,
    "kvtop": cmd_top,
    "gpus": cmd_gpus,
    "metrics": cmd_metrics,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return bare_command(parser)
    from kvcached.errors import KVCachedError

    try:
        from kvcached.config import get_config

        # A bad KVCACHED_* variable is an error here too; the ledger directory is
        # the one setting the commands use, handed to them on args.
        args.configured_dir = get_config().ledger_dir
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `kvctl list | head`
        return 0
    except (UsageError, KVCachedError, ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


def kvtop_main(argv: list[str] | None = None) -> int:
    """The ``kvtop`` console script: ``kvctl top``."""
    return main(["top", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
