"""Whether kvcached is on in this SGLang process: one :class:`Patches` under the
``GROUP_NATIVE`` policy, and the SGLang release it runs.

A patch group that fails leaves only its part of SGLang native (one
``[kvcached]`` error line); the pool groups ask :func:`group_states` whether
every group an elastic pool needs installed. :mod:`.patch` decides and starts
the groups, :mod:`.groups` and :mod:`.pools` only read this state, so none of
them imports another to reach it.
"""

from __future__ import annotations

import sys
from importlib import metadata

from kvcached.integrations.patching import FailurePolicy, Patches

PATCHES = Patches("SGLang", FailurePolicy.GROUP_NATIVE, "integrations.sglang")


def group_states() -> dict[str, str]:
    """``{group: "pending" | "installed" | "failed: ..."}`` for this process."""
    return PATCHES.states()


def sglang_version() -> str | None:
    """SGLang's version from the imported module, else from its metadata;
    ``None`` when SGLang is not installed. Never imports SGLang."""
    module = sys.modules.get("sglang")
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version:
        return version
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
