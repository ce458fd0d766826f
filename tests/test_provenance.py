"""benchmarks/_provenance.py: the block every result file carries (commit, command,
machine, load average), and the commit a copied tree names through the environment."""

from __future__ import annotations  # noqa: I001

import json
import os
import subprocess
import sys
from pathlib import Path

import _provenance
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_written_result_records_commit_command_machine_and_load(tmp_path, monkeypatch):
    monkeypatch.delenv(_provenance.COMMIT_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "memory.py"), "--backend", "host"])
    block = _provenance.start()
    out = _provenance.write_result(tmp_path / "sub" / "r.json", {"ratio": 1.0}, block)
    data = json.loads(out.read_text())
    prov = data["provenance"]
    assert data["ratio"] == 1.0
    assert prov["command"] == "python benchmarks/memory.py --backend host"
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if head:  # a checkout: the commit is git's
        assert prov["commit"] == head and isinstance(prov["tree_dirty"], bool)
    assert prov["machine"]["cpus"] >= 1 and prov["machine"]["python"]
    assert len(prov["load_average_start"]) == len(prov["load_average_end"]) == 3
    assert prov["started_utc"] <= prov["finished_utc"]
    assert "load_average_end" not in block  # finish() copies


def test_a_copied_tree_names_its_commit_through_the_environment(monkeypatch):
    monkeypatch.setenv(_provenance.COMMIT_ENV, "abc1234")
    assert _provenance.start(["--x"])["commit"] == "abc1234"


def test_argv_given_to_main_is_the_recorded_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/vllm_serving.py"])
    assert _provenance.command(["--rounds", "3"]) == "python benchmarks/vllm_serving.py --rounds 3"


def test_a_result_must_be_a_dict(tmp_path):
    with pytest.raises(TypeError, match="result must be a dict"):
        _provenance.write_result(tmp_path / "x.json", [1], _provenance.start([]))


@pytest.mark.slow  # a real demo run, ~13 s
def test_the_demo_benchmark_writes_the_summary_with_its_provenance(tmp_path):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KVCACHED_IPC_NAME", None)
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/demo.py",
            "--duration",
            "5",
            "--instances",
            "2",
            "--budget",
            "64M",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["summary"]["instances"] == 2 and data["summary"]["kvcached"]["requests"] > 0
    assert data["provenance"]["command"].startswith("python benchmarks/demo.py --duration 5")


def test_stale_marks_a_file_and_needs_a_reason(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"x": 1, "provenance": {"commit": "abc"}}, indent=1) + "\n")
    _provenance.mark_stale(path, "measured before abc changed memory; re-measure with: python x")
    assert json.loads(path.read_text())["provenance"]["stale"].startswith("measured before")
    assert path.read_text().splitlines()[1].startswith(' "x"')  # its indent kept
    with pytest.raises(ValueError, match="reason must say"):
        _provenance.mark_stale(path, " ")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="no provenance block"):
        _provenance.mark_stale(bare, "changed")


def test_retrofit_leaves_a_file_with_provenance_alone():
    assert _provenance.retrofit(ROOT / "benchmarks" / "results" / "driver-host.json") is False


def test_retrofit_records_the_commit_that_added_the_file(tmp_path, monkeypatch):
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    git("init", "-q")
    result = tmp_path / "r.json"
    result.write_text(
        json.dumps(
            {
                "command": "python benchmarks/x.py",
                "ratio": 1.0,
                "machine": {"cpus": 2, "load_average_before": [1, 1, 1]},
            },
            indent=2,
        )
        + "\n"
    )
    git("add", "r.json")
    git("commit", "-q", "-m", "a result")
    monkeypatch.setattr(_provenance, "ROOT", tmp_path)
    assert _provenance.retrofit(result) is True
    prov = json.loads(result.read_text())["provenance"]
    assert prov["commit"] == git("rev-parse", "HEAD").strip()
    assert prov["command"] == "python benchmarks/x.py" and prov["load_average_start"] == [1, 1, 1]
    assert "retrofitted" in prov
    uncommitted = tmp_path / "new.json"
    uncommitted.write_text(json.dumps({"command": "x"}))
    with pytest.raises(ValueError, match="not committed"):
        _provenance.retrofit(uncommitted)


def test_every_committed_result_made_from_a_dirty_tree_says_so():
    """A result whose provenance has tree_dirty true carries a dirty_tree_note, so a reader
    knows its commit is the nearest source, not the exact one."""
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue  # not a result file (a log written as .json by a tool)
        prov = data.get("provenance") if isinstance(data, dict) else None
        if isinstance(prov, dict) and prov.get("tree_dirty") is True:
            assert "tree with uncommitted changes" in prov.get("dirty_tree_note", ""), path


def test_only_provenance_asks_git_for_the_commit():
    """A benchmark that read ``git rev-parse`` itself recorded the GPU machine's
    stale copy of .git (bc48425 in memory-h100.json, whose tree was 382c7a6):
    every top-level ``commit`` now comes from _provenance, which honours
    KVCACHED_BENCH_COMMIT."""
    bench = Path(_provenance.__file__).parent
    asking = [
        p.name
        for p in sorted(bench.rglob("*.py"))
        if p.name != "_provenance.py" and "rev-parse" in p.read_text(encoding="utf-8")
    ]
    assert asking == []


def test_commit_label_marks_a_copied_tree_by_its_name(monkeypatch):
    monkeypatch.setenv("KVCACHED_BENCH_COMMIT", "abc1234")
    assert _provenance.commit_label() == "abc1234"
