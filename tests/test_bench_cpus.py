"""benchmarks/kvharness/cpus.py: whole physical cores per benchmark server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvharness import cpus


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert cpus.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.parse_cpu_list("5") == [5]


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-2", "1,x-2"])
def test_a_bad_cpu_list_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        cpus.parse_cpu_list(bad)


def _ht(cpu: int) -> str:
    # 8 cores with 2 threads each, numbered as many VMs do: core k is CPUs k and k+8
    k = cpu % 8
    return f"{k},{k + 8}\n"


def test_siblings_stay_together_and_cores_are_not_split() -> None:
    cores = cpus.physical_cores(range(16), _ht)
    assert cores[0] == [0, 8] and len(cores) == 8
    sets, rest = cpus.split_cores(cores, 3, keep=1)
    assert sets == [[0, 8, 1, 9], [2, 10, 3, 11], [4, 12, 5, 13]]
    assert rest == [6, 14, 7, 15]
    used = [c for s in sets for c in s] + rest
    assert sorted(used) == list(range(16))


def test_unreadable_topology_makes_each_cpu_a_core() -> None:
    assert cpus.physical_cores([3, 1], lambda cpu: None) == [[1], [3]]


def test_too_few_cores_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match="3 servers one core each"):
        cpus.split_cores([[0], [1], [2]], 3, keep=1)


def test_a_pinned_command_runs_on_its_cpus_only() -> None:
    cpu = min(os.sched_getaffinity(0))
    argv = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    done = subprocess.run(cpus.pinned_argv(argv, [cpu]), capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"[{cpu}]"
