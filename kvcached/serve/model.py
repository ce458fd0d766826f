"""One served model: its engine process, its state machine, its counters.

Rules the class keeps:

* a model is in one state of :data:`~kvcached.serve.state.STATES`; every
  change goes through :meth:`ModelRuntime.set_state`, which refuses one that
  :data:`~kvcached.serve.state.TRANSITIONS` does not allow and writes the
  state file and the snapshot ``kvctl`` reads;
* transitions that act (start, sleep, wake, stop, restart) run under one
  per-model lock, so they never overlap; a wake is one task that every request
  arriving meanwhile joins, so sixteen requests to a sleeping model cause one
  wake;
* a request counts as in flight from the moment it is routed until its last
  byte is sent; the sleep policy acts only with nothing in flight and
  ``idle_after`` seconds after the *end* of the last request, and it re-checks
  under the lock, so a request that arrives while a sleep runs waits for that
  sleep, then for the wake, and is served. Requests that reach the engine
  without the router count too where its engine kind has request metrics
  (``sleep.engine_activity``);
* a start that fails and an engine that dies are one thing to the restart
  policy; once it gives up, ``on_given_up`` tells serve (which exits, or keeps
  serving the others, as ``on_model_failure`` says).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcached.log import get_logger
from kvcached.serve import sleep as sleep_levels
from kvcached.serve.config import ModelConfig, ServeConfig
from kvcached.serve.engine import MARKER, EngineProcess, free_port, marked_groups
from kvcached.serve.enginelog import failure_report, rotate_log
from kvcached.serve.engines import read_activity
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
    check_transition,
    same_process,
)

log = get_logger("kvcached.serve")

#: The shortest interval between two readings of a ready model's engine metrics
#: (for requests that bypass the router); a quarter of ``idle_after`` up to 60 s.
ACTIVITY_POLL_S = 1.0
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
        self,
        config: ModelConfig,
        serve: ServeConfig,
        store: StateStore,
        publisher: StatePublisher,
        on_given_up: Callable[[ModelRuntime], None] | None = None,
    ) -> None:
        self.config = config
        self.kind = config.kind
        self.serve = serve
        self.store = store
        self.publisher = publisher
        self.on_given_up = on_given_up
        self.record = ModelRecord(name=config.name, port=config.port or 0, launch=self._launch())
        self.process: EngineProcess | None = None
        self.in_flight = 0
        self.last_end = time.monotonic()  #: end of the last request (or of the last wake)
        self.last_used = time.monotonic()  #: start of the last request (LRU order)
        self.slept_at = 0.0
        self.state_since = time.time()
        self.counters = Counters()
        self.lock = asyncio.Lock()
        self.failure = ""
        self.given_up = False  #: failed past its restart policy: serve no longer tries
        self.failures = 0  #: times it failed (this or a killed router's run): its log is kept
        self.stopping = False  #: serve is shutting down: no restarts
        self._wake_task: asyncio.Task[None] | None = None
        self._restart_times: list[float] = []
        self._next_restart = 0.0
        self._kv_ledgers: tuple[str, ...] = ()  #: the ledgers it last slept on
        self._log_offset = 0  #: where the latest start's output begins in the log
        self._session: aiohttp.ClientSession | None = None
        self._next_poll = 0.0
        self._engine_requests: float | None = None  #: the engine's request counters, last read
        self.last_released_fraction: float | None = None
        self.last_kv_released = 0
        self.last_sleep_s: float | None = None  #: the last sleep's duration, under the lock
        self.last_wake_s: float | None = None  #: the last wake's, engine calls included

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

    @property
    def marker(self) -> str:
        """This model's engine mark (:data:`~kvcached.serve.engine.MARKER`)."""
        return f"{os.path.abspath(self.store.directory)}/{self.name}"

    @property
    def log_path(self) -> str:
        return self.store.log_path(self.name)

    def set_state(self, state: str, reason: str = "") -> None:
        check_transition(self.name, self.record.state, state)
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
        self.record.failure, self.record.given_up = self.failure, self.given_up
        self.record.failures = self.failures
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

    def record_first_byte(self, seconds: float) -> None:
        """A successful request's time to the engine's first byte (the TTFT histogram)."""
        self.counters.observe_ttft(seconds)

    def record_error(self) -> None:
        """A request answered with a status >= 400, or broken off."""
        self.counters.errors += 1

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
            if state in (SLEEPING, WAKING):
                await self._wake_locked()
            elif state in (STOPPED, STARTING):
                await self._start_locked(reason="request")

    @property
    def held_requests(self) -> int:
        """Requests the router holds for this model while it is not ready
        (starting, waking): they wait, as a queue in the engine would."""
        return self.in_flight if self.state != READY else 0

    @property
    def engine_reachable(self) -> bool:
        """Whether the engine is up to answer its own HTTP endpoints now."""
        return self.state == READY and self.process is not None and bool(self.record.port)

    # -- HTTP to the engine ---------------------------------------------------------------
    def client(self) -> aiohttp.ClientSession:
        """This model's one session to its engine."""
        return self._client()

    def _client(self) -> aiohttp.ClientSession:
        # One session (one connection pool) per model for probes, metrics and
        # sleep calls, opened in the event loop that uses it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            async with self._client().get(
                self.base_url + self.config.ready_path,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _engine_call(self, method: str, path: str, body: dict[str, object] | None) -> int:
        try:
            async with self._client().request(
                method,
                self.base_url + path,
                json=body,
                timeout=aiohttp.ClientTimeout(total=300),
            ) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("model %s: %s %s failed: %r", self.name, method, path, exc)
            return 0

    async def poll_activity(self, force: bool = False) -> None:
        """Count requests the engine served without the router (a client that
        talks to its port directly) as activity: ``last_end`` moves to now when
        requests run or wait in it, or its request counters moved since the
        last reading."""
        if not (self.config.sleep.engine_activity and self.kind.watches_activity):
            return
        now = time.monotonic()
        if self.state != READY or (not force and now < self._next_poll):
            return
        # Often enough that a direct request moves last_end by at most a quarter
        # of idle_after; rarely for a model that sleeps after hours.
        self._next_poll = now + min(max(ACTIVITY_POLL_S, self.config.sleep.idle_after / 4), 60.0)
        try:
            async with self._client().get(
                self.base_url + self.kind.metrics_path, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        reading = read_activity(text, self.kind)
        if reading is None:
            return
        busy, requests = reading
        if busy > 0 or (self._engine_requests is not None and requests != self._engine_requests):
            self.last_end = time.monotonic()
        self._engine_requests = requests

    # -- start / stop ---------------------------------------------------------------------
    async def start(self, reason: str = "configured") -> None:
        async with self.lock:
            await self._start_locked(reason)

    async def _start_locked(self, reason: str) -> None:
        if self.process is not None and self.process.alive():
            if await self._healthy():
                self.set_state(READY, "already running")
                return
        elif not self._spawn(reason):
            return
        await self._wait_ready()

    def _spawn(self, reason: str) -> bool:
        """Start the engine process; False (the model failed, for good) when it
        cannot be run at all."""
        cfg = self.config
        if not self.record.port:
            self.record.port = cfg.port or free_port(self.serve.engine_host)
        argv = cfg.argv(self.serve.engine_host, self.record.port)
        env = cfg.environment(os.environ)
        env[MARKER] = self.marker
        rotate_log(self.log_path)
        try:
            self._log_offset = os.path.getsize(self.log_path)
        except OSError:
            self._log_offset = 0
        self.counters.starts += 1
        try:
            self.process = EngineProcess.spawn(argv, env, self.log_path)
        except OSError as exc:
            # Not a crash a restart could mend: the program itself is missing or unusable.
            self._fail(f"cannot run {argv[0]!r}: {exc.strerror}", None, retry=False)
            return False
        self.record.pid = self.process.pid
        self.record.start_ticks = self.process.start_ticks
        self.record.sleep_level = ""
        self.failure = ""
        self._engine_requests = None
        self.set_state(STARTING, f"{reason}; pid {self.process.pid}, port {self.record.port}")
        return True

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        started = time.monotonic()
        while time.monotonic() < deadline:
            assert self.process is not None, "waiting for an engine that was never spawned"
            if not self.process.alive():
                code = self.process.returncode
                await self._stop_process()
                self._fail(f"engine exited with {code} while starting", code, starting=True)
                return
            if await self._healthy():
                self.last_end = time.monotonic()
                self.set_state(READY, f"up in {time.monotonic() - started:.1f} s")
                return
            await asyncio.sleep(0.25)
        await self._stop_process()
        self._fail(
            f"not ready within startup_timeout={self.config.startup_timeout:g} s",
            None,
            starting=True,
        )

    async def wait_started(self) -> None:
        """Wait for an adopted engine that was still starting."""
        async with self.lock:
            if self.state == STARTING:
                await self._wait_ready()

    def _fail(
        self, failure: str, code: int | None, *, retry: bool = True, starting: bool = False
    ) -> None:
        """The model failed: say why on serve's terminal (with the engine's own
        output), then schedule a restart as ``restart`` says, or give up."""
        self.failures += 1
        error, report = failure_report(self.log_path, self._log_offset)
        if error:
            failure = f"{failure}: {error}"
        self.failure = f"{failure}; log {self.log_path}"
        self.set_state(FAILED, self.failure)
        log.error("model %s: %s; from its log (%s):\n%s", self.name, failure, self.log_path, report)
        policy = self.config.restart
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < policy.window_s]
        # A failed start always counts as a failure, whatever its exit code.
        wanted = (
            retry
            and not self.stopping
            and (
                policy.policy == "always"
                or (policy.policy == "on-failure" and (starting or code != 0))
            )
        )
        if wanted and len(self._restart_times) < policy.max_restarts:
            delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(self._restart_times))
            self._next_restart = now + delay
            log.info("model %s: restarting in %.1f s", self.name, delay)
            return
        self._next_restart = 0.0
        if self.stopping:
            return
        if wanted:
            self.failure += (
                f"; it failed {len(self._restart_times) + 1} times within "
                f"restart.window_s={policy.window_s:g} s (restart.max_restarts="
                f"{policy.max_restarts})"
            )
        elif retry:
            self.failure += f" (restart.policy={policy.policy})"
        self.given_up = True
        self.publish()
        if self.on_given_up is not None:
            self.on_given_up(self)

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

    async def stop_orphans(self, keep: int = 0) -> int:
        """Stop every engine group marked as this model's but ``keep`` (a previous
        router's engine it does not adopt, or one that outlived its stop); the
        number stopped."""
        stopped = 0
        for pgid, ticks in marked_groups(self.marker).items():
            if pgid == keep:
                continue
            log.warning(
                "model %s: stopping engine process group %d, which a previous serve "
                "started and this one does not adopt",
                self.name,
                pgid,
            )
            await EngineProcess(pgid, ticks).stop(min(self.config.stop_timeout, 10.0))
            stopped += 1
        if stopped:
            await self._retire_dead()
        return stopped

    # -- sleep / wake ---------------------------------------------------------------------
    def idle_for(self, now: float) -> float:
        return 0.0 if self.in_flight else now - self.last_end

    async def sleep(self, reason: str = "idle", if_free: bool = False) -> bool:
        """Put the model to sleep at its configured level (``kv`` for ``stop``;
        the process stops later). False when it was not idle or not ready, or
        (``if_free``) another transition of it runs now."""
        if if_free and self.lock.locked():
            return False
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
                status = await self._engine_call(
                    *self.kind.sleep_call(self.config.sleep.weights_level)
                )
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
            self.last_sleep_s = time.monotonic() - began
            self.counters.sleep_seconds += self.last_sleep_s
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
            await self._died()
            return
        if self.record.sleep_level == "weights":
            for method, path, body in self.kind.wake_calls(self.config.sleep.weights_level):
                status = await self._engine_call(method, path, body)
                if status != 200:
                    await self._stop_process()
                    self._fail(f"the engine's wake call {method} {path} answered {status}", None)
                    return
        await loop.run_in_executor(
            None, sleep_levels.kv_wake, self.name, self.record.restore_limit, self._kv_ledgers
        )
        self.record.sleep_level = ""
        self.counters.wakes += 1
        self.last_wake_s = time.monotonic() - began
        self.counters.wake_seconds += self.last_wake_s
        self.last_end = time.monotonic()
        self.set_state(READY, f"woken in {1000 * (time.monotonic() - began):.1f} ms")

    async def stop_sleeping(self, if_free: bool = False) -> bool:
        """The ``stop`` level, ``stop_after`` seconds into a sleep: stop the process."""
        if if_free and self.lock.locked():
            return False
        async with self.lock:
            if self.state != SLEEPING or self.in_flight:
                return False
            await self._stop_process()
            self.record.sleep_level = ""
            self.set_state(STOPPED, f"asleep for {self.config.sleep.stop_after:g} s")
            return True

    # -- supervision ----------------------------------------------------------------------
    async def check_process(self) -> None:
        """Notice an engine that died on its own; restart it as the config says."""
        if self.stopping or self.lock.locked():
            return
        if self.state == FAILED:
            if self._next_restart and time.monotonic() >= self._next_restart:
                await self._restart()
            return
        if self.state not in (READY, SLEEPING, WAKING, STARTING):
            return
        if self.process is not None and self.process.alive():
            return
        async with self.lock:
            await self._died()

    async def _died(self) -> None:
        code = self.process.returncode if self.process is not None else None
        self.counters.deaths += 1
        pid = self.record.pid
        if self.process is not None:
            await self.process.stop(5.0)  # its workers may outlive it
            await self._retire_dead()
        self.process = None
        self.record.pid = 0
        self.record.sleep_level = ""
        self._fail(f"engine pid {pid} died (exit {code})", code)

    async def _restart(self) -> None:
        self._next_restart = 0.0
        self._restart_times.append(time.monotonic())
        self.counters.restarts += 1
        await self.start(reason="restart")

    # -- adoption -------------------------------------------------------------------------
    async def adopt(self, record: ModelRecord) -> bool:
        """Take over the engine a previous router left running, whatever state it
        was in, if it is still the process that router started (same pid and
        start time). One that does not answer yet is adopted as ``starting``
        (:meth:`wait_started`); one asleep as ``sleeping``. A model that had
        failed is adopted as ``failed``, with its reason: given up on, it stays
        so (``on_given_up`` is told again); else its restart comes after
        ``restart.backoff_s``; unless its launch (argv, environment) changed
        since: then it starts afresh. Its failures carry over, so its log is kept."""
        self.failures = record.failures
        if record.state == FAILED:
            return self._adopt_failed(record)
        if not (record.pid and same_process(record.pid, record.start_ticks)):
            return False
        self.record.port = record.port
        self.record.pid, self.record.start_ticks = record.pid, record.start_ticks
        self.record.restore_limit = record.restore_limit
        self.record.held_before_sleep = record.held_before_sleep
        self.process = EngineProcess(record.pid, record.start_ticks)
        if record.state in (SLEEPING, WAKING) and record.sleep_level:
            self.record.sleep_level = record.sleep_level
            self.slept_at = time.monotonic()
            self.set_state(SLEEPING, f"adopted pid {record.pid} asleep")
            if record.state == WAKING:
                await self.wake()
        elif await self._healthy(timeout_s=5.0):
            self.last_end = time.monotonic()
            self.set_state(READY, f"adopted pid {record.pid} on port {record.port}")
        else:
            self.set_state(STARTING, f"adopted pid {record.pid}, not answering yet")
        return True

    def _launch(self) -> str:
        launch = {
            "argv": self.config.argv(self.serve.engine_host, "{port}"),
            "env": self.config.environment({}),
        }
        return hashlib.sha256(json.dumps(launch, sort_keys=True).encode()).hexdigest()[:16]

    def _adopt_failed(self, record: ModelRecord) -> bool:
        # A failed model runs no engine (every path to failed stops it first).
        self.failures = max(1, record.failures)
        if record.launch and record.launch != self.record.launch:
            log.info(
                "model %s had failed under the previous router (%s); its launch changed "
                "since (argv, env), so it starts afresh",
                self.name,
                record.failure,
            )
            return False
        self.failure = record.failure or "it had failed before serve restarted"
        self.given_up = record.given_up
        self.set_state(FAILED, f"as the previous router left it: {self.failure}")
        if self.given_up:
            if self.on_given_up is not None:
                self.on_given_up(self)
            return True
        delay = self.config.restart.backoff_s
        self._next_restart = time.monotonic() + delay
        log.info("model %s: restarting in %.1f s", self.name, delay)
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
            "given_up": self.given_up,
            "log": self.log_path,
            "wakes": self.counters.wakes,
            "sleeps": self.counters.sleeps,
            "starts": self.counters.starts,
            "restarts": self.counters.restarts,
            "kv_released_fraction": self.last_released_fraction,
            "kv_released_bytes": self.last_kv_released,
            "last_sleep_s": self.last_sleep_s,
            "last_wake_s": self.last_wake_s,
        }

    async def close(self) -> None:
        """Serve is stopping: no more restarts, and the wake in progress ends."""
        self.stopping = True
        task = self._wake_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
