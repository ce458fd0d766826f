"""CPU sets for benchmark servers: whole physical cores each, so that processes
compared with each other run on equal CPUs.

An eager vLLM step is CPU-bound, and on the GPU machines two engines of the
same code stepped up to 8-16% apart from one process to the next (the H200's
``vllm_step`` runs of 2026-12-06), more than the cost being measured. Giving each
server its own whole physical cores (hyperthread siblings together, never split
between two servers) takes the placement out of the comparison.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (the kernel's and taskset's form) as a sorted list."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part.strip():
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not N or N-M with N <= M")
        out.update(range(first, last + 1))
    if not out:
        raise ValueError(f"CPU list {text!r}: names no CPU")
    return sorted(out)


def _siblings(cpu: int) -> str | None:
    try:
        return (SYS_CPU / f"cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return None


def physical_cores(
    cpus: Iterable[int], siblings: Callable[[int], str | None] = _siblings
) -> list[list[int]]:
    """``cpus`` grouped by physical core (each group its hyperthread siblings
    among ``cpus``), in order of each core's first CPU. A CPU whose topology
    cannot be read is a core of its own."""
    cores: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(set(cpus)):
        text = siblings(cpu)
        key = tuple(parse_cpu_list(text)) if text else (cpu,)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values(), key=lambda c: c[0])


def split_cores(
    cores: list[list[int]], parts: int, keep: int = 1
) -> tuple[list[list[int]], list[int]]:
    """``parts`` equal CPU sets of whole cores, and the rest (at least ``keep``
    cores, for the client) as one set. ValueError when there are too few cores."""
    if parts < 1 or keep < 0:
        raise ValueError(f"parts={parts}, keep={keep}: need parts >= 1 and keep >= 0")
    each = (len(cores) - keep) // parts
    if each < 1:
        raise ValueError(
            f"{len(cores)} physical cores cannot give {parts} servers one core each and "
            f"keep {keep} for the client"
        )
    sets = [[c for core in cores[i * each : (i + 1) * each] for c in core] for i in range(parts)]
    rest = [c for core in cores[parts * each :] for c in core]
    return sets, rest


def pinned_argv(argv: list[str], cpus: Iterable[int]) -> list[str]:
    """``argv`` run on ``cpus`` only: a Python exec that sets its affinity first
    (children inherit it), with no tool beyond this interpreter."""
    cpu_list = ",".join(str(c) for c in sorted(set(cpus)))
    code = (
        "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
        "os.execv(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", code, cpu_list, *argv]


def available() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))
