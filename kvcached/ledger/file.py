"""Opening a ledger file: create it race-free, or check it and refuse what does not fit.

A ledger file is created complete under a temporary name in the same directory
and then hard-linked to its real name; ``link`` never replaces an existing
name, so of two processes racing to create it one wins and the other opens
the winner's file. Nothing ever sees a half-initialised ledger under the real
name, and a file that is already there is never replaced, truncated, rewritten
or ``chmod``-ed: one of another magic, version or size is refused with an
error that says which and what to do. Files are opened with ``O_NOFOLLOW``
(a symbolic link in the ledger's place is refused) and created with mode
``0o666`` filtered by the process umask, so a shared group and a umask of
``0007`` let several users share it (see docs/ledger.md, Requirements).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcached.errors import LedgerError, LedgerLayoutError, LedgerPermissionError
from kvcached.ledger import layout
from kvcached.ledger.layout import Header

_SAFE_ID = re.compile(r"[^A-Za-z0-9:._-]")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_WHAT_TO_DO = (
    "stop every kvcached process that uses this device, then remove the file; "
    "kvcached never replaces or rewrites a ledger file itself"
)


def ledger_path(directory: str, device_id: str) -> str:
    """The ledger file of ``device_id`` (a PCI bus id, or ``host-N``) in ``directory``."""
    return os.path.join(directory, f"kvcached-ledger-{_SAFE_ID.sub('_', device_id)}")


@dataclass(frozen=True)
class Initial:
    """What a new ledger file starts with (sampled from the driver by its creator)."""

    device_id: str
    total_bytes: int
    safety_margin: int
    budget: int


def _permission(exc: OSError, path: str, doing: str) -> LedgerPermissionError:
    return LedgerPermissionError(
        exc.errno,
        f"{exc.strerror} while {doing} the kvcached ledger (KVCACHED_LEDGER_DIR). Every "
        "process that shares a GPU must be able to read and write its ledger; with several "
        "users, give them a common group, a setgid directory and a umask of 0007 "
        "(kvcached does not chmod)",
        path,
    )


def _refuse_symlink(path: str) -> LedgerError:
    return LedgerError(
        f"{path} is a symbolic link; kvcached does not follow links to its ledger "
        "(O_NOFOLLOW). Remove the link, or set KVCACHED_LEDGER_DIR to the real directory"
    )


def _open_error(exc: OSError, path: str, doing: str) -> Exception:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return _permission(exc, path, doing)
    if exc.errno == errno.ELOOP:
        return _refuse_symlink(path)
    if exc.errno == errno.EISDIR:
        return LedgerError(f"{path} is a directory, not a ledger file; {_WHAT_TO_DO}")
    directory = os.path.dirname(path)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.isdir(directory):
        return LedgerError(
            f"KVCACHED_LEDGER_DIR={directory!r} is not a directory; create it or point "
            "KVCACHED_LEDGER_DIR at an existing one (default /dev/shm)"
        )
    return exc


def _initial_bytes(initial: Initial) -> bytes:
    head = Header()
    head.magic = layout.MAGIC
    head.layout_version = layout.LAYOUT_VERSION
    head.header_size = layout.HEADER_SIZE
    head.pool_record_size = layout.POOL_RECORD_SIZE
    head.pool_slots = layout.POOL_SLOTS
    head.instance_record_size = layout.INSTANCE_RECORD_SIZE
    head.instance_slots = layout.INSTANCE_SLOTS
    head.file_size = layout.FILE_SIZE
    head.created_ns = time.time_ns()
    head.device_id = initial.device_id.encode()[: layout.DEVICE_ID_BYTES - 1]
    head.total_bytes = initial.total_bytes
    head.safety_margin = initial.safety_margin
    head.budget = max(0, initial.budget)
    head.calibration_seq = 1
    head.calibration_time_ns = head.created_ns
    head.calibration_free = initial.budget + initial.safety_margin
    return bytes(head) + bytes(layout.FILE_SIZE - layout.HEADER_SIZE)


def _create(path: str, initial: Initial) -> int | None:
    """Create the file complete under a temporary name and link it into place.
    Returns the open descriptor, or ``None`` when another process linked first."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise _open_error(exc, tmp, "creating") from exc
    try:
        data = _initial_bytes(initial)
        if os.pwrite(fd, data, 0) != len(data):
            raise LedgerError(f"short write creating {tmp}; is {directory} full?")
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:
            if exc.errno == errno.EPERM:
                raise LedgerError(
                    f"cannot hard-link {tmp} to {path} ({exc.strerror}); the ledger needs a "
                    "local filesystem with hard links: set KVCACHED_LEDGER_DIR, e.g. /dev/shm"
                ) from exc
            raise _open_error(exc, path, "creating") from exc
        return fd
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def check_header(raw: bytes, size: int, path: str, device_id: str | None) -> None:
    """Raise :class:`LedgerLayoutError` unless ``raw`` (the file's first bytes) and
    ``size`` describe a ledger of this exact layout for ``device_id``."""
    if size < len(layout.MAGIC) or raw[: len(layout.MAGIC)] != layout.MAGIC:
        found = raw[: len(layout.MAGIC)]
        raise LedgerLayoutError(
            f"{path} is not a kvcached ledger: its magic is {found!r}, expected "
            f"{layout.MAGIC!r} ({size} bytes). {_WHAT_TO_DO}"
        )
    if size < layout.HEADER_SIZE:
        raise LedgerLayoutError(
            f"{path} is truncated: {size} bytes, shorter than the {layout.HEADER_SIZE}-byte "
            f"header. {_WHAT_TO_DO}"
        )
    head = Header.from_buffer_copy(raw[: layout.HEADER_SIZE])
    if head.layout_version != layout.LAYOUT_VERSION:
        raise LedgerLayoutError(
            f"{path} has ledger layout version {head.layout_version}; this kvcached uses "
            f"version {layout.LAYOUT_VERSION}. Every process on a GPU must run the same "
            f"kvcached layout: {_WHAT_TO_DO}"
        )
    expected = {
        "header_size": layout.HEADER_SIZE,
        "pool_record_size": layout.POOL_RECORD_SIZE,
        "pool_slots": layout.POOL_SLOTS,
        "instance_record_size": layout.INSTANCE_RECORD_SIZE,
        "instance_slots": layout.INSTANCE_SLOTS,
        "file_size": layout.FILE_SIZE,
    }
    for field, want in expected.items():
        got = getattr(head, field)
        if got != want:
            raise LedgerLayoutError(
                f"{path} declares {field}={got}, this kvcached expects {want} at layout "
                f"version {layout.LAYOUT_VERSION}. {_WHAT_TO_DO}"
            )
    if size != layout.FILE_SIZE:
        kind = "truncated" if size < layout.FILE_SIZE else "longer than its layout"
        raise LedgerLayoutError(
            f"{path} is {kind}: {size} bytes, the layout needs {layout.FILE_SIZE}. {_WHAT_TO_DO}"
        )
    if device_id is not None:
        stored = head.device_id.decode(errors="replace")
        if stored != device_id[: layout.DEVICE_ID_BYTES - 1]:
            raise LedgerLayoutError(
                f"{path} belongs to device {stored!r}, not {device_id!r}. {_WHAT_TO_DO}"
            )


