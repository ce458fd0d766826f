"""Requests driven through a ``KVCacheManager`` without a server: the engine-side
tests of every vLLM release (``test_vllm_patch.py`` on the installed one,
``test_vllm_026.py`` on 0.26's own classes) admit prompts the same way."""

from __future__ import annotations

from typing import Any


def request(rid: str, tokens: list[int], block_size: int) -> Any:
    """A vLLM ``Request`` of ``tokens`` whose blocks of ``block_size`` are hashed."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = _HASHERS.get(block_size)
    if hasher is None:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        hasher = _HASHERS[block_size] = get_request_block_hasher(block_size, fn)
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher)


_HASHERS: dict[int, Any] = {}


def run_requests(
    manager: Any, prompts: list[list[int]], concurrent: int, block_size: int
) -> list[int | None]:
    """Admit prompts ``concurrent`` at a time (prefill, one decode token,
    free); returns each one's cache hit in tokens, or None if it missed."""
    hits: list[int | None] = []
    for start in range(0, len(prompts), concurrent):
        live = []
        for i, tokens in enumerate(prompts[start : start + concurrent]):
            req = request(f"r{start + i}", tokens, block_size)
            computed, n_computed = manager.get_computed_blocks(req)[:2]
            blocks = manager.allocate_slots(req, len(tokens) - n_computed, n_computed, computed)
            hits.append(None if blocks is None else n_computed)
            if blocks is not None:
                live.append(req)
        for req in live:
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(7)
            manager.allocate_slots(req, 1)
        for req in live:
            manager.free(req)
    return hits
