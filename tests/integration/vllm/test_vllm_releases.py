"""The release table (``kvcached/integrations/vllm/releases.py``): every row
gets every patch group exactly once, an unlisted release stays native, and the
installed vLLM's modules are what its row says (no vLLM needed but for that)."""

from __future__ import annotations

import importlib

import pytest

from kvcached.integrations import vllm as plugin
from kvcached.integrations.vllm import releases

NAMES = [name for name, *_ in plugin.GROUPS]


@pytest.mark.parametrize("version", list(releases.RELEASES))
def test_each_release_gets_each_group_exactly_once(version: str) -> None:
    groups = plugin.groups(version)
    assert [g.name for g in groups] == NAMES
    assert all(g.applies_to(version) and not g.applies_to("0.29.0") for g in groups)


def test_the_gate_is_the_table_and_an_unlisted_release_has_no_row() -> None:
    assert tuple(releases.RELEASES) == plugin.SUPPORTED_VERSIONS
    assert releases.row("0.32.0+cpu") is releases.RELEASES["0.32.0"]
    with pytest.raises(KeyError, match="0.29.0 has no row"):
        releases.row("0.29.0")


def test_a_row_names_a_known_allocation() -> None:
    with pytest.raises(ValueError, match="kv_alloc='paged'"):
        releases.Release("paged", (), (), (), ())


def test_the_installed_release_matches_its_row() -> None:
    """Every group's check passes on the installed vLLM's own modules (the CPU
    build imports the GPU modules too; its row says whether the CPU worker is
    served)."""
    from tests.engines import require_engine_version

    version = require_engine_version("vllm")
    if version.split("+")[0] not in releases.RELEASES:
        pytest.skip(f"vLLM {version} has no row")
    row = releases.row(version)
    for group in plugin.groups(version):
        reason = group.check(importlib.import_module(group.module))
        if group.name == "cpu_worker" and not row.cpu_build:
            assert reason is not None
        else:
            assert reason is None, (group.name, reason)
