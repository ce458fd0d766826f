"""``kvcached demo``: its load model, its summary, and whole runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvcached.cli.demo import Summary, render_summary
from kvcached.cli.demo_load import (
    BlockCounter,
    Request,
    Served,
    burst_windows,
    bursty_trace,
    replay,
)
from tests.control.kvctl_helpers import REPO
from tests.control.test_top_pty import ALT_SCREEN_OFF, Terminal

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_bursts_come_one_after_another():
    windows = burst_windows(3, 20.0)
    assert len(windows) == 3
    for (a0, a1), (b0, b1) in zip(windows, windows[1:], strict=False):
        assert a0 < a1 <= b0 < b1
    assert windows[0][0] > 0 and windows[-1][1] < 20.0


def test_a_trace_is_reproducible_and_bursts_when_it_should():
    burst = (5.0, 10.0)
    trace = bursty_trace(7, 200, 0.1, burst, budget_blocks=10_000)
    assert trace == bursty_trace(7, 200, 0.1, burst, budget_blocks=10_000)
    in_burst = sum(1 for r in trace if 50 <= r.arrival < 100)
    assert in_burst > 4 * (len(trace) - in_burst) / 3  # 5 s of burst vs 15 s of base load
    held = []
    served = Served(trace, BlockCounter(10**9).alloc, lambda b: None)
    for tick in range(200):
        served.step(tick)
        held.append(served.blocks_held)
    peak_in_burst = max(held[50:120])
    assert 0.3 * 10_000 < peak_in_burst < 0.7 * 10_000  # about BURST_SHARE of the budget
    assert max(held[:40]) < 0.15 * 10_000


def test_ample_memory_serves_everything_at_once():
    trace = bursty_trace(3, 300, 0.1, (2.0, 8.0), budget_blocks=5_000)
    served = replay(trace, 10**9, 340)  # time for the last arrivals to finish
    assert served.misses == served.delayed == served.preempted == 0
    assert served.finished == served.requests


def test_a_static_slice_delays_requests_but_never_deadlocks():
    trace = bursty_trace(3, 300, 0.1, (2.0, 8.0), budget_blocks=5_000)
    counter = BlockCounter(5_000 // 4)
    lowest = []

    def alloc(n):
        got = counter.alloc(n)
        lowest.append(counter.free_blocks)
        return got

    served = Served(trace, alloc, counter.free)
    for tick in range(300):
        served.step(tick)
    served.finish()
    assert min(lowest) >= 0  # never more than the slice
    assert served.misses > 0 and served.delayed > 0
    assert served.finished > 0.9 * served.requests  # the queue drains after the burst
    assert counter.free_blocks == 5_000 // 4  # every block came back


def test_a_running_request_that_cannot_grow_preempts_the_newest():
    # Two requests fill 10 blocks; the first then needs one more: the second is preempted.
    trace = [Request(0, 5, 4, 1), Request(0, 5, 4, 1)]
    counter = BlockCounter(10)
    served = Served(trace, counter.alloc, counter.free)
    served.step(0)
    assert served.admitted == 2 and counter.free_blocks == 0
    served.step(1)
    # The first one's block was refused (a miss): the newest gave back its 5 blocks and
    # waits again at the head of the queue, whose admission is refused too (a miss).
    assert (served.preempted, served.misses, served.delayed) == (1, 2, 1)
    assert counter.free_blocks == 4
    for tick in range(2, 40):
        served.step(tick)
    assert served.finished == 2 and counter.free_blocks == 10


def test_summary_reuse_is_the_sum_of_peaks_less_the_peak_of_the_total():
    per = [
        {
            "name": f"demo-{n}",
            "burst_s": [1.0, 2.0],
            "peak_bytes": 600 << 20,
            "requests": 100,
            "delayed": 0,
            "misses": 0,
            "preempted": 0,
            "static_delayed": 40,
            "static_misses": 30,
            "static_preempted": 1,
        }
        for n in ("chat", "code", "batch")
    ]
    s = Summary(
        3,
        1 << 30,
        972 << 20,
        20.0,
        per,
        peak_total_bytes=900 << 20,
        sum_of_peaks_bytes=1800 << 20,
        static_capacity_bytes=324 << 20,
    )
    assert s.reused_bytes == 900 << 20
    doc = s.as_dict()
    assert doc["reused_bytes"] == 900 << 20 and doc["static_split"]["delayed"] == 120
    text = render_summary(s)
    assert "reused             900.00 MiB" in text and "120 of 300 requests delayed" in text


def _bytes(text: str, label: str) -> int:
    m = re.search(rf"{label}\s+([\d.]+) (B|KiB|MiB|GiB)", text)
    assert m, f"no {label!r} in:\n{text}"
    return int(float(m.group(1)) * UNITS[m.group(2)])


def _counts(text: str, label: str) -> tuple[int, int, int]:
    m = re.search(rf"{label}\s+(\d+) of (\d+) requests delayed, (\d+) allocations refused", text)
    assert m, f"no {label!r} in:\n{text}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.slow  # the whole 20 s demo, ~1 min on 2 cores
def test_the_demo_with_its_defaults():
    """The README's main command, as a newcomer runs it (stdout not a terminal)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("KVCACHED_IPC_NAME", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvcached", "demo"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "\x1b[" not in out  # not a terminal: periodic lines, no screen control
    assert len(re.findall(r"^t=\s*[\d.]+s  demo-chat", out, re.M)) >= 5
    reused = _bytes(out, "reused")
    assert reused > 0
    # the summary prints GiB with two decimals: a figure there is +-5 MiB
    assert _bytes(out, "sum of the peaks") - _bytes(out, "peak of the total") == pytest.approx(
        reused, abs=6 << 20
    )
    kv_delayed, requests, _ = _counts(out, "kvcached")
    static_delayed, requests2, _ = _counts(out, "static split")
    assert requests == requests2 > 0
    assert static_delayed > kv_delayed
    for name in ("demo-chat", "demo-code", "demo-batch"):
        assert re.search(rf"^  {name} .* (\d+)\s+(\d+)\s+(\d+)$", out, re.M), out


