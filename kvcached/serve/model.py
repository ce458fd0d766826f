"""One served model: its engine process, its state machine, its counters.

Rules the class keeps:

* a model is in one state of :data:`~kvcached.serve.state.STATES`; every
  change goes through :meth:`ModelRuntime.set_state`, which writes the state
  file and the snapshot ``kvctl`` reads;
* transitions that act (start, sleep, wake, stop, restart) run under one
  per-model lock, so they never overlap; a wake is one task that every request
  arriving meanwhile joins, so sixteen requests to a sleeping model cause one
  wake;
* a request counts as in flight from the moment it is routed until its last
  byte is sent; the sleep policy acts only with nothing in flight and
  ``idle_after`` seconds after the *end* of the last request, and it re-checks
  under the lock, so a request that arrives while a sleep runs waits for that
  sleep, then for the wake, and is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcached.log import get_logger
from kvcached.serve import sleep as sleep_levels
from kvcached.serve.config import ModelConfig, ServeConfig
from kvcached.serve.engine import EngineProcess, free_port
from kvcached.serve.state import (
    FAILED,
    READY,
    SLEEPING,
    STARTING,
    STOPPED,
    WAKING,
    ModelRecord,
    StatePublisher,
    StateStore,
    same_process,
)

log = get_logger("kvcached.serve")

#: TTFT histogram buckets, seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ModelUnavailable(Exception):
    """The model cannot serve now: ``status`` 503 with ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Counters:
    """What ``/metrics`` reports per model."""

    requests: int = 0
    errors: int = 0  #: answered with a status >= 400, or broken off
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    sleeps: int = 0
    sleep_seconds: float = 0.0
    wakes: int = 0
    wake_seconds: float = 0.0
    starts: int = 0
    restarts: int = 0
    deaths: int = 0

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_buckets[i] += 1


