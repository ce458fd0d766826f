"""Where a benchmark result came from: one ``provenance`` block for every result file.

Every benchmark under ``benchmarks/`` calls :func:`start` before it measures and
:func:`write_result` to write its JSON, so every file under ``benchmarks/results/``
says which commit it measured, the command that made it, the machine, and the load
average at the start and the end (timings on a shared 2-core machine mean little
without it). ``tests/test_readme_figures.py`` reads the block: a README figure is
only quoted from a file that has one, and never as current from a file marked stale.

The block::

    "provenance": {
        "commit": "0602e17...",           # git HEAD of the measured tree
        "tree_dirty": false,              # uncommitted changes to tracked files
        "command": "python benchmarks/memory.py --backend host",
        "machine": {"host": ..., "platform": ..., "cpu": ..., "cpus": 2, "python": ...},
        "load_average_start": [1.0, 0.9, 0.8],
        "load_average_end": [1.1, 0.9, 0.8],
        "started_utc": "...", "finished_utc": "...",
        "stale": "why"                    # only once the measured code has changed since
    }

A copy of the tree without its git history (the GPU machine gets one) names its
commit through ``KVCACHED_BENCH_COMMIT``; without either the commit is recorded as
``"unknown: ..."`` and the README check refuses to quote the file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "KVCACHED_BENCH_COMMIT"


def now_utc() -> str:
    """Now, UTC, to the second (ISO 8601): every result's timestamps."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> tuple[str, bool | None]:
    """The measured tree's commit and whether tracked files differ from it."""
    named = os.environ.get(COMMIT_ENV, "").strip()
    if named:
        return named, None  # a copy of the tree: its dirtiness is not ours to see
    head = _git("rev-parse", "HEAD")
    if not head:
        return f"unknown: no git checkout at {ROOT}; set {COMMIT_ENV}", None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, (bool(status) if status is not None else None)


def commit_label() -> str:
    """The commit as one string, ``-dirty`` appended where tracked files differ:
    for result files that carry a top-level ``commit`` beside their block."""
    sha, dirty = commit()
    return sha + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine as a reader compares two results: host, OS, CPU, Python, torch."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # never imported here: a benchmark may not need it
    if torch is not None:
        info["torch"] = getattr(torch, "__version__", None)
    return info


