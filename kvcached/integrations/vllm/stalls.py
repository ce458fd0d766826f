"""What kvcached costs a vLLM step, in the log: the steps' waits for page ops
on each rank, and the engine core's ``schedule()`` time with kvcached's part.

A step can wait before its first kernel in two ways: for ops still running
beside earlier steps (the planner's ``kvcached_wait``) and for the ops it
applies itself (``kvcached_sync``). The page thread's own time per batch says
how fast the ops beside steps ran (a step busy in Python slows them through
the GIL). The engine core's counts (``page_op_waits``) say how often a step
was told to wait, not for how long; these lines say how long, at most once
every :data:`LOG_EVERY_S` and only when there was something to wait for, so
that a serving run's log shows what kvcached cost its steps.

Both tallies run on every step, so they are plain sums with one writer each
(the step's thread; the page thread for its own two), no lock: a step pays
for a few clock reads and additions (about a microsecond on a CI machine).
"""

from __future__ import annotations

import time

from kvcached.log import get_logger

log = get_logger("integrations.vllm")

#: Seconds between two lines of one tally in the log (at most one per period).
LOG_EVERY_S = 60.0


class _Sums:
    """Named sums, and what they were when the log's period began."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self) -> None:
        for name in self.FIELDS:
            setattr(self, name, 0.0)
        self._since = dict.fromkeys(self.FIELDS, 0.0)
        self._logged = time.monotonic()

    @property
    def total(self) -> dict[str, float]:
        """Every sum since start."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def period_over(self, now: float | None) -> dict[str, float] | None:
        """The sums over the period once :data:`LOG_EVERY_S` have passed since
        it began (a new one begins); ``None`` before."""
        now = time.monotonic() if now is None else now
        if now - self._logged < LOG_EVERY_S:
            return None
        total = self.total
        period = {name: total[name] - self._since[name] for name in self.FIELDS}
        self._since, self._logged = total, now
        return period


class StepStalls(_Sums):
    """One rank's steps: how long they waited for page ops."""

    FIELDS = ("steps", "waits", "wait_s", "syncs", "sync_s", "beside", "beside_s")
    steps: float
    waits: float  #: steps that waited for ops beside earlier steps
    wait_s: float
    syncs: float  #: steps that applied ops of their own first
    sync_s: float
    beside: float  #: batches the page thread ran beside steps
    beside_s: float

    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        self.rank = rank
        self.max_wait_s = 0.0  #: the longest wait since start
        self._period_max_wait_s = 0.0

    def step(self, wait_s: float | None, sync_s: float | None) -> None:
        """A step began: it waited ``wait_s`` for ops beside earlier steps and
        ``sync_s`` applying its own (``None``: it did not). The step's thread."""
        self.steps += 1
        if wait_s is not None:
            self.waits += 1
            self.wait_s += wait_s
            self.max_wait_s = max(self.max_wait_s, wait_s)
            self._period_max_wait_s = max(self._period_max_wait_s, wait_s)
        if sync_s is not None:
            self.syncs += 1
            self.sync_s += sync_s
        self.maybe_log()

    def ran_beside(self, seconds: float) -> None:
        """The page thread ran one batch beside steps in ``seconds``."""
        self.beside += 1
        self.beside_s += seconds

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log the period's line when it is over and a step waited in it;
        returns the line (``None``: nothing logged)."""
        p = self.period_over(now)
        if p is None:
            return None
        longest, self._period_max_wait_s = self._period_max_wait_s, 0.0
        if not (p["waits"] or p["syncs"]):
            return None
        line = (
            f"page ops on rank {self.rank}, last {LOG_EVERY_S:.0f} s: {p['steps']:.0f} steps; "
            f"{p['waits']:.0f} waited {p['wait_s'] * 1e3:.1f} ms for ops beside earlier steps "
            f"(longest {longest * 1e3:.1f} ms); {p['syncs']:.0f} applied ops first, "
            f"{p['sync_s'] * 1e3:.1f} ms; the page thread ran {p['beside']:.0f} batches beside "
            f"steps in {p['beside_s'] * 1e3:.1f} ms"
        )
        log.info("%s", line)
        return line


class ScheduleCost(_Sums):
    """The engine core's ``schedule()`` per step, and kvcached's hooks in it
    (control requests and the step's page plan; the block pool's work inside
    vLLM's own scheduling is not separated) and in ``update_from_output``.
    The engine core's thread only."""

    FIELDS = ("steps", "schedule_s", "hooks_s")
    steps: float
    schedule_s: float
    hooks_s: float

    def step(self, schedule_s: float, hooks_s: float) -> None:
        self.steps += 1
        self.schedule_s += schedule_s
        self.hooks_s += hooks_s
        self.maybe_log()

    def output(self, hooks_s: float) -> None:
        self.hooks_s += hooks_s

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log the period's line when it is over and steps ran in it."""
        p = self.period_over(now)
        if p is None or not p["steps"]:
            return None
        per_step = {k: p[k] / p["steps"] * 1e3 for k in ("schedule_s", "hooks_s")}
        line = (
            f"engine core, last {LOG_EVERY_S:.0f} s: {p['steps']:.0f} steps; schedule() took "
            f"{per_step['schedule_s']:.3f} ms a step, kvcached's hooks "
            f"{per_step['hooks_s']:.3f} ms a step of schedule() and update_from_output() "
            "together"
        )
        log.info("%s", line)
        return line
