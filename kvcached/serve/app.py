"""``kvcached serve``: the supervisor and sleep policy around the router.

:class:`Serve` owns every :class:`~kvcached.serve.model.ModelRuntime`, the
router's HTTP site and one policy loop that, every ``idle_check_s``:

* notices engines that died and restarts them as configured (with backoff);
* puts models to sleep ``idle_after`` seconds after their last request ended,
  and stops those at the ``stop`` level ``stop_after`` seconds into the sleep;
* under ``pressure: sleep-lru``, when a busy model's instance is short of
  memory (its allocation misses grow) and its GPU's ledger has no headroom,
  puts the least recently used idle model on that GPU to sleep.

Start-up takes the state directory's lock (one serve per port or
``state_dir``; a second one is refused before it touches anything), binds the
router (a port in use is one line), adopts the engines a previous router of
this state directory left running (state files; the engines carry serve's
mark, so one it does not adopt is stopped, never doubled), then starts the
``eager`` models that are not running. A model that fails past its restart
policy stops serve with status 1, naming it (``on_model_failure: exit``, the
default) or is left failed while the others serve (``keep-serving``).

Stop (SIGINT, SIGTERM, or :meth:`Serve.stop`) stops every engine, in reverse
order, then any process still carrying a model's mark, and removes the state
files, the lock, the snapshot segments (serve's and the engines'), the logs
of models that did not fail and the state directory if that empties it.

From a script: ``kvcached.serve.run(config)`` blocks until stopped;
``async with Serve(config) as serve:`` gives the running object.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from typing import Any

from aiohttp import web

from kvcached.control.yielding import growth_unit
from kvcached.log import get_logger
from kvcached.serve.config import ServeConfig
from kvcached.serve.model import ModelRuntime
from kvcached.serve.preflight import config_path, running_serve
from kvcached.serve.router import Router
from kvcached.serve.state import (
    FAILED,
    READY,
    SLEEPING,
    STARTING,
    ServeError,
    ServeLock,
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
        self.models = [
            ModelRuntime(m, config, self.store, self.publisher, self._given_up)
            for m in config.models
        ]
        self._by_name = {n: m for m in self.models for n in m.config.served_names}
        self.router = Router(self)
        self._lock = ServeLock(self.store.directory)
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stop_requested = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._adopted: set[str] = set()
        self._misses: dict[str, int] = {}
        self.port = config.port
        #: what :func:`run` returns: 1 once a model failed past its restart policy
        self.exit_code = 0
        self._why_exit = ""

    def find(self, name: str) -> ModelRuntime | None:
        return self._by_name.get(name)

    def is_up(self, m: ModelRuntime) -> bool:
        """For ``/ready``: the model is where the config wants it. Under
        ``keep-serving`` a model given up on holds nothing back: it will not
        come up, and the others serve (``/ready`` lists it as failed)."""
        if m.given_up and self.config.on_model_failure == "keep-serving":
            return True
        if m.state in (STARTING, FAILED):
            return False
        return m.config.start == "lazy" or m.counters.starts > 0 or m.name in self._adopted

    # -- lifetime ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the lock, bind the router, adopt, start the eager models. Raises
        :class:`~kvcached.serve.state.ServeError` (one line) when another serve
        runs with this state directory or config, or the port is in use."""
        refusal = running_serve(self.config)
        if refusal is not None:
            raise ServeError(refusal)
        info = {"port": self.config.port, "host": self.config.host}
        self._lock.acquire({**info, "config": config_path(self.config)})
        try:
            await self._bind()
            if self.port != self.config.port:  # port 0: say which one, for the next refusal
                self._lock.update({**info, "port": self.port, "config": config_path(self.config)})
        except BaseException:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            self._lock.release()
            with contextlib.suppress(OSError):
                os.rmdir(self.store.directory)  # only when it holds nothing of anyone
            raise
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
                if m.state == STARTING:
                    self._spawn_task(m.wait_started(), f"model {m.name}: adoption")
            else:
                m.publish()  # stopped, for kvctl, until it starts
            # Engines of this state directory that no state file names (one it lost,
            # or a second copy): never left running beside the one serve manages.
            await m.stop_orphans(keep=m.record.pid if m.name in self._adopted else 0)
        for m in self.models:
            if m.config.start == "eager" and m.name not in self._adopted:
                self._spawn_task(m.start(), f"model {m.name}: start")
        self._spawn_task(self._policy_loop(), "the policy loop")

    async def _bind(self) -> None:
        self._runner = web.AppRunner(self.router.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            why = (
                "is in use (another kvcached serve or another server)"
                if exc.errno == errno.EADDRINUSE
                else f"cannot be bound: {exc.strerror}"
            )
            raise ServeError(
                f"router address {self.config.host}:{self.config.port} {why}; "
                f"choose another port (port: in {self.config.source}, or --port)"
            ) from None
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]

    def _spawn_task(self, coro: Any, what: str) -> None:  # noqa: ANN401
        task = asyncio.ensure_future(coro)

        def done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("kvcached serve: %s failed", what, exc_info=t.exception())

        task.add_done_callback(done)
        self._tasks.append(task)

    def _given_up(self, m: ModelRuntime) -> None:
        if self.config.on_model_failure == "keep-serving":
            log.error(
                "kvcached serve: model %s failed and will not be restarted: %s; serving the "
                "other models (on_model_failure: keep-serving)",
                m.name,
                m.failure,
            )
            return
        log.error(
            "kvcached serve: model %s failed and will not be restarted: %s; stopping serve "
            "(on_model_failure: exit; keep-serving would keep the other models up)",
            m.name,
            m.failure,
        )
        self.exit_code = 1
        self._why_exit = f"; exit status 1: model {m.name} failed"
        self.request_stop()

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
        if not self._lock.held:  # never started, or refused: nothing here is ours
            return
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for m in reversed(self.models):
            await m.close()
        for m in reversed(self.models):
            await m.stop()
        for m in self.models:
            await m.stop_orphans()
            await m.close_session()
        if self._runner is not None:
            await self._runner.cleanup()
        for m in self.models:
            self.store.remove(m.name)
        self.publisher.close()
        await asyncio.get_running_loop().run_in_executor(None, _remove_dead_snapshots)
        self._clean_state_dir()
        self._lock.release()
        with contextlib.suppress(OSError):
            os.rmdir(self.store.directory)  # only if nothing (a kept log) is left
        log.info("kvcached serve: stopped%s", self._why_exit)

    def _clean_state_dir(self) -> None:
        """Logs of models that never failed go; a failed one's stay, and say where."""
        for m in self.models:
            paths = [m.log_path, m.log_path + ".1"]
            if m.failures:
                log.info(
                    "kvcached serve: model %s failed; its log stays: %s",
                    m.name,
                    m.log_path,
                )
                continue
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

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
        for m in self.models:
            await m.check_process()
            level = m.config.sleep.level
            if level == "none":
                continue
            if m.state == READY and not m.in_flight:
                await m.poll_activity()
                idle = m.config.sleep.idle_after
                if m.idle_for(time.monotonic()) >= idle:
                    await m.poll_activity(force=True)  # a direct client, just now?
                    if m.idle_for(time.monotonic()) >= idle:
                        await m.sleep(reason=f"idle for {idle:g} s", if_free=True)
            elif (
                level == "stop"
                and m.state == SLEEPING
                and time.monotonic() - m.slept_at >= m.config.sleep.stop_after
            ):
                await m.stop_sleeping(if_free=True)
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
                and pressure.get(o.name, (0, (), 0, 0))[1]
                and set(pressure[o.name][1]) & set(gpus)
            ]
            for victim in sorted(idle, key=lambda o: o.last_used):
                log.info(
                    "model %s misses memory on %s (headroom %d B): putting %s, the "
                    "least recently used idle model there, to sleep",
                    m.name,
                    ",".join(gpus),
                    headroom,
                    victim.name,
                )
                if await victim.sleep(reason=f"memory pressure from {m.name}", if_free=True):
                    break


