"""Model states, where serve keeps them and where ``kvctl`` reads them.

A model is in exactly one of :data:`STATES` at a time. Every transition is
written to two places:

* a state file per model in the serve's state directory
  (``<state_dir>/<model>.json``: engine pid and its start time, port, state,
  the limit to restore on wake), replaced atomically. A router that restarts
  (after a crash, even SIGKILL) reads these and adopts engines that still run,
  instead of starting second copies, and a model that had failed as failed
  (its reason, whether serve gave up on it, and so its log, are in the file);
  the pid is trusted only with the same start time (``/proc/<pid>/stat``), so
  a reused pid is not adopted;
* a kvcached snapshot segment per model (:mod:`kvcached.control.snapshot`,
  instance = the model's name, published by the router's pid, no pools) with a
  ``serve`` entry, so ``kvctl list/status/top/metrics`` show the state beside
  the engine's own memory figures. It dies with the router (its liveness lock),
  so a dead router's states never look current.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvcached.log import get_logger

log = get_logger("kvcached.serve")

STARTING, READY, SLEEPING, WAKING, STOPPED, FAILED = (
    "starting",
    "ready",
    "sleeping",
    "waking",
    "stopped",
    "failed",
)
STATES = (STARTING, READY, SLEEPING, WAKING, STOPPED, FAILED)
#: The ``serve_state`` gauge's value per state (``kvctl metrics``, ``/metrics``).
STATE_CODES = {s: i for i, s in enumerate(STATES)}

#: The states each state may go to (a state may always be re-published as itself).
#: Like llama-swap's process states: anything else is a bug, refused loudly.
TRANSITIONS: dict[str, frozenset[str]] = {
    # not running: started, or adopted as the previous router left it
    STOPPED: frozenset({STARTING, READY, SLEEPING, FAILED}),
    STARTING: frozenset({READY, FAILED, STOPPED}),
    READY: frozenset({SLEEPING, FAILED, STOPPED}),
    SLEEPING: frozenset({WAKING, FAILED, STOPPED}),
    WAKING: frozenset({READY, FAILED, STOPPED}),
    FAILED: frozenset({STARTING, STOPPED}),  # a restart, or serve stopping
}


class IllegalTransition(RuntimeError):
    """A model was asked to go from one state to another that its table does not allow."""


def check_transition(name: str, old: str, new: str) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if new not in TRANSITIONS:
        raise IllegalTransition(f"model {name}: {new!r} is not a state: one of {', '.join(STATES)}")
    if new != old and new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(TRANSITIONS[old]))
        raise IllegalTransition(
            f"model {name}: {old} -> {new} is not a transition; from {old}: {allowed}"
        )


@dataclass
class ModelRecord:
    """What one model's state file holds."""

    name: str
    state: str = STOPPED
    pid: int = 0  #: the engine's main process (also its process group); 0: none
    start_ticks: int = 0  #: its start time in clock ticks since boot (/proc/<pid>/stat)
    port: int = 0
    sleep_level: str = ""  #: the level it sleeps at now ("" when awake)
    restore_limit: int = 0  #: the instance limit to put back on wake (0: unlimited)
    held_before_sleep: int = 0  #: bytes the instance held when it was put to sleep
    failure: str = ""  #: why it failed last (kept while it is ``failed``)
    given_up: bool = False  #: failed past its restart policy: no restart comes
    failures: int = 0  #: times it failed under this state directory's routers (log kept)
    launch: str = ""  #: a digest of its launch (argv, env): a changed config is a new start
    router_pid: int = 0
    updated_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def process_start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time (field 22 of ``/proc/<pid>/stat``), or ``None``
    when it does not exist or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def same_process(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start_ticks``."""
    return pid > 0 and process_start_ticks(pid) == start_ticks


class StateStore:
    """The state directory: one JSON file per model, written atomically."""

    def __init__(self, directory: str) -> None:
        self.directory = directory  # made by the first write (or the serve's lock)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def log_path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.log")

    def write(self, record: ModelRecord) -> None:
        record.updated_at = time.time()
        record.router_pid = os.getpid()
        tmp = self.path(record.name) + f".{os.getpid()}.tmp"
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(record.as_dict(), f)
        os.replace(tmp, self.path(record.name))

    def read(self, name: str) -> ModelRecord | None:
        return self.read_from(self.directory, name)

    @staticmethod
    def read_from(directory: str, name: str) -> ModelRecord | None:
        """Model ``name``'s record in ``directory`` (None: none, or unreadable)."""
        path = os.path.join(directory, f"{name}.json")
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning(
                "serve state file %s is unreadable (%s); starting %s afresh", path, exc, name
            )
            return None
        known = set(ModelRecord.__dataclass_fields__)
        try:
            return ModelRecord(**{k: v for k, v in doc.items() if k in known})
        except TypeError as exc:
            log.warning("serve state file %s does not hold a model record (%s)", path, exc)
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))


