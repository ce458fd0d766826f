"""``kvcached demo``: several engines share one memory budget, live.

Runs two or more instances (default three) in separate processes on the host
backend, no GPU and no engine needed. Each serves a stream of requests that
comes in a burst at its own time, allocating and freeing KV blocks through the
real block manager, charged to the real per-GPU ledger of a device whose
capacity is the demo's budget (a host device index of the demo's own, and a
ledger in a temporary directory). While it runs, the ``kvctl top`` view shows
each instance growing into memory another has just released; at the end a
summary gives each instance's peak, how much memory was reused across
instances (the sum of the peaks minus the peak of the total), the misses, and
what a static equal split of the budget would have refused under the same
requests (each instance's trace replayed against budget / N).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvcached.cli.demo_load import burst_windows, bursty_trace, replay
from kvcached.config import get_config
from kvcached.units import GIB, MIB, format_bytes

NAMES = ("chat", "code", "batch", "search", "agent", "summarize", "translate", "vision")
TICK_S = 0.1
SAMPLE_S = 0.05
DEFAULT_DURATION_S = 20.0
DEFAULT_INSTANCES = 3
DEFAULT_BUDGET = GIB
READY_TIMEOUT_S = 120.0


class DemoError(Exception):
    """The demo cannot run as asked (bad option, not enough memory): exit 2."""


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen
    stderr_path: str
    window: tuple[float, float]
    ready: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    trace: list = field(default_factory=list)
    peak_bytes: int = 0


@dataclass
class Summary:
    """What the demo measured (``as_dict`` is its ``--json`` output)."""

    instances: int
    budget_bytes: int
    usable_bytes: int  #: the budget less the ledger's safety margin
    duration_s: float
    per_instance: list[dict[str, Any]]
    peak_total_bytes: int
    sum_of_peaks_bytes: int
    static_capacity_bytes: int

    @property
    def reused_bytes(self) -> int:
        """Memory one instance mapped after another had released it: with the
        total never above its peak, every byte of the peaks beyond it was
        someone else's before."""
        return max(0, self.sum_of_peaks_bytes - self.peak_total_bytes)

    def total(self, key: str) -> int:
        return sum(int(p[key]) for p in self.per_instance)

    def as_dict(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "duration_s": self.duration_s,
            "per_instance": self.per_instance,
            "peak_total_bytes": self.peak_total_bytes,
            "sum_of_peaks_bytes": self.sum_of_peaks_bytes,
            "reused_bytes": self.reused_bytes,
            "static_capacity_bytes": self.static_capacity_bytes,
            "kvcached": {
                "misses": self.total("misses"),
                "delayed": self.total("delayed"),
                "requests": self.total("requests"),
            },
            "static_split": {
                "misses": self.total("static_misses"),
                "delayed": self.total("static_delayed"),
                "requests": self.total("requests"),
            },
        }


# ``python -m`` (or ``-c``) puts the working directory first on sys.path, so a
# ``kvcached/`` folder there (the clone, seen from its parent) would shadow the
# package. The worker's first path entry is the directory this very kvcached was
# imported from instead: it runs the parent's code, wherever the demo is started.
_WORKER_BOOT = (
    "import sys; sys.path[0] = sys.argv.pop(1); "
    "from kvcached.cli.demo_worker import main; sys.exit(main())"
)


def _package_root() -> str:
    import kvcached

    return os.path.dirname(os.path.dirname(os.path.abspath(kvcached.__file__)))


def _host_index() -> int:
    """A host device index of this demo's own: the host backend counts every
    process' memory of a device index across the machine, so two demos (or a
    test on host-0) must not share one."""
    return 1000 + os.getpid() % 1_000_000


