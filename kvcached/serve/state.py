"""Model states, where serve keeps them and where ``kvctl`` reads them.

A model is in exactly one of :data:`STATES` at a time. Every transition is
written to two places:

* a state file per model in the serve's state directory
  (``<state_dir>/<model>.json``: engine pid and its start time, port, state,
  the limit to restore on wake), replaced atomically. A router that restarts
  (after a crash, even SIGKILL) reads these and adopts engines that still run,
  instead of starting second copies; the pid is trusted only with the same
  start time (``/proc/<pid>/stat``), so a reused pid is not adopted;
* a kvcached snapshot segment per model (:mod:`kvcached.control.snapshot`,
  instance = the model's name, published by the router's pid, no pools) with a
  ``serve`` entry, so ``kvctl list/status/top/metrics`` show the state beside
  the engine's own memory figures. It dies with the router (its liveness lock),
  so a dead router's states never look current.
"""

from __future__ import annotations

import contextlib
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
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def log_path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.log")

    def write(self, record: ModelRecord) -> None:
        record.updated_at = time.time()
        record.router_pid = os.getpid()
        tmp = self.path(record.name) + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record.as_dict(), f)
        os.replace(tmp, self.path(record.name))

    def read(self, name: str) -> ModelRecord | None:
        try:
            with open(self.path(name)) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning(
                "serve state file %s is unreadable (%s); starting %s afresh",
                self.path(name),
                exc,
                name,
            )
            return None
        known = set(ModelRecord.__dataclass_fields__)
        try:
            return ModelRecord(**{k: v for k, v in doc.items() if k in known})
        except TypeError as exc:
            log.warning(
                "serve state file %s does not hold a model record (%s)", self.path(name), exc
            )
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))


class StatePublisher:
    """Publishes each model's state in a snapshot segment ``kvctl`` reads."""

    def __init__(self) -> None:
        self._publishers: dict[str, Any] = {}

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
                "started_at": time.time(),
                "updated_at": time.time(),
                "pools": [],
                "serve": serve,
            }
        )

    def close(self) -> None:
        for pub in self._publishers.values():
            pub.close()
        self._publishers.clear()