@pytest.mark.slow  # a real demo run, ~10-30 s
def test_the_demo_on_a_terminal_draws_the_top_view_then_the_summary():
    term = Terminal(
        "demo", "--instances", "2", "--duration", "6", "--budget", "256M", module="kvcached"
    )
    try:
        assert term.read_until(
            lambda out: b"kvcached demo: 2 instances, each" in out, timeout=120
        ), term.output[-3000:]
        assert term.wait(timeout=30) == 0
        text = term.output.decode(errors="replace")
        assert text.count("kvcached demo   2 instances share 256.00 MiB") >= 3
        assert "demo-chat" in text and "demo-code" in text and "load now:" in text
        assert ALT_SCREEN_OFF in term.output
        assert text.rindex("reused") > text.rindex("load now:")  # the summary comes after
    finally:
        term.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--instances", "1"], "--instances 1: must be 2 to 8"),
        (["--duration", "1"], "--duration 1: must be 5 to 600 seconds"),
        (["--budget", "12X"], "--budget '12X' is not a size"),
        (["--budget", "1M"], "must be at least 64M"),
    ],
)
def test_bad_demo_options_exit_2(argv, message, capsys):
    from kvcached.cli.main import main

    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # a real demo run, ~10-30 s
def test_the_demo_started_beside_a_kvcached_folder_runs_the_installed_package(tmp_path):
    """Workers start with ``python -c``; a ``kvcached/`` folder in the working directory
    (the clone, seen from its parent) must not replace the package they import."""
    work = tmp_path / "work"
    (work / "kvcached").mkdir(parents=True)
    (work / "kvcached" / "__init__.py").write_text("")  # no __version__, no cli
    launcher = tmp_path / "bin" / "kvcached_cli.py"  # like the console script: not in cwd
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom kvcached.cli.main import main\nsys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("KVCACHED_IPC_NAME", None)
    done = subprocess.run(
        [
            sys.executable,
            str(launcher),
            "demo",
            "--instances",
            "2",
            "--duration",
            "5",
            "--budget",
            "64M",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=work,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"instances": 2' in done.stdout, done.stdout


def test_too_many_instances_for_the_budget_is_refused_with_the_budget_to_ask_for(capsys):
    from kvcached.cli.demo import min_budget
    from kvcached.cli.main import main

    assert main(["demo", "--budget", "64M", "--instances", "8"]) == 2
    err = capsys.readouterr().err
    assert "--budget 64.00 MiB is too small for 8 instances" in err, err
    assert f"raise --budget to {-(-min_budget(8) // (1 << 20))}M or more" in err, err
    assert "KVCACHED_GPU_UTILIZATION" not in err and len(err.strip().splitlines()) == 1
    assert min_budget(2) <= 64 << 20  # the smallest budget still runs two
