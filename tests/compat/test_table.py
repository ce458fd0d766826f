"""The README's supported-versions table is generated from the committed
``benchmarks/results/compat.json``, and each engine's version gate lets in
exactly the releases proven there (no engine needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcached.integrations.sglang.patch import SUPPORTED_VERSIONS as SGLANG_VERSIONS
from kvcached.integrations.vllm import SUPPORTED_VERSIONS as VLLM_VERSIONS
from tests.compat import table

MATRIX = Path(__file__).with_name("matrix.txt")
FIELDS = {
    "engine",
    "version",
    "passed",
    "failed",
    "date",
    "commit",
    "command",
    "machine",
    "load_avg",
}


def test_readme_table_is_the_generated_one() -> None:
    assert table.readme_block(table.README.read_text()) == table.block(table.rows()), (
        "regenerate it: python tests/compat/table.py --write"
    )


@pytest.mark.parametrize(("engine", "gate"), [("vllm", VLLM_VERSIONS), ("sglang", SGLANG_VERSIONS)])
def test_the_gate_admits_exactly_the_proven_releases(engine, gate) -> None:
    assert sorted(gate) == table.supported(table.rows(), engine)


def test_every_row_is_complete_and_in_the_matrix() -> None:
    known = {
        tuple(line.split())
        for line in MATRIX.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for row in table.rows():
        missing = FIELDS - set(row)
        assert not missing, f"{row.get('engine')} {row.get('version')}: {missing}"
        assert row.get("gpu") or (row["engine"], row["version"]) in known
        assert re.fullmatch(r"\d+\.\d+\.\d+", row["version"]), "as released, e.g. 0.30.0"
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", row["commit"])


def test_a_row_with_a_failure_is_not_supported() -> None:
    def row(version: str, passed: int, failed: int) -> dict:
        return {"engine": "vllm", "version": version, "passed": passed, "failed": failed}

    data = [row("0.30.0", 145, 1), row("0.31.0", 0, 0), row("0.32.0", 146, 0)]
    assert table.supported(data, "vllm") == ["0.32.0"]
    assert table.supported(data, "sglang") == []


def test_a_gpu_row_counts_each_case_by_its_newest_run(tmp_path) -> None:
    def summary(run: str, date: str, cases: dict, card: str = "h200") -> None:
        folder = tmp_path / card / "vllm-0.26.0" / run
        folder.mkdir(parents=True)
        device = f"NVIDIA {card.upper()}, 580, 1 MiB"
        info = {"date": date, "commit": "c" * 40, "command": "x", "device": device, "load_avg": 0.5}
        info["vllm_version"] = "0.26.0"
        (folder / "summary.json").write_text(json.dumps({**info, "cases": cases}))

    summary("run1", "2026-12-04T10:00:00Z", {"a/kv": {"x": True, "y": False}, "b/kv": {"x": True}})
    summary("run2", "2026-12-04T11:00:00Z", {"a/kv": {"x": True, "y": True}})
    (row,) = table.gpu_rows(tmp_path)
    assert (row["version"], row["passed"], row["failed"], row["runs"]) == ("0.26.0", 3, 0, 2)
    summary("run3", "2026-12-04T12:00:00Z", {"b/kv": {"x": False}}, card="h100")
    (row,) = table.gpu_rows(tmp_path)  # the cards' runs of one release count together
    assert (row["passed"], row["failed"]) == (2, 1) and not table.proven(row)
    assert row["devices"] == ["NVIDIA H100", "NVIDIA H200"]
    assert "| vLLM (H100, H200, real engine) | 0.26.0 | no |" in table.render([row])


def test_the_committed_gpu_row_of_vllm_026_is_proven() -> None:
    (row,) = [r for r in table.gpu_rows() if r["version"] == "0.26.0"]
    assert table.proven(row) and row["cases"] >= 12, row


def test_an_sglang_gpu_row_is_named_and_read_as_sglang(tmp_path) -> None:
    folder = tmp_path / "h100" / "sglang-0.5.17" / "run1"
    folder.mkdir(parents=True)
    info = {"date": "2026-12-06T08:00:00Z", "commit": "c" * 40, "command": "x",
            "device": "NVIDIA H100 80GB HBM3, 580, 81559 MiB", "load_avg": 0.5,
            "sglang_version": "0.5.17"}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps({**info, "cases": {"a": {"x": True}}}))
    (row,) = table.gpu_rows(tmp_path)
    assert (row["engine"], row["version"], row["passed"]) == ("sglang", "0.5.17", 1)
    assert "| SGLang (H100, real engine) | 0.5.17 | yes |" in table.render([row])
