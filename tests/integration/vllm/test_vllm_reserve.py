"""The planner's reserve is sized from a step's token budget (engine.step_reserve)."""

from kvcached.integrations.vllm.engine import step_reserve


def test_the_reserve_covers_one_step_of_tokens():
    # Llama-3.1-8B per-layer pages: 512 tokens; vLLM's 8,192 batched tokens = 16 pages.
    assert step_reserve(8192, 512, 4000, 5, 10) == (16, 32)


def test_configured_pages_are_a_floor():
    assert step_reserve(1024, 512, 4000, 5, 10) == (5, 10)
    assert step_reserve(0, 512, 4000, 0, 0) == (0, 0)
    assert step_reserve(8192, 512, 4000, 40, 80) == (40, 80)


def test_a_small_cache_is_not_all_reserve():
    # 40 pages: a quarter is 10, so the step's 16 pages are cut to 10.
    assert step_reserve(8192, 512, 40, 5, 10) == (10, 10)
    # The configured floor still wins over the quarter.
    assert step_reserve(8192, 512, 8, 5, 10) == (5, 10)


def test_a_partial_page_counts_whole():
    assert step_reserve(8193, 512, 4000, 0, 0) == (17, 34)
