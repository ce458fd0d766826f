"""``kvcached serve``: the supervisor and sleep policy around the router.

:class:`Serve` owns every :class:`~kvcached.serve.model.ModelRuntime`, the
router's HTTP site and one policy loop that, every ``idle_check_s``:

* notices engines that died and restarts them as configured (with backoff);
* puts models to sleep ``idle_after`` seconds after their last request ended,
  and stops those at the ``stop`` level ``stop_after`` seconds into the sleep;
* under ``pressure: sleep-lru``, when a busy model's instance is short of
  memory (its allocation misses grow) and its GPU's ledger has no headroom,
  puts the least recently used idle model on that GPU to sleep.

Start-up adopts engines a previous router left running (state files), then
starts the ``eager`` models that are not running. Stop (SIGINT, SIGTERM, or
:meth:`Serve.stop`) stops every engine, in reverse order, and removes the
state files and snapshot segments, so nothing is left behind.

From a script: ``kvcached.serve.run(config)`` blocks until stopped;
``async with Serve(config) as serve:`` gives the running object.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

from aiohttp import web

from kvcached.log import get_logger
from kvcached.serve.config import ServeConfig
from kvcached.serve.model import ModelRuntime
from kvcached.serve.router import Router
from kvcached.serve.state import (
    FAILED,
    READY,
    SLEEPING,
    STARTING,
    STOPPED,
    StatePublisher,
    StateStore,
)

log = get_logger("kvcached.serve")


class Serve:
    """See the module docstring."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.store = StateStore(config.resolved_state_dir())
        self.publisher = StatePublisher()
        self.models = [ModelRuntime(m, config, self.store, self.publisher) for m in config.models]
        self._by_name = {n: m for m in self.models for n in m.config.served_names}
        self.router = Router(self)
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stop_requested = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._adopted: set[str] = set()
        self._misses: dict[str, int] = {}
        self.port = config.port

    def find(self, name: str) -> ModelRuntime | None:
        return self._by_name.get(name)

    def is_up(self, m: ModelRuntime) -> bool:
        """For ``/ready``: the model is where the config wants it."""
        if m.state in (STARTING, FAILED):
            return False
        return m.config.start == "lazy" or m.counters.starts > 0 or m.name in self._adopted

    # -- lifetime ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._runner = web.AppRunner(self.router.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info(
            "kvcached serve: router on http://%s:%d, %d model(s), state in %s",
            self.config.host,
            self.port,
            len(self.models),
            self.store.directory,
        )
        for m in self.models:
            record = self.store.read(m.name)
            if record is not None and await m.adopt(record):
                self._adopted.add(m.name)
            else:
                m.set_state(STOPPED, "not running")
        for m in self.models:
            if m.config.start == "eager" and m.name not in self._adopted:
                self._tasks.append(asyncio.ensure_future(m.start()))
        self._tasks.append(asyncio.ensure_future(self._policy_loop()))

    def request_stop(self) -> None:
        """Ask :meth:`wait_stopped`'s waiter to stop (safe from a signal handler)."""
        self._stop_requested.set()

    async def stop(self) -> None:
        """Stop every engine (reverse order) and the router; remove the state.
        Idempotent: a second call waits for the first one's work."""
        self._stop_requested.set()
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stop_task)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for m in reversed(self.models):
            await m.close()
        for m in reversed(self.models):
            await m.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        for m in self.models:
            self.store.remove(m.name)
        self.publisher.close()
        log.info("kvcached serve: stopped")

    async def wait_stopped(self) -> None:
        """Return once a stop was asked for (:meth:`request_stop`, :meth:`stop`)."""
        await self._stop_requested.wait()

    async def __aenter__(self) -> Serve:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the policy loop --------------------------------------------------------------------
    async def _policy_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.idle_check_s)
            try:
                await self.policy_pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pass must not end supervision
                log.exception("kvcached serve: policy pass failed")

    async def policy_pass(self) -> None:
        now = time.monotonic()
        for m in self.models:
            await m.check_process()
            level = m.config.sleep.level
            if level == "none" or m.lock.locked():
                continue
            if m.state == READY and m.idle_for(now) >= m.config.sleep.idle_after:
                await m.sleep(reason=f"idle for {m.config.sleep.idle_after:g} s")
            elif (
                level == "stop"
                and m.state == SLEEPING
                and now - m.slept_at >= m.config.sleep.stop_after
            ):
                await m.stop_sleeping()
        if self.config.pressure == "sleep-lru":
            await self._relieve_pressure()

    async def _relieve_pressure(self) -> None:
        """Sleep the least recently used idle model on a GPU where a busy one misses
        memory and the ledger has no headroom."""
        loop = asyncio.get_running_loop()
        pressure = await loop.run_in_executor(None, _pressure_view, [m.name for m in self.models])
        for m in self.models:
            seen = pressure.get(m.name)
            if seen is None:
                continue
            misses, gpus, headroom, page = seen
            grew = misses > self._misses.get(m.name, misses)
            self._misses[m.name] = misses
            if not (grew and m.in_flight and headroom < page):
                continue
            idle = [
                o
                for o in self.models
                if o is not m
                and o.state == READY
                and not o.in_flight
                and not o.lock.locked()
                and pressure.get(o.name, (0, (), 0, 0))[1]
                and set(pressure[o.name][1]) & set(gpus)
            ]
            if idle:
                victim = min(idle, key=lambda o: o.last_used)
                log.info(
                    "model %s misses memory on %s (headroom %d B): putting %s, the "
                    "least recently used idle model there, to sleep",
                    m.name,
                    ",".join(gpus),
                    headroom,
                    victim.name,
                )
                await victim.sleep(reason=f"memory pressure from {m.name}")


def _pressure_view(names: list[str]) -> dict[str, tuple[int, tuple[str, ...], int, int]]:
    """Per instance: (allocation misses, its GPUs, the least ledger headroom there,
    its largest block page... the smallest unit it can grow by)."""
    from kvcached.control.view import gather

    rows, gpus = gather(problems=[])
    headroom = {g.gpu: g.headroom_bytes for g in gpus}
    out: dict[str, tuple[int, tuple[str, ...], int, int]] = {}
    for r in rows:
        if r.name not in names or r.gpu not in headroom:
            continue
        misses, devs, room, page = out.get(r.name, (0, (), 1 << 62, 0))
        unit = max(1, r.virtual_bytes // max(1, r.blocks_total)) * 32
        out[r.name] = (
            misses + r.misses,
            (*devs, r.gpu),
            min(room, headroom[r.gpu]),
            max(page, unit),
        )
    return out


async def _main(config: ServeConfig, ready: Any = None) -> int:  # noqa: ANN401
    serve = Serve(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, serve.request_stop)
    try:
        await serve.start()
        if ready is not None:
            ready(serve)
        await serve.wait_stopped()
    finally:
        await serve.stop()
    return 0


def run(config: ServeConfig, ready: Any = None) -> int:  # noqa: ANN401
    """Serve ``config`` until SIGINT or SIGTERM; returns the exit status.
    ``ready(serve)`` is called once the router listens."""
    return asyncio.run(_main(config, ready))
