"""What the ``kvcached_sglang.pth`` line calls: wait for ``import sglang``.

The ``.pth`` line itself only tests whether ``ENABLE_KVCACHED`` is set to
something other than an obvious "off" before importing this module, so a Python
started without it imports nothing of kvcached. The real parse of every
variable happens in :mod:`kvcached.config` when SGLang is imported.

Nothing here imports torch or SGLang; installing the hook costs one finder on
``sys.meta_path`` that looks at one name per import.
"""

from __future__ import annotations

import _thread
from types import ModuleType

from kvcached.integrations.import_hook import when_imported

_lock = _thread.allocate_lock()
_installed = False

#: The ``.pth`` file's one line (``setup.py`` writes it into the wheel, a test
#: checks the shipped file holds exactly this). Values that leave it off match
#: the false spellings of :mod:`kvcached.config`.
PTH_LINE = (
    "import os; os.environ.get('ENABLE_KVCACHED', '').strip().lower() "
    "not in ('', '0', 'false', 'no', 'off') and "
    "__import__('kvcached.integrations.sglang.autopatch', fromlist=['install']).install()"
)


def install() -> None:
    """Register the hook that applies the patch on ``import sglang`` (idempotent:
    a second ``.pth`` or a second call adds nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    when_imported("sglang", _on_sglang_imported)


def _on_sglang_imported(module: ModuleType) -> None:
    """Apply the patch unless ``KVCACHED_AUTOPATCH=0``.

    A bad ``KVCACHED_*`` value raises :class:`~kvcached.errors.ConfigError`
    out of ``import sglang``: the user asked for kvcached and must learn what
    to fix. Anything else that goes wrong leaves SGLang native with one
    ``[kvcached]`` error line, since an engine that still serves is better
    than one that cannot start.
    """
    from kvcached.config import get_config
    from kvcached.errors import ConfigError

    config = get_config()  # ConfigError propagates on purpose
    if not config.enabled or not config.autopatch:
        return
    try:
        from kvcached.integrations.sglang.patch import apply

        apply()
    except ConfigError:
        raise
    except Exception:  # the engine must keep starting
        from kvcached.log import get_logger

        get_logger("integrations.sglang").exception(
            "applying the SGLang patch failed; SGLang runs with its own KV cache"
        )


def installed() -> bool:
    """Whether :func:`install` ran in this process (tests)."""
    return _installed


__all__ = ["PTH_LINE", "install", "installed"]