class StatePublisher:
    """Publishes each model's state in a snapshot segment ``kvctl`` reads."""

    def __init__(self) -> None:
        self._publishers: dict[str, Any] = {}
        self._started_at = time.time()  # the router's start, not each publish's

    def publish(self, record: ModelRecord, extra: dict[str, Any] | None = None) -> None:
        from kvcached.control.snapshot import SnapshotPublisher

        pub = self._publishers.get(record.name)
        if pub is None:
            pub = self._publishers[record.name] = SnapshotPublisher(record.name)
        serve = {
            "state": record.state,
            "engine_pid": record.pid,
            "port": record.port,
            "sleep_level": record.sleep_level,
            "since": time.time(),
        }
        if extra:
            serve.update(extra)
        pub.publish(
            {
                "instance": record.name,
                "pid": os.getpid(),
                "engine": "kvcached-serve",
                "started_at": self._started_at,
                "updated_at": time.time(),
                "pools": [],
                "serve": serve,
            }
        )

    def close(self) -> None:
        for pub in self._publishers.values():
            pub.close()
        self._publishers.clear()


class ServeError(RuntimeError):
    """Serve cannot start as asked; the message is one line saying why and what to do."""


LOCK_FILE = "serve.lock"


def lock_holder(directory: str) -> dict[str, Any] | None:
    """What the serve that holds ``directory``'s lock wrote there (pid, port,
    config), or None when no live serve holds it. Creates nothing."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder(fd: int) -> dict[str, Any]:
    """What the holder of the lock file ``fd`` wrote in it (pid, port, config);
    empty while it has not written yet or wrote something else."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


class ServeLock:
    """One serve per state directory (by default: per router port): an exclusive
    ``flock`` on ``<state dir>/serve.lock``, held for the serve's life. The
    kernel drops it when the process dies, even by SIGKILL, so a restarted
    router takes it over; a second serve is refused before it touches anything."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self, info: dict[str, Any]) -> None:
        directory = os.path.dirname(self.path)
        made = not os.path.isdir(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            doc = _holder(fd)
            os.close(fd)
            if made:  # a directory that only a race between two serves created
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise ServeError(
                f"another kvcached serve (pid {doc.get('pid', '?')}, router port "
                f"{doc.get('port', '?')}, config {doc.get('config') or '?'}) already runs with "
                f"state directory {os.path.dirname(self.path)}; stop it first, or give this "
                "one another port or state_dir"
            ) from None
        self._fd = fd
        self.update(info)

    def update(self, info: dict[str, Any]) -> None:
        """Rewrite what a second serve is told about this one (pid added)."""
        assert self._fd is not None, "ServeLock.update before acquire"
        data = json.dumps({"pid": os.getpid(), **info}).encode()
        os.pwrite(self._fd, data, 0)  # then cut: a reader never finds the file empty
        os.ftruncate(self._fd, len(data))

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still held: a newcomer never sees ours as free
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