class LedgerFile:
    """An open, checked, mapped ledger file, and typed views of its words.

    Views (all over one ``MAP_SHARED`` mapping): ``i64`` and ``u64`` by 8-byte
    word, ``u32`` by 4-byte word, ``raw`` by byte. :meth:`close` releases them
    all and is idempotent.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)
        self.mm = mmap.mmap(fd, layout.FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.raw = memoryview(self.mm)
        self.i64 = self.raw.cast("q")
        self.u64 = self.raw.cast("Q")
        self.u32 = self.raw.cast("I")
        self.i32 = self.raw.cast("i")
        self._views = [self.i64, self.u64, self.u32, self.i32, self.raw]
        self.closed = False

    def view(self, v: memoryview) -> memoryview:
        """Register a derived view so that :meth:`close` releases it too."""
        self._views.append(v)
        return v

    def header(self) -> Header:
        """A copy of the header as it is now (not locked: for display)."""
        return Header.from_buffer_copy(self.mm[: layout.HEADER_SIZE])

    def open_again(self) -> int:
        """A new descriptor (a new open file description: its own OFD locks) of
        this same file; refuses if the name now points to another file."""
        try:
            fd = os.open(self.path, _OPEN_FLAGS)
        except OSError as exc:
            raise _open_error(exc, self.path, "opening") from exc
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise LedgerError(
                f"{self.path} was replaced by another file while this process used it; "
                "every process sharing the device must restart on the same ledger"
            )
        return fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for v in reversed(self._views):
            v.release()
        self._views.clear()
        self.mm.close()
        os.close(self.fd)


def _checked(fd: int, path: str, device_id: str | None) -> LedgerFile:
    """``fd`` as a :class:`LedgerFile` once its header fits; closed if it does not."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LedgerError(f"{path} is not a regular file; {_WHAT_TO_DO}")
        raw = os.pread(fd, layout.HEADER_SIZE, 0)
        check_header(raw, st.st_size, path, device_id)
        return LedgerFile(path, fd)
    except BaseException:
        os.close(fd)
        raise


def open_path(path: str) -> LedgerFile:
    """Open the existing ledger file at ``path`` (never create one), checked like
    :func:`open_file` but for the device id, which the header names."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(exc, path, "opening") from exc
    return _checked(fd, path, None)


def list_ledgers(directory: str) -> list[str]:
    """Paths of the ledger files in ``directory`` (sorted; none if it is missing)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        os.path.join(directory, n)
        for n in names
        if n.startswith("kvcached-ledger-") and ".tmp" not in n
    )


def open_file(directory: str, device_id: str, initial: Callable[[], Initial]) -> LedgerFile:
    """Open (creating if missing) the ledger of ``device_id`` in ``directory``.

    ``initial()`` returns the :class:`Initial` contents and is called only when
    this process creates the file. Raises :class:`LedgerLayoutError` for a file
    of another layout, :class:`LedgerPermissionError` (a ``PermissionError``)
    when access is denied, :class:`LedgerError` for the rest.
    """
    path = ledger_path(directory, device_id)
    for _ in range(100):
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError as exc:
            if not os.path.isdir(directory):
                raise _open_error(exc, path, "opening") from exc
            fd = _create(path, initial())
            if fd is None:
                continue  # another process linked its file first: open that one
        except OSError as exc:
            raise _open_error(exc, path, "opening") from exc
        return _checked(fd, path, device_id)
    raise LedgerError(f"{path} keeps appearing and disappearing; is something removing it?")
