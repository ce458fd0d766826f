"""kvcached inside SGLang.

SGLang has no plugin entry point, so the patch is delivered by a ``.pth`` file
that the kvcached wheel installs into ``site-packages`` (``kvcached_sglang.pth``):
with ``ENABLE_KVCACHED`` set, it registers a post-import hook, and when any
process imports ``sglang`` the hook calls :func:`apply`. With
``KVCACHED_AUTOPATCH=0`` nothing happens on import and the application calls
:func:`apply` itself.

Importing this package is cheap: it imports neither torch nor SGLang.
See ``docs/sglang-integration.md`` for the design.
"""

from __future__ import annotations

# Not ``from typing import TYPE_CHECKING``: this runs at interpreter start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from kvcached.integrations.sglang.patch import ApplyResult

__all__ = ["apply"]


def apply() -> ApplyResult:
    """Patch SGLang in this process (idempotent; see :func:`.patch.apply`)."""
    from kvcached.integrations.sglang.patch import apply as _apply

    return _apply()
