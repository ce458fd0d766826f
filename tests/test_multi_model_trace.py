"""The multi-model benchmark's seeded trace (benchmarks/multi_model_trace.py):
the ramp shape, replay from the file, and the checks on bad input."""

from __future__ import annotations

import pytest

from multi_model_trace import (
    TraceSpec,
    make_trace,
    prompt_tokens,
    read_traces,
    write_traces,
)


def test_each_model_ramps_to_its_peak_and_down_staggered():
    spec = TraceSpec(peak=4.0, low=0.5, slope=1.0, hold_s=6.0, overlap=0.5)
    assert spec.up_s == 4.0 and spec.down_s == 3.5 and spec.stagger_s == 7.0
    assert spec.rate(0, 0.0) == 0.0 and spec.rate(0, 2.0) == 2.0
    assert spec.rate(0, 5.0) == 4.0 and spec.rate(0, 10.0 + 1.0) == 3.0
    assert spec.rate(0, spec.duration_s - 0.1) == 0.5
    # the next model climbs while the previous one is still at its peak
    assert spec.rate(1, 7.0 + 2.0) == 2.0 and spec.rate(0, 9.0) == 4.0
    assert spec.rate(2, 13.9) == 0.0


def test_the_trace_is_seeded_and_follows_the_rates():
    spec = TraceSpec(peak=6.0, low=0.5, slope=1.0, hold_s=20.0)
    a, b = make_trace(spec, 7), make_trace(spec, 7)
    assert a == b and a != make_trace(spec, 8)
    assert [r["t"] for r in a] == sorted(r["t"] for r in a)
    for model in range(3):
        start = model * spec.stagger_s + spec.up_s
        at_peak = [r for r in a if r["model"] == model and start <= r["t"] < start + 20.0]
        assert 60 <= len(at_peak) <= 180  # Poisson, 6 req/s for 20 s
        assert all(spec.prompt_min <= r["prompt_len"] <= spec.prompt_max for r in at_peak)
    assert prompt_tokens(5, 40) == prompt_tokens(5, 40) != prompt_tokens(6, 40)
    assert all(3 <= t < 512 for t in prompt_tokens(5, 400))


def test_a_trace_file_replays_exactly(tmp_path):
    specs = [TraceSpec(peak=1.0), TraceSpec(peak=2.0)]
    doc = write_traces(tmp_path / "t.json", specs, seed=3)
    again = read_traces(tmp_path / "t.json")
    assert again == doc
    assert [t["seed"] for t in again["traces"]] == [3, 4]
    assert again["traces"][1]["requests"] == make_trace(specs[1], 4)


def test_bad_specs_and_files_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="peak"):
        TraceSpec(peak=0)
    with pytest.raises(ValueError, match="low"):
        TraceSpec(peak=1.0, low=2.0)
    (tmp_path / "bad.json").write_text('{"seed": 1}')
    with pytest.raises(ValueError, match="bad.json"):
        read_traces(tmp_path / "bad.json")