def _start_worker(
    name: str, index: int, budget: int, ledger_dir: str, window: tuple[float, float]
) -> Worker:
    env = dict(os.environ)
    env.update(
        {
            "KVCACHED_DRIVER": "host",
            "KVCACHED_LEDGER_DIR": ledger_dir,
            "KVCACHED_IPC_NAME": name,
            "KVCACHED_LOG_LEVEL": "ERROR",
        }
    )
    fd, stderr_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=ledger_dir)
    cmd = [
        sys.executable,
        "-c",
        _WORKER_BOOT,
        _package_root(),
        json.dumps({"index": index, "capacity": budget}),
    ]
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, env=env, text=True
        )
    finally:
        os.close(fd)
    return Worker(name, proc, stderr_path, window)


def _reader(worker: Worker, inbox: queue.Queue) -> None:
    assert worker.proc.stdout is not None
    for line in worker.proc.stdout:
        with contextlib.suppress(ValueError):
            inbox.put((worker, json.loads(line)))
    inbox.put((worker, None))  # end of output: the process is gone


def _failure(worker: Worker) -> str:
    with contextlib.suppress(OSError):
        with open(worker.stderr_path) as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
        if lines:
            return f"instance {worker.name} failed: {lines[-1]}"
    return f"instance {worker.name} exited with code {worker.proc.poll()} before it finished"


class _Sampler:
    """Reads the demo's ledger: every instance's charge at one instant."""

    def __init__(self, ledger_dir: str) -> None:
        self.ledger_dir = ledger_dir
        self._ledger = None
        self.last = None

    def sample(self):
        from kvcached.ledger.file import list_ledgers
        from kvcached.ledger.ledger import Ledger

        if self._ledger is None:
            paths = list_ledgers(self.ledger_dir)
            if not paths:
                return None
            self._ledger = Ledger.open_existing(paths[0])
        self.last = self._ledger.snapshot()
        return self.last

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def demo_page_bytes() -> int:
    """One page of the workers' cache: K and V of their one layer, a
    ``KVCACHED_PAGE_SIZE_MB`` span each (their blocks tile it)."""
    from kvcached.cli.demo_worker import DEMO_SPEC_ARGS

    return get_config().page_size * 2 * DEMO_SPEC_ARGS["num_layers"]


