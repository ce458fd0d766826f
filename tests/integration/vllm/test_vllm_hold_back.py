"""The allocate_slots wrapper notes what vLLM keeps back, on kvcached pools only
(engine.allocate_slots_wrapper: generated from the native signature)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvcached.integrations.vllm.engine import allocate_slots_wrapper

WAITING, RUNNING = "waiting", "running"


def native(
    self: Any,
    request: Any,
    num_new_tokens: int,
    reserved_blocks: int = 0,
    has_scheduled_reqs: bool = True,
) -> Any:
    return self.block_pool.alloc_extra  # what vLLM's capacity check would see


def _manager(kvcached: bool) -> SimpleNamespace:
    pool = SimpleNamespace(alloc_extra=None)
    if kvcached:
        pool.kvcached = object()
    return SimpleNamespace(block_pool=pool, watermark_blocks=7)


def test_the_watermark_counts_for_waiting_requests_when_others_are_scheduled() -> None:
    wrap = allocate_slots_wrapper(native, (WAITING,))
    m = _manager(kvcached=True)
    assert wrap(m, SimpleNamespace(status=WAITING), 16, reserved_blocks=2) == 9
    assert wrap(m, SimpleNamespace(status=WAITING), 16, 2, False) == 2
    assert wrap(m, SimpleNamespace(status=RUNNING), 1, reserved_blocks=2) == 2
    assert wrap(m, SimpleNamespace(status=RUNNING), 1) == 0
    assert m.block_pool.alloc_extra is None  # only for the call's duration


def test_a_native_pool_is_left_alone() -> None:
    wrap = allocate_slots_wrapper(native, (WAITING,))
    m = _manager(kvcached=False)
    assert wrap(m, SimpleNamespace(status=WAITING), 16, reserved_blocks=2) is None
    assert not hasattr(m.block_pool, "kvcached")


def test_the_note_is_cleared_when_vllm_raises() -> None:
    def failing(self: Any, request: Any, num_new_tokens: int, reserved_blocks: int = 0,
                has_scheduled_reqs: bool = True) -> Any:  # fmt: skip
        raise ValueError("no blocks")

    m = _manager(kvcached=True)
    wrap = allocate_slots_wrapper(failing, (WAITING,))
    with pytest.raises(ValueError, match="no blocks"):
        wrap(m, SimpleNamespace(status=WAITING), 16)
    assert m.block_pool.alloc_extra is None
