"""Whether kvcached is on in this vLLM process: one :class:`Patches` under the
``SWITCH_OFF`` policy. A patch group whose vLLM module moved turns kvcached
off for the whole process, and every wrapper already installed then passes
straight through to vLLM's own function (they test ``STATE.active``), so a
process is never half patched. One ``[kvcached]`` line says so."""

from __future__ import annotations

from kvcached.integrations.patching import FailurePolicy, Patches

STATE = Patches("vLLM", FailurePolicy.SWITCH_OFF, "integrations.vllm")
