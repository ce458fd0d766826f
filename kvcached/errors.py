"""The error types of kvcached: one hierarchy under :class:`KVCachedError`.

Three tiers of failure run through the package:

* running out is a return value (``None`` from ``alloc``), never one of these;
* misuse and environment problems raise one of these, with a message that names
  the argument, variable or file and what would be right;
* an impossible state is an ``assert`` naming the invariant it protects.
"""

from __future__ import annotations


class KVCachedError(Exception):
    """Base class of every error kvcached raises on purpose."""


class ConfigError(KVCachedError, ValueError):
    """An environment variable or argument holds a value kvcached cannot use."""

    def __init__(self, variable: str, value: object, allowed: str) -> None:
        self.variable = variable
        self.value = value
        self.allowed = allowed
        super().__init__(f"{variable}={value!r} is not valid: {allowed}")


class DriverError(KVCachedError):
    """A device driver call failed.

    ``call`` is the driver function (``cuMemMap``, ``hipMemCreate``, ``mmap``),
    ``code`` its numeric status, ``name`` the status' symbolic name.
    """

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = int(code)
        self.name = name
        self.detail = detail
        text = f"{call} failed: {name} ({self.code})"
        super().__init__(f"{text}: {detail}" if detail else text)


class DriverUnavailableError(KVCachedError):
    """The requested backend cannot run here (no NVIDIA driver, no ROCm library)."""


class OutOfPhysicalMemoryError(DriverError):
    """The device refused physical memory (CUDA_ERROR_OUT_OF_MEMORY or the host
    backend's capacity). Layers above turn it into a scheduling miss."""


class MappingError(KVCachedError, ValueError):
    """A map or unmap asked for a range that is not in the state it needs
    (already mapped, not mapped, outside the reservation, misaligned)."""


class BlockError(KVCachedError, ValueError):
    """A block id handed back to kvcached is wrong: freed twice, never
    allocated, or out of range. Nothing was changed."""


class CapacityError(KVCachedError):
    """A KV cache cannot even start: not one page could be mapped (the
    physical budget, the limit or the device allows no memory at all)."""


class LedgerError(KVCachedError):
    """The per-GPU ledger file cannot be used (layout, version, permissions)."""


class LedgerLayoutError(LedgerError):
    """The ledger file was written by another layout or version of kvcached."""


class LedgerPermissionError(LedgerError, PermissionError):
    """The ledger file or its directory denied access. It is the operating
    system's ``PermissionError`` (same ``errno`` and ``filename``) with a message
    saying who needs which access; kvcached never chmods to get around it."""


class LedgerCorruptError(LedgerLayoutError):
    """A ledger file whose header fits but whose contents cannot be true (a
    record out of range, charges above the device). Refused like a bad header;
    the file is left untouched."""


class LedgerBusyError(LedgerError):
    """The ledger's data lock was not free within the time allowed: another
    process holds it (stopped, traced or frozen). ``holder`` is the pid that
    the holder recorded (0: unknown), ``waited_s`` how long this process waited."""

    def __init__(self, message: str, holder: int = 0, waited_s: float = 0.0) -> None:
        self.holder = holder
        self.waited_s = waited_s
        super().__init__(message)


class LedgerReplacedError(LedgerError):
    """The ledger file this process uses is no longer the one at its path
    (unlinked or replaced): granting against it would count the GPU twice."""


class LedgerFullError(LedgerError):
    """Every pool or instance record of the ledger file is taken by a live owner."""


class InstanceNotFoundError(KVCachedError, LookupError):
    """No live kvcached instance has the given name."""
