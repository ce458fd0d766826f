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