def _remove_dead_snapshots() -> None:
    """An engine's snapshot segment outlives it when it was killed (or its
    interpreter ended without closing its instance); kvctl would sweep it on
    its next call, serve does now."""
    try:
        from kvcached.control.snapshot import read_snapshots

        read_snapshots(cleanup=True)
    except Exception:  # a segment we may not remove is not worth failing a shutdown
        log.debug("kvcached serve: dead snapshot sweep failed", exc_info=True)


def _pressure_view(names: list[str]) -> dict[str, tuple[int, tuple[str, ...], int, int]]:
    """Per instance: (allocation misses, its GPUs, the least ledger headroom there,
    the headroom below which it cannot grow: see :func:`growth_unit`)."""
    from kvcached.control.view import gather
    from kvcached.serve.sleep import configured_ledger_dir

    rows, gpus = gather(problems=[], configured_dir=configured_ledger_dir())
    headroom = {g.gpu: g.headroom_bytes for g in gpus}
    out: dict[str, tuple[int, tuple[str, ...], int, int]] = {}
    for r in rows:
        if r.name not in names or r.gpu not in headroom:
            continue
        misses, devs, room, unit = out.get(r.name, (0, (), 1 << 62, 0))
        out[r.name] = (
            misses + r.misses,
            (*devs, r.gpu),
            min(room, headroom[r.gpu]),
            max(unit, growth_unit(r.virtual_bytes, r.blocks_total, r.page_bytes)),
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
    return serve.exit_code


def run(config: ServeConfig, ready: Any = None) -> int:  # noqa: ANN401
    """Serve ``config`` until SIGINT or SIGTERM, or until a model fails past its
    restart policy (``on_model_failure: exit``); returns the exit status (0, or
    1 then). ``ready(serve)`` is called once the router listens. Raises
    :class:`~kvcached.serve.state.ServeError` when serve cannot start."""
    return asyncio.run(_main(config, ready))
