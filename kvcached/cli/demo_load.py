"""The demo's request load: bursty traces and the loop that serves them.

Pure Python (no torch, no device): the demo's workers run a trace against a
real KV cache, and the demo replays the same trace against a plain block
counter to see what a static split of the budget would have refused.

A request arrives at a tick, needs ``prompt`` blocks to be admitted, then
decodes for ``steps`` ticks, taking one more block every ``grow_every`` ticks,
and frees all its blocks when done. Serving is first come, first served, as an
engine's scheduler does: the queue's head is admitted when its blocks can be
had, and nothing behind it jumps the queue; a running request whose next block
is refused preempts the newest running request (see :class:`Served`). Every
refused allocation is a *miss*; a request admitted after the tick it arrived,
preempted, or never admitted is *delayed*.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Share of the budget, in blocks, that an instance uses while it bursts / between bursts.
BURST_SHARE = 0.4
BASE_SHARE = 0.04
#: Mean prompt size as a share of the budget (about 50 requests fill a burst).
PROMPT_SHARE = 0.01


@dataclass(frozen=True)
class Request:
    arrival: int  #: tick
    prompt: int  #: blocks to admit it
    steps: int  #: decode ticks once admitted
    grow_every: int  #: one more block every this many decode ticks

    def mean_blocks(self) -> float:
        return self.prompt + self.steps / self.grow_every / 2


def burst_windows(n: int, duration_s: float) -> list[tuple[float, float]]:
    """One burst per instance, one after the other, overlapping a little:
    together they cover the middle 80% of the run."""
    span = duration_s * 0.8 / n
    start = duration_s * 0.08
    overlap = 0.0
    return [(start + i * span, start + (i + 1) * span + overlap) for i in range(n)]


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: fine for the small rates of one tick.
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def bursty_trace(
    seed: int,
    ticks: int,
    tick_s: float,
    burst: tuple[float, float],
    budget_blocks: int,
    burst_share: float = BURST_SHARE,
    base_share: float = BASE_SHARE,
) -> list[Request]:
    """Requests for one instance: a low base load throughout and a burst in
    ``burst`` (seconds) that asks for about ``burst_share`` of the budget."""
    rng = random.Random(seed)
    mean_prompt = max(1, budget_blocks * PROMPT_SHARE)
    mean_steps, grow_every = 20, 2
    mean_blocks = mean_prompt + mean_steps / grow_every / 2
    life_ticks = mean_steps + 1
    # Little's law: blocks in use = arrival rate x lifetime x blocks per request.
    base_rate = budget_blocks * base_share / (life_ticks * mean_blocks)
    burst_rate = budget_blocks * (burst_share - base_share) / (life_ticks * mean_blocks)
    trace = []
    for tick in range(ticks):
        t = tick * tick_s
        lam = base_rate + (burst_rate if burst[0] <= t < burst[1] else 0.0)
        for _ in range(_poisson(rng, lam)):
            prompt = max(1, round(rng.uniform(0.5, 1.5) * mean_prompt))
            trace.append(Request(tick, prompt, rng.randint(10, 30), grow_every))
    return trace


class _Active:
    __slots__ = ("req", "blocks", "left", "done_steps")

    def __init__(self, req: Request, blocks: list[int]) -> None:
        self.req = req
        self.blocks = blocks
        self.left = req.steps
        self.done_steps = 0


class Served:
    """Serves one trace, a tick at a time, with ``alloc(n) -> list | None`` and
    ``free(list)`` (a KV cache's, or a :class:`BlockCounter`'s).

    When a running request cannot get its next block, the newest running
    request is preempted (its blocks freed, the request put back at the head
    of the queue to start over), as vLLM does, so a full cache never
    deadlocks with every request waiting for a block."""

    def __init__(
        self,
        trace: Sequence[Request],
        alloc: Callable[[int], list[int] | None],
        free: Callable[[list[int]], None],
    ) -> None:
        self._pending = deque(sorted(trace, key=lambda r: r.arrival))
        self._waiting: deque[Request] = deque()
        self._running: list[_Active] = []  # in order of admission
        self._alloc = alloc
        self._free = free
        self._delayed: set[int] = set()
        self.requests = len(self._pending)
        self.misses = 0
        self.preempted = 0
        self.admitted = 0
        self.finished = 0
        self.blocks_held = 0
        self.peak_blocks = 0

    @property
    def delayed(self) -> int:
        """Requests admitted after the tick they arrived, preempted, or never admitted."""
        return len(self._delayed)

    def _preempt(self, a: _Active) -> None:
        self._free(a.blocks)
        self.blocks_held -= len(a.blocks)
        self._waiting.appendleft(a.req)
        self._delayed.add(id(a.req))
        self.preempted += 1

    def step(self, tick: int) -> None:
        while self._pending and self._pending[0].arrival <= tick:
            self._waiting.append(self._pending.popleft())
        running = self._running
        i = 0
        while i < len(running):  # finish, or decode one step (maybe one block more)
            a = running[i]
            if a.left <= 0:
                self._free(a.blocks)
                self.blocks_held -= len(a.blocks)
                self.finished += 1
                running.pop(i)
                continue
            if (a.done_steps + 1) % a.req.grow_every == 0:
                got = self._alloc(1)
                while got is None:
                    self.misses += 1
                    victim = running.pop()  # the newest (maybe a itself)
                    self._preempt(victim)
                    if victim is a:
                        break
                    got = self._alloc(1)
                if got is None:
                    continue  # a was preempted; running[i] is the next one now
                a.blocks.extend(got)
                self.blocks_held += 1
            a.done_steps += 1
            a.left -= 1
            i += 1
        while self._waiting:  # first come, first served
            req = self._waiting[0]
            got = self._alloc(req.prompt)
            if got is None:
                self.misses += 1
                break
            self._waiting.popleft()
            running.append(_Active(req, got))
            self.blocks_held += req.prompt
            self.admitted += 1
            if tick > req.arrival:
                self._delayed.add(id(req))
        self.peak_blocks = max(self.peak_blocks, self.blocks_held)

    def finish(self) -> None:
        """End of the run: requests never admitted count as delayed; free the rest."""
        for req in list(self._waiting) + list(self._pending):
            self._delayed.add(id(req))
        self._waiting.clear()
        self._pending.clear()
        for a in self._running:
            self._free(a.blocks)
        self._running = []
        self.blocks_held = 0


class BlockCounter:
    """A static slice of ``capacity`` blocks: what an engine without kvcached has."""

    def __init__(self, capacity: int) -> None:
        self.free_blocks = capacity

    def alloc(self, n: int) -> list[int] | None:
        if n > self.free_blocks:
            return None
        self.free_blocks -= n
        return [0] * n

    def free(self, blocks: list[int]) -> None:
        self.free_blocks += len(blocks)


def replay(trace: Sequence[Request], capacity_blocks: int, ticks: int) -> Served:
    """``trace`` served from a static slice of ``capacity_blocks``."""
    counter = BlockCounter(capacity_blocks)
    served = Served(trace, counter.alloc, counter.free)
    for tick in range(ticks):
        served.step(tick)
    served.finish()
    return served
