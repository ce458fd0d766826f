"""Test runs on CPUs with AMX only: every Python process the tests start asks
Linux for AMX tile data at startup, so that native vLLM CPU servers, which load
nothing of kvcached, do not die at their first step with SIGILL
(``kvcached/integrations/amx.py`` says why). ``tests/conftest.py`` puts this
folder first on ``PYTHONPATH`` there; no other sitecustomize is shadowed on the
machines CI uses (pyenv's Python has none). It repeats amx.py's one syscall
rather than importing kvcached: tests check what a fresh process imports."""

import contextlib
import ctypes

with contextlib.suppress(OSError, AttributeError):  # off Linux x86-64: nothing to ask
    ctypes.CDLL(None, use_errno=True).syscall(
        ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)
    )
