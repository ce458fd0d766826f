"""Whether kvcached is on in this vLLM process, and with which settings.

:data:`STATE` is one :class:`Patches` under the ``SWITCH_OFF`` policy. A patch
group whose vLLM module moved turns kvcached off for the whole process, and
every wrapper already installed then passes straight through to vLLM's own
function (they test ``STATE.active``), so a process is never half patched. One
``[kvcached]`` line says so.

``STATE.settings`` is the :class:`~kvcached.config.Config` this process' entry
point read (:func:`kvcached.integrations.vllm.apply`, before any group is
installed); the patches take every setting from it and never read the
environment. Until an entry point hands its own (a test or benchmark driving
one patch directly) it is the documented defaults."""

from __future__ import annotations

from kvcached.config import Config, defaults
from kvcached.integrations.patching import FailurePolicy, Patches


class _State(Patches):
    """:class:`Patches` and the settings the entry point handed in."""

    def __init__(self) -> None:
        super().__init__("vLLM", FailurePolicy.SWITCH_OFF, "integrations.vllm")
        self.settings: Config = defaults()


STATE = _State()