def min_budget(instances: int) -> int:
    """The smallest budget on which ``instances`` workers all start: each maps its
    first page and keeps its reserved pool filled, within the budget less the
    ledger's safety margin (``KVCACHED_GPU_UTILIZATION``)."""
    config = get_config()
    at_rest = instances * (1 + config.min_reserved_pages) * demo_page_bytes()
    return int(-(-at_rest // config.gpu_utilization))


def _validate(duration_s: float, instances: int, budget: int) -> None:
    if not 2 <= instances <= len(NAMES):
        raise DemoError(f"--instances {instances}: must be 2 to {len(NAMES)}")
    if not 5 <= duration_s <= 600:
        raise DemoError(f"--duration {duration_s:g}: must be 5 to 600 seconds")
    if budget < 64 * MIB:
        raise DemoError(f"--budget {format_bytes(budget)}: must be at least 64M")
    need = min_budget(instances)
    if budget < need:
        config = get_config()
        at_rest = (1 + config.min_reserved_pages) * demo_page_bytes()
        raise DemoError(
            f"--budget {format_bytes(budget)} is too small for {instances} instances: each "
            f"holds {format_bytes(at_rest)} at rest (its first page and "
            f"KVCACHED_MIN_RESERVED_PAGES={config.min_reserved_pages} reserved pages of "
            f"{format_bytes(demo_page_bytes())}) within what the ledger's safety margin "
            f"leaves; raise --budget to {-(-need // MIB)}M or more, or use fewer --instances"
        )
    from kvcached.driver.host import available_ram

    if budget > available_ram() // 2:
        raise DemoError(
            f"--budget {format_bytes(budget)}: more than half of this machine's "
            f"available memory ({format_bytes(available_ram())}); pick a smaller one"
        )


def run_demo(
    duration_s: float = DEFAULT_DURATION_S,
    instances: int = DEFAULT_INSTANCES,
    budget: int = DEFAULT_BUDGET,
    seed: int = 1,
    as_json: bool = False,
    out: TextIO | None = None,
    full_screen: bool | None = None,
) -> int:
    """Run the demo; returns the exit code (0 done or stopped with q, 1 an
    instance failed, 2 bad options, 130 interrupted by Ctrl-C)."""
    from kvcached.cli.screen import Screen

    out = out or sys.stdout
    try:
        _validate(duration_s, instances, budget)
    except DemoError as exc:
        print(f"kvcached demo: {exc}", file=sys.stderr)
        return 2
    ledger_dir = tempfile.mkdtemp(prefix="kvcached-demo-")
    index = _host_index()
    ticks = int(round(duration_s / TICK_S))
    windows = burst_windows(instances, duration_s)
    names = [f"demo-{n}" for n in NAMES[:instances]]
    workers: list[Worker] = []
    sampler = _Sampler(ledger_dir)
    inbox: queue.Queue = queue.Queue()
    screen = Screen(out=out, full_screen=False if as_json else full_screen)
    log = out if not as_json else sys.stderr
    try:
        for name, window in zip(names, windows, strict=True):
            w = _start_worker(name, index, budget, ledger_dir, window)
            workers.append(w)
            threading.Thread(target=_reader, args=(w, inbox), daemon=True).start()
        print(
            f"kvcached demo: starting {instances} instances that share a "
            f"{format_bytes(budget)} budget on device host-{index} "
            f"(host backend, no GPU)...",
            file=log,
            flush=True,
        )
        failed = _await(workers, inbox, "ready", time.monotonic() + READY_TIMEOUT_S)
        if failed:
            print(f"kvcached demo: {failed}", file=sys.stderr)
            return 1
        geometry = workers[0].ready
        assert geometry is not None
        page_bytes, bpp = geometry["page_bytes"], geometry["blocks_per_page"]
        budget_blocks = budget // page_bytes * bpp
        t0 = _send_plans(workers, seed, ticks, budget_blocks)
        peak_total, usable, stopped = _watch(
            workers, inbox, sampler, screen, t0, duration_s, budget, index, as_json
        )
        if stopped:  # q pressed
            print("kvcached demo: stopped before the end; no summary", file=sys.stderr)
            return 0
        failed = next((_failure(w) for w in workers if w.result is None), None)
        if failed:
            print(f"kvcached demo: {failed}", file=sys.stderr)
            return 1
        summary = _summarize(
            workers, budget, usable or budget, duration_s, ticks, page_bytes, bpp, peak_total
        )
        if as_json:
            out.write(json.dumps(summary.as_dict(), indent=2) + "\n")
        else:
            out.write(render_summary(summary) + "\n")
        out.flush()
        return 0
    except KeyboardInterrupt:
        print("kvcached demo: interrupted", file=sys.stderr)
        return 130
    finally:
        sampler.close()
        for w in workers:
            _stop(w)
        shutil.rmtree(ledger_dir, ignore_errors=True)


def _send_plans(workers: list[Worker], seed: int, ticks: int, budget_blocks: int) -> float:
    """Give each worker its trace, all starting at one moment; returns it."""
    t0 = time.time() + 0.3
    for i, w in enumerate(workers):
        w.trace = bursty_trace(seed * 1000 + i, ticks, TICK_S, w.window, budget_blocks)
        plan = {
            "t0": t0,
            "tick_s": TICK_S,
            "ticks": ticks,
            "trace": [[r.arrival, r.prompt, r.steps, r.grow_every] for r in w.trace],
        }
        assert w.proc.stdin is not None
        w.proc.stdin.write(json.dumps(plan) + "\n")
        w.proc.stdin.flush()
    return t0


def _stop(w: Worker) -> None:
    """End a worker: one that finished exits by itself (closing its cache);
    one still serving (the demo was stopped or failed) is asked to now."""
    with contextlib.suppress(OSError, ValueError):
        if w.proc.stdin is not None:
            w.proc.stdin.close()  # a worker waiting for its plan exits on this
    if w.result is None and w.ready is not None and w.proc.poll() is None:
        with contextlib.suppress(OSError):
            w.proc.terminate()  # SIGTERM: it closes its cache and exits
    try:
        w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        w.proc.terminate()
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def _await(workers: list[Worker], inbox: queue.Queue, key: str, deadline: float) -> str | None:
    """Wait until every worker said ``key``; returns a failure's text, if one failed."""
    while any(getattr(w, key) is None for w in workers):
        left = deadline - time.monotonic()
        if left <= 0:
            late = [w.name for w in workers if getattr(w, key) is None]
            return f"{', '.join(late)} did not get {key} within {READY_TIMEOUT_S:g} s"
        try:
            w, msg = inbox.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if msg is None:
            if getattr(w, key) is None:
                return _failure(w)
            continue
        if msg.get("ready"):
            w.ready = msg
        if msg.get("done"):
            w.result = msg
    return None


def _watch(
    workers: list[Worker],
    inbox: queue.Queue,
    sampler: _Sampler,
    screen,
    t0: float,
    duration_s: float,
    budget: int,
    index: int,
    as_json: bool,
) -> tuple[int, int, bool]:
    """Sample the ledger and draw the view until every worker is done.
    Returns ``(peak of the total charge, the device's memory less the
    ledger's safety margin, stopped by the user)``."""
    by_name = {w.name: w for w in workers}
    pids = {w.proc.pid for w in workers}
    peak_total = usable = 0
    refresh_s = 0.25 if screen.full else 2.0
    next_draw = time.monotonic()
    deadline = time.monotonic() + (t0 - time.time()) + duration_s + 60
    with screen:
        while any(w.result is None for w in workers):
            with contextlib.suppress(queue.Empty):
                while True:
                    w, msg = inbox.get_nowait()
                    if msg is None and w.result is None:
                        return peak_total, usable, False  # died: reported by the caller
                    if msg and msg.get("done"):
                        w.result = msg
            snap = sampler.sample()
            if snap is not None:
                usable = snap.header.total_bytes - snap.header.safety_margin
                total = 0
                for inst in snap.instances:
                    w = by_name.get(inst.name)
                    if w is not None:
                        w.peak_bytes = max(w.peak_bytes, inst.charged)
                        total += inst.charged
                peak_total = max(peak_total, total)
            now = time.monotonic()
            if now >= next_draw and not as_json:
                next_draw = now + refresh_s
                t = max(0.0, time.time() - t0)
                if screen.full:
                    _draw_top(screen, workers, snap, pids, t, duration_s, budget, index)
                else:
                    screen.draw(_progress_line(workers, snap, t, budget))
            if now > deadline:
                return peak_total, usable, False
            if screen.wait(SAMPLE_S):
                return peak_total, usable, True
    return peak_total, usable, False


def _draw_top(
    screen,
    workers: list[Worker],
    snap,
    pids: set[int],
    t: float,
    duration_s: float,
    budget: int,
    index: int,
) -> None:
    """One frame of the full-screen view: the demo's instances and the device."""
    from kvcached.control.snapshot import read_snapshots
    from kvcached.control.view import gpu_rows, instance_rows, render_top

    order = {w.name: i for i, w in enumerate(workers)}
    rows = sorted(
        (
            r
            for r in instance_rows(
                [s for s in read_snapshots() if s.pid in pids],
                [snap] if snap else [],
            )
            if r.name in order
        ),
        key=lambda r: order[r.name],
    )
    cols, lines = screen.size()
    screen.draw(
        render_top(
            rows,
            gpu_rows([snap] if snap else []),
            width=cols,
            height=lines,
            title=(
                f"kvcached demo   {len(workers)} instances share "
                f"{format_bytes(budget)} on host-{index}   "
                f"{min(t, duration_s):4.1f} s of {duration_s:g} s   q stops"
            ),
            footer=_footer(workers, t),
        )
    )


def _load_now(w: Worker, t: float) -> str:
    return "burst" if w.window[0] <= t < w.window[1] else "quiet"


def _footer(workers: list[Worker], t: float) -> list[str]:
    load = "   ".join(f"{w.name} {_load_now(w, t)}" for w in workers)
    return [
        f"load now: {load}",
        f"peaks so far: {'   '.join(f'{w.name} {format_bytes(w.peak_bytes)}' for w in workers)}",
        "try, in another terminal: kvctl list   kvctl limit demo-chat 128M",
    ]


def _progress_line(workers: list[Worker], snap, t: float, budget: int) -> str:
    charged = {i.name: i.charged for i in snap.instances} if snap else {}
    parts = [
        f"{w.name} {format_bytes(charged.get(w.name, 0)):>10} ({_load_now(w, t)})" for w in workers
    ]
    total = sum(charged.get(w.name, 0) for w in workers)
    return (
        f"t={t:5.1f}s  "
        + "  ".join(parts)
        + f"  total {format_bytes(total)} of {format_bytes(budget)}"
    )


def _summarize(
    workers: list[Worker],
    budget: int,
    usable: int,
    duration_s: float,
    ticks: int,
    page_bytes: int,
    bpp: int,
    peak_total: int,
) -> Summary:
    n = len(workers)
    static_bytes = usable // n  # the same usable memory, split evenly
    static_blocks = max(0, static_bytes // page_bytes * bpp - 1)  # less the null block
    rows = []
    for w in workers:
        assert w.result is not None
        static = replay(w.trace, static_blocks, ticks)
        rows.append(
            {
                "name": w.name,
                "burst_s": [round(x, 1) for x in w.window],
                "peak_bytes": w.peak_bytes,
                "requests": w.result["requests"],
                "delayed": w.result["delayed"],
                "misses": w.result["misses"],
                "preempted": w.result["preempted"],
                "static_delayed": static.delayed,
                "static_misses": static.misses,
                "static_preempted": static.preempted,
            }
        )
    return Summary(
        n,
        budget,
        usable,
        duration_s,
        rows,
        peak_total,
        sum(w.peak_bytes for w in workers),
        static_bytes,
    )


def render_summary(s: Summary) -> str:
    """The summary as printed at the end of the demo."""
    head = ("instance", "burst at", "peak", "requests", "delayed", "misses")
    table = [head]
    for p in s.per_instance:
        a, b = p["burst_s"]
        table.append(
            (
                p["name"],
                f"{a:.1f}-{b:.1f} s",
                format_bytes(p["peak_bytes"]),
                str(p["requests"]),
                str(p["delayed"]),
                str(p["misses"]),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [
        "",
        f"kvcached demo: {s.instances} instances, each in its own process, shared one "
        f"{format_bytes(s.budget_bytes)} device",
        f"({format_bytes(s.usable_bytes)} usable after the ledger's safety margin) for "
        f"{s.duration_s:g} s. Each had a burst of requests",
        "at its own time; every block came from the real block manager, charged to the real "
        "ledger.",
        "",
    ]
    for r in table:
        lines.append(
            "  "
            + "  ".join(
                c.rjust(w) if i >= 2 else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    req = s.total("requests")
    pct = s.peak_total_bytes / s.usable_bytes * 100 if s.usable_bytes else 0.0
    lines += [
        "",
        f"  peak of the total  {format_bytes(s.peak_total_bytes)} ({pct:.0f}% of usable)",
        f"  sum of the peaks   {format_bytes(s.sum_of_peaks_bytes)}",
        f"  reused             {format_bytes(s.reused_bytes)} that one instance released and "
        "another then used",
        "                     (the sum of the peaks minus the peak of the total)",
        f"  kvcached           {s.total('delayed')} of {req} requests delayed, "
        f"{s.total('misses')} allocations refused",
        f"  static split       {s.total('static_delayed')} of {req} requests delayed, "
        f"{s.total('static_misses')} allocations refused",
        f"                     (the same requests, each instance fixed at "
        f"{format_bytes(s.static_capacity_bytes)} = usable / {s.instances})",
    ]
    return "\n".join(lines)
