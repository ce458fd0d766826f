"""The few libc calls the host backend needs that Python's ``mmap`` module
cannot make (fixed addresses, ``PROT_NONE`` reservations)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]

_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def mmap(
    addr: int | None, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0
) -> int:
    """``mmap(2)``; returns the address or raises ``OSError`` with errno."""
    result = _mmap(addr, length, prot, flags, fd, offset)
    if result is None or result == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def munmap(addr: int, length: int) -> None:
    """``munmap(2)``; raises ``OSError`` with errno."""
    if _munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