def command(argv: list[str] | None = None) -> str:
    """The command line that reproduces the run, from the repository root."""
    script = Path(sys.argv[0])
    try:
        script_text = str(script.resolve().relative_to(ROOT))
    except ValueError:
        script_text = str(script)
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script_text, *args])


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """The block as it stands before measuring (call it first: the load average then)."""
    sha, dirty = commit()
    return {
        "commit": sha,
        "tree_dirty": dirty,
        "command": command(argv),
        "machine": machine(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "started_utc": now_utc(),
    }


def finish(block: dict[str, Any]) -> dict[str, Any]:
    """The block completed after measuring (a copy; ``block`` is left as it was)."""
    done = dict(block)
    done["machine"] = {**machine(), **block.get("machine", {})}
    done["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    done["finished_utc"] = now_utc()
    return done


def code_changed(a: str, b: str, paths: tuple[str, ...]) -> list[str] | None:
    """The files under ``paths`` that differ between commits ``a`` and ``b``;
    None where git cannot tell (no checkout, an unknown commit)."""
    out = _git("diff", "--name-only", a, b, "--", *paths)
    return None if out is None else [line for line in out.splitlines() if line]


def check_same_code(commits: list[str], same_code: tuple[str, ...]) -> None:
    """ValueError unless git shows the code under ``same_code`` identical at
    every one of ``commits`` (the first against each other), naming what changed."""
    first = commits[0]
    for other in sorted(set(commits) - {first}):
        changed = code_changed(first, other, same_code) if same_code else None
        if changed != []:
            why = (
                f"{', '.join(changed[:5])} changed" if changed
                else "git cannot compare them" if same_code
                else "no code named to compare"
            )  # fmt: skip
            raise ValueError(
                f"the parts measured different commits {sorted(set(commits))} "
                f"({first[:12]} against {other[:12]}: {why}): not one result"
            )


def merged(
    blocks: list[dict[str, Any] | None], names: list[str], same_code: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The block of a result merged from parts (``blocks``: the parts' own, in
    order; ``names``: their files). A merge measures nothing itself, so its
    commit, machine and loads are the parts' (one commit: parts of different
    code are not one result). Parts of several commits are one result only
    where git shows the code under ``same_code`` (what the runs measure: the
    library, the client, the servers) identical at all of them, as when a
    sweep's later parts ran after its earlier results were committed; the
    block then names the last part's commit and lists them all under
    ``commits``. ValueError otherwise."""
    if not blocks or any(b is None or not {"commit", "command"} <= b.keys() for b in blocks):
        raise ValueError(
            "every part needs its provenance block with its commit and command "
            "(benchmarks/_provenance.py)"
        )
    parts: list[dict[str, Any]] = [b for b in blocks if b is not None]
    commits = [str(b["commit"]) for b in parts]
    same: dict[str, Any] = {}
    if len(set(commits)) != 1:
        check_same_code(commits, same_code)
        same = {
            "commit": parts[-1]["commit"],
            "commits": commits,
            "same_code": list(same_code),
        }
    return {
        **parts[0],
        **same,
        "tree_dirty": any(b.get("tree_dirty") for b in parts),
        "command": " ; ".join(b["command"] for b in parts),
        "load_average_start": parts[0].get("load_average_start"),
        "load_average_end": parts[-1].get("load_average_end"),
        "finished_utc": parts[-1].get("finished_utc"),
        "merged_from": list(names),
    }


def write_result(
    path: str | os.PathLike[str], result: dict[str, Any], block: dict[str, Any], indent: int = 2
) -> Path:
    """Write ``result`` with its completed provenance block as JSON at ``path``."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict, not {type(result).__name__}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["provenance"] = finish(block)
    out.write_text(json.dumps(result, indent=indent) + "\n")
    return out


# -- for files written without this module -----------------------------------------------------
RETROFIT_NOTE = (
    "retrofitted from the file's own fields and git history: commit is the commit "
    "that last changed this file (the measured tree was that commit's working "
    "tree); fields the run did not record are null"
)


def retrofit(path: str | os.PathLike[str]) -> bool:
    """Add a provenance block to a committed result file written without one, from
    its own ``command``/``machine`` fields and git history. False if it has one."""
    file = Path(path).resolve()
    data = json.loads(file.read_text())
    if "provenance" in data:
        return False
    rel = file.relative_to(ROOT)
    sha = _git("log", "-1", "--format=%H", "--", str(rel))
    if not sha:
        raise ValueError(f"{rel}: not committed; commit it first (its commit is what is recorded)")
    if not data.get("command"):
        raise ValueError(f"{rel}: has no 'command' field; add the command that made it")
    recorded = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    data["provenance"] = {
        "commit": sha,
        "tree_dirty": None,
        "command": data["command"],
        "machine": recorded or {"note": "not recorded; see the file's own fields"},
        "load_average_start": recorded.get("load_average_before"),
        "load_average_end": recorded.get("load_average_after"),
        "started_utc": None,
        "finished_utc": None,
        "retrofitted": RETROFIT_NOTE,
    }
    second = file.read_text().splitlines()[1:2] or [""]
    indent = len(second[0]) - len(second[0].lstrip(" ")) or 2
    file.write_text(json.dumps(data, indent=indent) + "\n")
    return True


def mark_stale(path: str | os.PathLike[str], reason: str) -> None:
    """Mark a result file stale: the code it measures changed since (say which commits,
    and the command that re-measures it). The README check then quotes it only as stale."""
    if not reason.strip():
        raise ValueError("reason must say what changed and how to re-measure")
    file = Path(path)
    data = json.loads(file.read_text())
    if "provenance" not in data:
        raise ValueError(f"{file}: no provenance block; retrofit it first")
    data["provenance"]["stale"] = reason
    second = file.read_text().splitlines()[1:2] or [""]
    indent = len(second[0]) - len(second[0].lstrip(" ")) or 2
    file.write_text(json.dumps(data, indent=indent) + "\n")


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python benchmarks/_provenance.py", description="Provenance of committed result files."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("retrofit", help="add a block to files written without one")
    r.add_argument("files", nargs="+")
    s = sub.add_parser("stale", help="mark a file stale")
    s.add_argument("file")
    s.add_argument("reason")
    args = ap.parse_args(argv)
    try:
        if args.command == "retrofit":
            for f in args.files:
                print(f"{f}: {'retrofitted' if retrofit(f) else 'has a provenance block'}")
        else:
            mark_stale(args.file, args.reason)
    except (ValueError, OSError) as exc:
        print(f"{ap.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
