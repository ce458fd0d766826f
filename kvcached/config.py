"""Every ``KVCACHED_*`` / ``ENABLE_KVCACHED`` environment variable, read in one place.

:data:`VARIABLES` is the single table of names, defaults, allowed values and
meanings. :class:`Config` is the frozen, typed result of parsing them once;
:func:`get_config` caches it for the process. Only entry points call it (see
:func:`defaults`): the layers below take the settings as arguments. The table of variables in
``docs/configuration.md`` is generated from :data:`VARIABLES` (``python -m kvcached.config``) and a test
checks that the two agree, so they cannot drift.

Names, meanings and defaults follow the upstream kvcached project where it has
them; the ones it lacks are marked "new" in their doc.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcached.errors import ConfigError
from kvcached.units import MIB, parse_size

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BOOL_ALLOWED = "one of true/false, 1/0, yes/no, on/off"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DRIVERS = ("auto", "cuda", "hip", "host")


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(_BOOL_ALLOWED)


def _optional_bool(text: str) -> bool | None:
    if text.strip().lower() in ("", "auto"):
        return None
    try:
        return _bool(text)
    except ValueError:
        raise ValueError(f"auto, or {_BOOL_ALLOWED}") from None


def _ipc_name(text: str) -> str | None:
    text = text.strip()
    if not text:
        return None
    if not _NAME.match(text):
        raise ValueError(
            "1 to 48 characters of letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    return text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number in (0, 1], e.g. 0.95") from None
    if not 0.0 < value <= 1.0:
        raise ValueError("a number in (0, 1], e.g. 0.95")
    return value


def _page_size_mb(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 2 or value % 2:
        raise ValueError("a whole number of MiB that is a positive multiple of 2 (2, 4, 8, ...)")
    return value * MIB


def _count(text: str, least: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"a whole number >= {least}")
    return value


def _positive_count(text: str) -> int:
    return _count(text, least=1)


def _signed_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("a whole number (below 0: unlimited, 0: off)") from None


def _log_level(text: str) -> str:
    value = text.strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError("one of " + ", ".join(LOG_LEVELS))
    return value


def _driver(text: str) -> str:
    value = text.strip().lower()
    if value not in DRIVERS:
        raise ValueError("one of " + ", ".join(DRIVERS))
    return value


def _optional_size(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    if value <= 0:
        raise ValueError("a size above zero, e.g. 8G")
    return value


#: The host backend's capacity is at least one 2 MiB page and at most 8 PiB
#: (the ledger's bound on any device).
_HOST_MIN = 2 * MIB
_HOST_MAX = 1 << 53


def _host_capacity(text: str) -> int | None:
    value = _optional_size(text)
    if value is not None and not _HOST_MIN <= value <= _HOST_MAX:
        raise ValueError("a size of at least one 2 MiB page (2M) and at most 8 PiB, e.g. 8G")
    return value


def physical_memory() -> int:
    """Bytes of RAM the kernel reports (``MemTotal``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _directory(text: str) -> str:
    if not text.strip():
        raise ValueError("a directory path, e.g. /dev/shm")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError("a number of seconds above 0, e.g. 1 or 0.5")
    return value


@dataclass(frozen=True)
class Variable:
    """One environment variable: where it lands in :class:`Config` and what it means."""

    name: str
    field: str
    default: str
    parse: Callable[[str], Any]
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "ENABLE_KVCACHED",
        "enabled",
        "false",
        _bool,
        "Master switch. Engine integrations do nothing unless it is true.",
    ),
    Variable(
        "KVCACHED_AUTOPATCH",
        "autopatch",
        "true",
        _bool,
        "Patch vLLM/SGLang automatically when `ENABLE_KVCACHED` is true. Upstream "
        "required `1` explicitly; here it defaults on, and `0` leaves the engine to "
        "call `kvcached.integrations.*.apply()` itself.",
    ),
    Variable(
        "KVCACHED_IPC_NAME",
        "ipc_name",
        "",
        _ipc_name,
        "Instance name shared by every worker of one server; `kvctl` addresses "
        "instances by it. Unset: a distinct readable name per server "
        "(`<engine>-<pid>`).",
    ),
    Variable(
        "KVCACHED_CONTIGUOUS_LAYOUT",
        "contiguous_layout",
        "auto",
        _optional_bool,
        "KV layout: true = one VA range for all layers, false = one per layer. "
        "`auto` picks the measured faster layout for the backend (see Layouts).",
    ),
    Variable(
        "KVCACHED_GPU_UTILIZATION",
        "gpu_utilization",
        "0.95",
        _fraction,
        "Share of device memory kvcached may fill; the ledger's safety margin is "
        "total x (1 - this).",
    ),
    Variable(
        "KVCACHED_PAGE_SIZE_MB",
        "page_size",
        "2",
        _page_size_mb,
        "Page size in MiB, the unit of mapping and reclaim (a multiple of 2).",
    ),
    Variable(
        "KVCACHED_MIN_RESERVED_PAGES",
        "min_reserved_pages",
        "5",
        _count,
        "Pre-mapped idle pages the background refill keeps ready (vLLM: at least "
        "one step's `max_num_batched_tokens`, up to a quarter of the cache).",
    ),
    Variable(
        "KVCACHED_MAX_RESERVED_PAGES",
        "max_reserved_pages",
        "10",
        _count,
        "Most idle pre-mapped pages kept before the rest are unmapped (vLLM: at "
        "least twice the reserve).",
    ),
    Variable(
        "KVCACHED_BESIDE_STEPS",
        "beside_steps",
        "4",
        _positive_count,
        "New. vLLM: steps that may start while page ops sent beside an earlier step "
        "still run, before one waits for them (a step that uses a page they map waits "
        "anyway); 1 = the next step always waits. Under review in #34 for eager runs.",
    ),
    Variable(
        "KVCACHED_MAX_CACHED_TOKENS",
        "max_cached_tokens",
        "16000",
        _signed_int,
        "Cap on prefix-cached tokens held in idle blocks; below 0 unlimited, 0 "
        "turns prefix-cache retention off.",
    ),
    Variable(
        "KVCACHED_LOG_LEVEL",
        "log_level",
        "INFO",
        _log_level,
        "Level of kvcached's `[kvcached]` log lines.",
    ),
    Variable(
        "KVCACHED_DRIVER",
        "driver",
        "auto",
        _driver,
        "New. Backend: `cuda`, `hip`, `host` (CPU memory), or `auto` (CUDA if a "
        "CUDA device is present, HIP on a ROCm torch, else host).",
    ),
    Variable(
        "KVCACHED_HOST_CAPACITY",
        "host_capacity",
        "",
        _host_capacity,
        "New. Capacity of the `host` backend's device (`8G`, `512M`, bytes): at "
        "least 2M, at most the machine's memory (see `KVCACHED_HOST_OVERCOMMIT`). "
        "Unset: half of physical RAM.",
    ),
    Variable(
        "KVCACHED_HOST_OVERCOMMIT",
        "host_overcommit",
        "false",
        _bool,
        "New. Allow a `KVCACHED_HOST_CAPACITY` above the machine's memory (the "
        "kernel's overcommit then decides).",
    ),
    Variable(
        "KVCACHED_HOST_DEVICE",
        "host_device",
        "0",
        _count,
        "New. Which device (`host-N`) the `host` backend is: processes on one host "
        "device share its capacity and its ledger; another N is a separate budget.",
    ),
    Variable(
        "KVCACHED_LEDGER_DIR",
        "ledger_dir",
        "/dev/shm",
        _directory,
        "New. Directory of the per-GPU ledger files; every process sharing a GPU "
        "must use the same one.",
    ),
    Variable(
        "KVCACHED_CALIBRATION_INTERVAL_S",
        "calibration_interval_s",
        "1",
        _seconds,
        "New. Seconds between ledger calibrations against the driver's free memory.",
    ),
    Variable(
        "KVCACHED_YIELD_IDLE",
        "yield_idle",
        "false",
        _bool,
        "New. When another instance on the GPU misses memory with the budget spent, "
        "release idle memory to it (reserved pages, then unreferenced prefix-cache "
        "blocks, oldest first; never a block in use). Off until the H100 sweep's peaks "
        "past 2.5 req/s are measured with it (docs/ledger.md, Calls for memory).",
    ),
)


