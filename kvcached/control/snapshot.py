"""Live snapshots of kvcached instances, readable without attaching to a device.

Every process that uses kvcached publishes one snapshot: a small POSIX shared
memory segment (``posix_ipc``) named ``/kvcached.snap.<instance>.<pid>``
holding a JSON document behind a sequence counter. ``kvctl`` lists and reads
them from ``/dev/shm`` with no CUDA, no engine and no socket.

Liveness is a lock, not a pid: the publisher holds an OFD write lock on the
segment's first byte for its whole life. A reader that can see no lock there
knows the publisher is dead (a pid can be reused; a lock cannot outlive its
process). Dead segments are unlinked by whoever notices first, so a crashed
engine never leaves a snapshot that looks alive.

Segment layout (little-endian)::

    0   magic  b"KVCSNAP1"
    8   seq    u64   odd while the writer is mid-update
    16  length u32   bytes of JSON that follow
    24  (pad)
    32  JSON payload
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import posix_ipc

from kvcached.ledger.locks import ByteLock

MAGIC = b"KVCSNAP1"
HEADER = struct.Struct("<8sQI4x8x")  # 32 bytes
SEGMENT_BYTES = 64 * 1024
PREFIX = "kvcached.snap."
SHM_DIR = "/dev/shm"


def segment_name(instance: str, pid: int) -> str:
    return f"/{PREFIX}{instance}.{pid}"


def _unlink_at_exit(name: str, owner_pid: int) -> None:
    # A forked child inherits the finalizer but not the segment: only its creator unlinks.
    if os.getpid() == owner_pid:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


@dataclass(frozen=True)
class Snapshot:
    """One process' view of its instance, as published."""

    instance: str
    pid: int
    alive: bool
    data: dict[str, Any]
    segment: str


class SnapshotPublisher:
    """Owns one process' snapshot segment. ``publish(doc)`` replaces its content;
    ``close()`` (idempotent, also run at interpreter exit) unlinks it."""

    def __init__(self, instance: str, pid: int | None = None) -> None:
        self.instance = instance
        self.pid = os.getpid() if pid is None else pid
        self.name = segment_name(instance, self.pid)
        self._lock = threading.Lock()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)  # a dead predecessor with our pid
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o644, size=SEGMENT_BYTES)
        self._fd = shm.fd
        self._map = mmap.mmap(self._fd, SEGMENT_BYTES)
        self._liveness = ByteLock(self._fd, 0, f"snapshot {self.name}")
        if not self._liveness.acquire(wait=False):
            raise RuntimeError(f"snapshot segment {self.name} is held by another process")
        self._seq = 0
        self._map[: HEADER.size] = HEADER.pack(MAGIC, 0, 0)
        self._closed = False
        # An engine that never calls close() (or a KV cache closed, but not its instance)
        # still leaves no segment behind at interpreter exit.
        self._at_exit = weakref.finalize(self, _unlink_at_exit, self.name, os.getpid())

    def publish(self, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc, separators=(",", ":"), default=str).encode()
        if len(payload) > SEGMENT_BYTES - HEADER.size:
            raise ValueError(
                f"snapshot of {self.instance} is {len(payload)} bytes; the segment holds "
                f"{SEGMENT_BYTES - HEADER.size}"
            )
        with self._lock:
            if self._closed:
                return
            self._seq += 1  # odd: readers retry
            struct.pack_into("<Q", self._map, 8, self._seq)
            self._map[HEADER.size : HEADER.size + len(payload)] = payload
            struct.pack_into("<I", self._map, 16, len(payload))
            self._seq += 1
            struct.pack_into("<Q", self._map, 8, self._seq)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._at_exit.detach()
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(self.name)
            self._map.close()
            os.close(self._fd)  # drops the liveness lock

    def __enter__(self) -> SnapshotPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_segment(fd: int) -> dict[str, Any] | None:
    size = os.fstat(fd).st_size
    if size < HEADER.size:
        return None
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
        for _ in range(100):
            magic, seq, length = HEADER.unpack_from(view, 0)
            if magic != MAGIC:
                return None
            if seq % 2 == 0:
                payload = bytes(view[HEADER.size : HEADER.size + length])
                if struct.unpack_from("<Q", view, 8)[0] == seq:
                    return json.loads(payload) if payload else {}
            time.sleep(0.0005)
    return None


def _segments() -> Iterator[str]:
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    for entry in sorted(names):
        if entry.startswith(PREFIX):
            yield entry


def read_snapshots(cleanup: bool = True) -> list[Snapshot]:
    """Every snapshot on this machine, live ones and (unless cleaned up) dead ones.

    A dead publisher's segment is unlinked when ``cleanup`` is true and this
    process may remove it; otherwise it is returned with ``alive=False``.
    """
    found: list[Snapshot] = []
    for entry in _segments():
        rest = entry[len(PREFIX) :]
        instance, _, pid_text = rest.rpartition(".")
        if not instance or not pid_text.isdigit():
            continue
        try:
            fd = os.open(os.path.join(SHM_DIR, entry), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # vanished, or not ours to read
        try:
            alive = ByteLock(fd, 0, f"snapshot {entry}").held_elsewhere()
            data = _read_segment(fd)
        finally:
            os.close(fd)
        if not alive and cleanup:
            with contextlib.suppress(OSError, posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + entry)
                continue
        if data is None:
            continue
        found.append(Snapshot(instance, int(pid_text), alive, data, "/" + entry))
    return found
