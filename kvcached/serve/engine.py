"""One engine process: start it, see whether it lives and serves, stop it.

The engine runs in a session (and process group) of its own, so that a Ctrl-C
meant for serve does not reach it before serve decides the order, and so that a
router killed outright leaves it running for the next router to adopt. Its
output goes to a log file in the state directory (a pipe to a dead router
would kill it with SIGPIPE).

An :class:`EngineProcess` is either started here (``popen`` set: reaped
here) or adopted from a state file (only pid and start time known). Either
way, liveness is the pid *and* its start time, never the pid alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

from kvcached.log import get_logger
from kvcached.serve.state import process_start_ticks, same_process

log = get_logger("kvcached.serve")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return sorted(out)


#: The variable serve marks each engine with (``<state dir>/<model>``): how a
#: restarted router finds exactly the engines it started, even without their
#: state file, and how a stopping one makes sure none of them outlives it.
MARKER = "KVCACHED_SERVE_ENGINE"


def marker_of(pid: int) -> str | None:
    """The serve mark in process ``pid``'s environment (``<state dir>/<model>``),
    or None: unmarked, gone, or another user's."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    needle = f"{MARKER}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(needle):
            return entry[len(needle) :].decode(errors="replace")
    return None


def marked_groups(marker: str) -> dict[int, int]:
    """Process groups with a live process whose environment has ``MARKER=marker``:
    group id -> the start ticks of its leader (-1 if the leader is gone)."""
    needle = f"\0{MARKER}={marker}\0".encode()
    groups: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in b"\0" + f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone, or another user's
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 20 or fields[0] in ("Z", "X"):
            continue
        pgid = int(fields[2])
        ticks = process_start_ticks(pgid)
        groups[pgid] = ticks if ticks is not None else -1
    return groups


class EngineProcess:
    """An engine's main process (the leader of its process group)."""

    def __init__(
        self, pid: int, start_ticks: int, popen: subprocess.Popen[bytes] | None = None
    ) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.popen = popen
        self.returncode: int | None = None

    @classmethod
    def spawn(cls, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> EngineProcess:
        """Start ``argv``; raises ``OSError`` when it cannot be run (no such
        program, not executable), with the log already saying so."""
        with open(log_path, "ab") as out:
            out.write(f"\n$ {shlex.join(argv)}\n".encode())
            out.flush()
            try:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,
                )
            except OSError as exc:
                out.write(f"cannot run {argv[0]}: {exc.strerror}\n".encode())
                raise
        ticks = process_start_ticks(popen.pid)
        return cls(popen.pid, ticks if ticks is not None else -1, popen)

    def alive(self) -> bool:
        if self.popen is not None:
            code = self.popen.poll()
            if code is not None:
                self.returncode = code
                return False
            return True
        return same_process(self.pid, self.start_ticks)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def leftovers(self) -> list[int]:
        """Processes of the engine's group still alive (its workers outlive it for a while)."""
        return group_pids(self.pid)

    async def stop(self, timeout_s: float) -> bool:
        """SIGINT to the group (what Ctrl-C in a terminal sends: vLLM and SGLang
        shut down cleanly on it, closing their kvcached pools), SIGKILL to what is
        left after ``timeout_s``; returns when no process of the group is left.
        True: it ended on SIGINT."""
        if not self.alive() and not self.leftovers():
            return True
        self._signal_group(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        clean = True
        while self.alive() or self.leftovers():
            if time.monotonic() >= deadline:
                clean = False
                log.warning(
                    "engine pid %d did not stop within %.0f s of SIGINT; SIGKILL",
                    self.pid,
                    timeout_s,
                )
                self._signal_group(signal.SIGKILL)
                deadline = time.monotonic() + 30.0
                while (self.alive() or self.leftovers()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                break
            await asyncio.sleep(0.1)
        return clean

    def kill(self) -> None:
        """SIGKILL to the whole group at once (serve's last resort on exit)."""
        self._signal_group(signal.SIGKILL)