#: Switches that no longer choose anything: name -> (the value kvcached now always
#: acts on, why). Set to that value they are ignored; to another, refused, so a
#: setting that no longer holds is never silently dropped.
RETIRED: dict[str, tuple[bool, str]] = {
    "KVCACHED_OVERLAP_PAGE_OPS": (
        True,
        "removed in #34: vLLM's page ops a step does not use always run beside it, since "
        "every op before its step cost more on the H100 in both modes "
        "(docs/vllm-integration.md, Page ops per step); unset it",
    ),
}


@dataclass(frozen=True)
class Config:
    """The parsed environment. Build it with :meth:`from_env`; never mutate it."""

    enabled: bool
    autopatch: bool
    ipc_name: str | None
    contiguous_layout: bool | None
    gpu_utilization: float
    page_size: int
    min_reserved_pages: int
    max_reserved_pages: int
    beside_steps: int
    max_cached_tokens: int
    log_level: str
    driver: str
    host_capacity: int | None
    host_overcommit: bool
    host_device: int
    ledger_dir: str
    calibration_interval_s: float
    yield_idle: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Parse every variable of :data:`VARIABLES` from ``env`` (default
        ``os.environ``). Raises :class:`ConfigError` naming the first bad one."""
        env = os.environ if env is None else env
        for name, (kept, why) in RETIRED.items():
            raw = env.get(name)
            if raw is not None and raw.strip().lower() not in (_TRUE if kept else _FALSE):
                raise ConfigError(name, raw, why)
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = env.get(var.name)
            text = var.default if raw is None else raw
            try:
                values[var.field] = var.parse(text)
            except ValueError as exc:
                raise ConfigError(var.name, text, str(exc)) from None
        config = cls(**values)
        config._check_together()
        return config

    def _check_together(self) -> None:
        if self.max_reserved_pages < self.min_reserved_pages:
            raise ConfigError(
                "KVCACHED_MAX_RESERVED_PAGES",
                str(self.max_reserved_pages),
                f"must be >= KVCACHED_MIN_RESERVED_PAGES ({self.min_reserved_pages})",
            )
        if self.host_capacity is not None and not self.host_overcommit:
            ram = physical_memory()
            if self.host_capacity > ram:
                raise ConfigError(
                    "KVCACHED_HOST_CAPACITY",
                    str(self.host_capacity),
                    f"at most this machine's memory ({ram} bytes); set "
                    "KVCACHED_HOST_OVERCOMMIT=true to allow more",
                )

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed, checked like :meth:`from_env`."""
        config = dataclasses.replace(self, **changes)
        config._check_together()
        return config


_lock = threading.Lock()
_cached: Config | None = None


def get_config() -> Config:
    """The process' configuration, parsed from ``os.environ`` on first use."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = Config.from_env()
        return _cached


_defaults: Config | None = None


def defaults() -> Config:
    """Every variable at its documented default (:data:`VARIABLES`), whatever the
    environment says.

    Only the entry points (the engine integrations, the CLIs, ``serve``, the
    control API a process opens its cache with) read the environment, through
    :func:`get_config`; they hand the result down. The layers below them
    (``driver``, ``ledger``, ``memory``) take a :class:`Config` or single values
    as arguments, and an argument left unset there means this, never
    ``os.environ``."""
    global _defaults
    if _defaults is None:
        _defaults = Config.from_env({})
    return _defaults


def reload_config() -> Config:
    """Parse ``os.environ`` again (tests, and the CLI after it changes variables)."""
    global _cached
    with _lock:
        _cached = None
    return get_config()


def markdown_table() -> str:
    """``docs/configuration.md``'s table of variables, generated from :data:`VARIABLES`."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in VARIABLES:
        default = f"`{var.default}`" if var.default else "(unset)"
        lines.append(f"| `{var.name}` | {default} | {var.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
