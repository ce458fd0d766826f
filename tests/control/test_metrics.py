"""``kvctl metrics`` output against the rules of the Prometheus text format (0.0.4)."""

from __future__ import annotations

import math
import re

import pytest

from kvcached.control.metrics import escape_label, format_value, prometheus
from kvcached.control.view import GpuRow, InstanceRow

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'  # only \\, \" and \n may be escaped
SAMPLE = re.compile(rf"^({NAME})(\{{(?:{LABEL}={VALUE}(?:,{LABEL}={VALUE})*)?\}})? (\S+)$")
PAIR = re.compile(rf"({LABEL})=({VALUE})")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_exposition(text: str) -> dict[str, dict]:
    """Check ``text`` against the format's rules; return its families
    ``{name: {"type", "help", "samples": {labels: value}}}``. Raises
    ``AssertionError`` naming the rule a line breaks."""
    assert text.endswith("\n"), "the exposition ends with a newline"
    families: dict[str, dict] = {}
    order: list[str] = []
    for n, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {n}: {line!r}"
        assert line, f"{where}: no empty lines"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert parts[0] == "#" and parts[1] in ("HELP", "TYPE") and len(parts) >= 3, where
            name = parts[2]
            assert re.fullmatch(NAME, name), f"{where}: bad metric name"
            fam = families.setdefault(name, {"type": None, "help": None, "samples": {}})
            if name not in order:
                order.append(name)
            assert not fam["samples"], f"{where}: HELP/TYPE after the family's samples"
            if parts[1] == "HELP":
                assert fam["help"] is None, f"{where}: a second HELP"
                fam["help"] = parts[3] if len(parts) > 3 else ""
                assert not re.search(r"\\[^\\n]", fam["help"]), f"{where}: bad escape in HELP"
            else:
                assert fam["type"] is None, f"{where}: a second TYPE"
                assert len(parts) == 4 and parts[3] in TYPES, f"{where}: bad type"
                fam["type"] = parts[3]
            continue
        m = SAMPLE.match(line)
        assert m, f"{where}: not a sample line"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        assert name in families and order[-1] == name, (
            f"{where}: samples of a family must follow its HELP/TYPE, all together"
        )
        pairs = PAIR.findall(labels)
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"{where}: a label name twice"
        assert value in ("NaN", "+Inf", "-Inf") or not math.isnan(float(value)), where
        key = tuple(pairs)
        assert key not in families[name]["samples"], f"{where}: the same series twice"
        families[name]["samples"][key] = float(value)
    for name, fam in families.items():
        if fam["type"] == "counter":
            assert name.endswith("_total"), f"counter {name} should end in _total"
    return families


def rows() -> tuple[list[InstanceRow], list[GpuRow]]:
    tricky = 'we"ird\\name\nx'
    insts = [
        InstanceRow(
            name="vllm-1",
            gpu="0000:17:00.0",
            used_bytes=3 << 30,
            reserved_bytes=1 << 28,
            limit_bytes=4 << 30,
            limit_revision=2,
            charged_bytes=3 << 30,
            pids=[11, 12],
            engine="vllm",
            engine_version="0.32.0",
            kvcached_version="0.2.0",
            backend="cuda",
            uptime_s=12.5,
            misses=7,
            yielded_bytes=5 << 20,
            blocks_used=90,
            blocks_total=1000,
        ),
        InstanceRow(
            name="sglang-2",
            gpu="0000:17:00.0",
            used_bytes=1 << 30,
            pids=[13],
            engine=tricky,
            state="dead",
        ),
    ]
    gpus = [
        GpuRow(
            gpu="0000:17:00.0",
            total_bytes=141 << 30,
            budget_bytes=130 << 30,
            margin_bytes=7 << 30,
            charged_bytes=4 << 30,
            pools=3,
            calibration_seq=42,
            calibrated_at=1_700_000_000.25,
        )
    ]
    return insts, gpus


def test_the_exposition_keeps_the_format_rules():
    insts, gpus = rows()
    fams = parse_exposition(prometheus(insts, gpus))
    used = fams["kvcached_instance_used_bytes"]
    assert used["type"] == "gauge"
    key = (("instance", '"vllm-1"'), ("gpu", '"0000:17:00.0"'))
    assert used["samples"][key] == 3 << 30
    assert fams["kvcached_instance_misses_total"]["type"] == "counter"
    assert fams["kvcached_instance_misses_total"]["samples"][key] == 7
    assert fams["kvcached_instance_yielded_bytes_total"]["samples"][key] == 5 << 20
    # The limit is absent where there is none (an alert on used/limit must not fire on 0).
    assert list(fams["kvcached_instance_limit_bytes"]["samples"]) == [key]
    up = fams["kvcached_instance_up"]["samples"]
    assert up[key] == 1 and up[(("instance", '"sglang-2"'), ("gpu", '"0000:17:00.0"'))] == 0
    gpu_key = (("gpu", '"0000:17:00.0"'),)
    assert fams["kvcached_gpu_headroom_bytes"]["samples"][gpu_key] == 126 << 30
    assert (
        fams["kvcached_gpu_last_calibration_timestamp_seconds"]["samples"][gpu_key]
        == 1_700_000_000.25
    )
    info = fams["kvcached_instance_info"]["samples"]
    assert any(("engine", '"we\\"ird\\\\name\\nx"') in k for k in info)


def test_an_idle_machine_is_a_valid_scrape():
    fams = parse_exposition(prometheus([], []))
    assert fams["kvcached_instance_used_bytes"]["samples"] == {}
    assert all(f["help"] and f["type"] for f in fams.values())


@pytest.mark.parametrize(
    "raw, escaped", [('a"b', 'a\\"b'), ("a\\b", "a\\\\b"), ("a\nb", "a\\nb"), ("ümlaut", "ümlaut")]
)
def test_label_escapes(raw, escaped):
    assert escape_label(raw) == escaped


def test_values():
    assert format_value(3) == "3" and format_value(True) == "1"
    assert format_value(0.5) == "0.5" and format_value(float("inf")) == "+Inf"
    assert format_value(float("-inf")) == "-Inf" and format_value(float("nan")) == "NaN"


def test_the_validator_catches_what_it_should():
    good = "# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
    parse_exposition(good)
    for bad in (
        good[:-1],
        good + "\n",
        "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\na 2\n",
        '# TYPE a gauge\na{x="1",x="2"} 1\n',
        '# TYPE a gauge\na{x="\\q"} 1\n',
        "# TYPE a counter\na 1\n",
        "# TYPE a gauge\na 1\na 2\n",
        "a b c\n",
    ):
        with pytest.raises((AssertionError, ValueError)):
            parse_exposition(bad)


def test_prometheus_client_parses_it_too():
    parser = pytest.importorskip(
        "prometheus_client.parser", reason='the test extra has it: pip install -e ".[test]"'
    )
    insts, gpus = rows()
    names = {f.name for f in parser.text_string_to_metric_families(prometheus(insts, gpus))}
    assert "kvcached_instance_used_bytes" in names