class ModelRuntime:
    """See the module docstring."""

    def __init__(
        self, config: ModelConfig, serve: ServeConfig, store: StateStore, publisher: StatePublisher
    ) -> None:
        self.config = config
        self.serve = serve
        self.store = store
        self.publisher = publisher
        self.record = ModelRecord(name=config.name, port=config.port or 0)
        self.process: EngineProcess | None = None
        self.in_flight = 0
        self.last_end = time.monotonic()  #: end of the last request (or of the last wake)
        self.last_used = time.monotonic()  #: start of the last request (LRU order)
        self.slept_at = 0.0
        self.state_since = time.time()
        self.counters = Counters()
        self.lock = asyncio.Lock()
        self.failure = ""
        self.stopping = False  #: serve is shutting down: no restarts
        self._wake_task: asyncio.Task[None] | None = None
        self._restart_times: list[float] = []
        self._next_restart = 0.0
        self._kv_ledgers: tuple[str, ...] = ()  #: the ledgers it last slept on
        self.last_released_fraction: float | None = None
        self.last_kv_released = 0

    # -- state ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def base_url(self) -> str:
        return f"http://{self.serve.engine_host}:{self.record.port}"

    def set_state(self, state: str, reason: str = "") -> None:
        if state != self.record.state:
            log.info(
                "model %s: %s -> %s%s",
                self.name,
                self.record.state,
                state,
                f" ({reason})" if reason else "",
            )
            self.state_since = time.time()
        self.record.state = state
        self.publish()

    def publish(self) -> None:
        self.store.write(self.record)
        try:
            self.publisher.publish(
                self.record,
                {"since": self.state_since, "in_flight": self.in_flight, "failure": self.failure},
            )
        except Exception:  # a full /dev/shm must not stop serving; say so
            log.exception("model %s: could not publish its state for kvctl", self.name)

    # -- requests -------------------------------------------------------------------------
    def begin(self) -> None:
        self.in_flight += 1
        self.last_used = time.monotonic()
        self.counters.requests += 1

    def end(self) -> None:
        assert self.in_flight > 0, f"model {self.name}: a request ended that never began"
        self.in_flight -= 1
        self.last_end = time.monotonic()

    async def ensure_ready(self) -> None:
        """Return once the model serves; wake or start it first (one task for all
        waiting requests). Raises :class:`ModelUnavailable` after ``wake_timeout``."""
        if self.state == READY and not self.lock.locked():
            return
        if self.state == FAILED:  # restarts are the supervisor's (restart policy), not a request's
            raise ModelUnavailable(f"model {self.name!r} failed: {self.failure}", 30)
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.ensure_future(self._bring_up())
        task = self._wake_task
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.wake_timeout)
        except asyncio.TimeoutError:
            raise ModelUnavailable(
                f"model {self.name!r} is {self.state}; it was not ready within "
                f"wake_timeout={self.config.wake_timeout:g} s",
                5,
            ) from None
        if self.state != READY:
            raise ModelUnavailable(f"model {self.name!r} is {self.state}: {self.failure}", 10)

    async def _bring_up(self) -> None:
        async with self.lock:
            state = self.state
            if state == READY:
                return
            if state in (SLEEPING, WAKING):
                await self._wake_locked()
            elif state in (STOPPED, STARTING):
                await self._start_locked(reason="request")

    # -- start / stop ---------------------------------------------------------------------
    async def start(self, reason: str = "configured") -> None:
        async with self.lock:
            await self._start_locked(reason)

    async def _start_locked(self, reason: str) -> None:
        if self.process is not None and self.process.alive():
            if await self._healthy():
                self.set_state(READY, "already running")
                return
        else:
            self._spawn(reason)
        await self._wait_ready()

    def _spawn(self, reason: str) -> None:
        cfg = self.config
        if not self.record.port:
            self.record.port = cfg.port or free_port(self.serve.engine_host)
        argv = cfg.argv(self.serve.engine_host, self.record.port)
        env = cfg.environment(os.environ)
        self.process = EngineProcess.spawn(argv, env, self.store.log_path(self.name))
        self.record.pid = self.process.pid
        self.record.start_ticks = self.process.start_ticks
        self.record.sleep_level = ""
        self.counters.starts += 1
        self.failure = ""
        self.set_state(STARTING, f"{reason}; pid {self.process.pid}, port {self.record.port}")

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        started = time.monotonic()
        while time.monotonic() < deadline:
            assert self.process is not None, "waiting for an engine that was never spawned"
            if not self.process.alive():
                self.failure = (
                    f"engine exited with {self.process.returncode} while starting; "
                    f"log {self.store.log_path(self.name)}"
                )
                self.set_state(FAILED, self.failure)
                return
            if await self._healthy():
                self.last_end = time.monotonic()
                self.set_state(READY, f"up in {time.monotonic() - started:.1f} s")
                return
            await asyncio.sleep(0.25)
        self.failure = (
            f"not ready within startup_timeout={self.config.startup_timeout:g} s; "
            f"log {self.store.log_path(self.name)}"
        )
        await self._stop_process()
        self.set_state(FAILED, self.failure)

    async def _healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    self.base_url + self.config.ready_path,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _stop_process(self) -> None:
        if self.process is not None:
            await self.process.stop(self.config.stop_timeout)
            await self._retire_dead()
        self.process = None
        self.record.pid = 0
        self.record.start_ticks = 0

    async def _retire_dead(self) -> None:
        """No ledger charge outlives the engine, however it ended."""
        if not self.config.kvcached:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, sleep_levels.retire_dead_pools, self.name)
        except Exception:  # a ledger problem must not stop a shutdown; say so
            log.exception("model %s: could not retire its dead ledger records", self.name)

    async def stop(self, reason: str = "serve is stopping") -> None:
        """Stop the engine (SIGINT, then SIGKILL) and mark the model stopped."""
        async with self.lock:
            await self._stop_process()
            self.record.sleep_level = ""
            self.set_state(STOPPED, reason)

    # -- sleep / wake ---------------------------------------------------------------------
    def idle_for(self, now: float) -> float:
        return 0.0 if self.in_flight else now - self.last_end

    async def sleep(self, reason: str = "idle") -> bool:
        """Put the model to sleep at its configured level (``kv`` for ``stop``;
        the process stops later). False when it was not idle or not ready."""
        level = self.config.sleep.level
        if level == "none":
            level = "kv"  # an explicit sleep request (admin, pressure) on a model with none
        async with self.lock:
            if self.state != READY or self.in_flight:
                return False
            began = time.monotonic()
            loop = asyncio.get_running_loop()
            reading = await loop.run_in_executor(None, sleep_levels.read_kv, self.name)
            self.record.restore_limit = (
                reading.limit_bytes
                if reading is not None and reading.limit_bytes != sleep_levels.HOLD_AT_ZERO
                else 0
            )
            if level == "weights":
                api = sleep_levels.weights_api(self.config.engine, self.config.sleep.weights_level)
                status = await self._engine_call(*api.sleep)
                if status != 200:
                    log.warning(
                        "model %s: the engine's sleep answered %s; sleeping at kv level only",
                        self.name,
                        status,
                    )
                    level = "kv"
            before = await loop.run_in_executor(None, sleep_levels.kv_sleep, self.name)
            held_before = before.charged_bytes if before is not None else 0
            self._kv_ledgers = before.ledgers if before is not None else ()
            left = await loop.run_in_executor(None, sleep_levels.wait_released, self.name, 0.0)
            self.record.held_before_sleep = held_before
            self.last_kv_released = max(0, held_before - left)
            self.last_released_fraction = (
                self.last_kv_released / held_before if held_before else None
            )
            self.record.sleep_level = "weights" if level == "weights" else "kv"
            self.slept_at = time.monotonic()
            self.counters.sleeps += 1
            self.counters.sleep_seconds += time.monotonic() - began
            self.set_state(
                SLEEPING, f"{reason}; {held_before - left} of {held_before} KV bytes released"
            )
            return True

    async def wake(self) -> None:
        async with self.lock:
            if self.state in (SLEEPING, WAKING):
                await self._wake_locked()

    async def _wake_locked(self) -> None:
        began = time.monotonic()
        self.set_state(WAKING)
        loop = asyncio.get_running_loop()
        if self.process is None or not self.process.alive():
            self.failure = "the engine process is gone"
            self.set_state(FAILED, self.failure)
            return
        if self.record.sleep_level == "weights":
            api = sleep_levels.weights_api(self.config.engine, self.config.sleep.weights_level)
            status = await self._engine_call(*api.wake)
            if status != 200:
                self.failure = f"the engine's wake_up answered {status}"
                self.set_state(FAILED, self.failure)
                return
        await loop.run_in_executor(
            None, sleep_levels.kv_wake, self.name, self.record.restore_limit, self._kv_ledgers
        )
        self.record.sleep_level = ""
        self.counters.wakes += 1
        self.counters.wake_seconds += time.monotonic() - began
        self.last_end = time.monotonic()
        self.set_state(READY, f"woken in {1000 * (time.monotonic() - began):.1f} ms")

    async def stop_sleeping(self) -> bool:
        """The ``stop`` level, ``stop_after`` seconds into a sleep: stop the process."""
        async with self.lock:
            if self.state != SLEEPING or self.in_flight:
                return False
            await self._stop_process()
            self.record.sleep_level = ""
            self.set_state(STOPPED, f"asleep for {self.config.sleep.stop_after:g} s")
            return True

    async def _engine_call(self, method: str, path: str, body: dict[str, object] | None) -> int:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.request(
                    method,
                    self.base_url + path,
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=300),
                ) as resp,
            ):
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("model %s: %s %s failed: %r", self.name, method, path, exc)
            return 0

    # -- supervision ----------------------------------------------------------------------
    async def check_process(self) -> None:
        """Notice an engine that died on its own; restart it as the config says."""
        if self.stopping or self.lock.locked():
            return
        if self.state not in (READY, SLEEPING, WAKING, STARTING):
            if (
                self.state == FAILED
                and self._next_restart
                and time.monotonic() >= self._next_restart
            ):
                await self._restart()
            return
        if self.process is not None and self.process.alive():
            return
        code = self.process.returncode if self.process is not None else None
        self.counters.deaths += 1
        self.failure = f"engine pid {self.record.pid} died (exit {code})"
        log.warning("model %s: %s; log %s", self.name, self.failure, self.store.log_path(self.name))
        if self.process is not None:
            await self.process.stop(5.0)  # its workers may outlive it
            await self._retire_dead()
        self.process = None
        self.record.pid = 0
        self.set_state(FAILED, self.failure)
        policy = self.config.restart
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < policy.window_s]
        wanted = policy.policy == "always" or (policy.policy == "on-failure" and code != 0)
        if not wanted or len(self._restart_times) >= policy.max_restarts:
            self._next_restart = 0.0
            if wanted:
                self.failure += f"; {policy.max_restarts} restarts in {policy.window_s:g} s"
                self.set_state(FAILED, self.failure)
            return
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(self._restart_times))
        self._next_restart = now + delay
        log.info("model %s: restarting in %.1f s", self.name, delay)

    async def _restart(self) -> None:
        self._next_restart = 0.0
        self._restart_times.append(time.monotonic())
        self.counters.restarts += 1
        await self.start(reason="restart")

    # -- adoption -------------------------------------------------------------------------
    async def adopt(self, record: ModelRecord) -> bool:
        """Take over the engine a previous router left running, if it still runs and
        serves. Its state is rebuilt from the record and checked against the engine."""
        if not (record.pid and same_process(record.pid, record.start_ticks)):
            return False
        self.record.port = record.port
        self.record.pid, self.record.start_ticks = record.pid, record.start_ticks
        self.record.restore_limit = record.restore_limit
        self.record.held_before_sleep = record.held_before_sleep
        self.process = EngineProcess(record.pid, record.start_ticks)
        if not await self._healthy(timeout_s=5.0):
            if record.state == STARTING:
                self.set_state(STARTING, "adopted while starting")
                async with self.lock:
                    await self._wait_ready()
                return True
            log.warning(
                "model %s: adopted pid %d does not answer %s; stopping it",
                self.name,
                record.pid,
                self.config.ready_path,
            )
            await self._stop_process()
            return False
        if record.state in (SLEEPING, WAKING) and record.sleep_level:
            self.record.sleep_level = record.sleep_level
            self.slept_at = time.monotonic()
            self.set_state(SLEEPING, f"adopted pid {record.pid} asleep")
            if record.state == WAKING:
                await self.wake()
        else:
            self.last_end = time.monotonic()
            self.set_state(READY, f"adopted pid {record.pid} on port {record.port}")
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": list(self.config.aliases),
            "state": self.state,
            "engine": self.config.engine,
            "port": self.record.port,
            "pid": self.record.pid,
            "in_flight": self.in_flight,
            "sleep_level": self.record.sleep_level,
            "failure": self.failure,
            "wakes": self.counters.wakes,
            "sleeps": self.counters.sleeps,
            "starts": self.counters.starts,
            "restarts": self.counters.restarts,
            "kv_released_fraction": self.last_released_fraction,
            "kv_released_bytes": self.last_kv_released,
        }

    async def close(self) -> None:
        self.stopping = True
        task = self._wake_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
