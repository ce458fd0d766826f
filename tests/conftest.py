"""Shared test setup: every test starts from a clean kvcached configuration."""

from __future__ import annotations

import pytest

from kvcached import config


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    """Tests that set KVCACHED_* variables see them; nothing leaks to the next test."""
    config.reload_config()
    yield
    monkeypatch.undo()
    config.reload_config()


def pytest_configure(config) -> None:
    from tests.gpu.cuda_marks import MISSING_MARK

    config.addinivalue_line(
        "markers", f"{MISSING_MARK}(reason): a GPU test under KVCACHED_REQUIRE_GPU=1 with no GPU")


def pytest_runtest_setup(item) -> None:
    """Under ``KVCACHED_REQUIRE_GPU=1`` a GPU test without its GPU fails (tests/gpu/cuda_marks.py)."""
    from tests.gpu.cuda_marks import MISSING_MARK

    for mark in item.iter_markers(MISSING_MARK):
        pytest.fail(mark.args[0], pytrace=False)
