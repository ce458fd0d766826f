"""The multi-model benchmark's GPU setup and its parts (benchmarks/multi_model.py
--device gpu, multi_model_gpu.py): the servers' arguments, the KV arithmetic
behind its trace, the defaults per device, and reading an earlier part back for
--resume. The GPU run itself needs the H200; --short runs the CPU path in
tests/integration/vllm/test_vllm_multi_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_plan
import multi_model as mm
import multi_model_gpu as mg
from multi_model_trace import TraceSpec, write_traces

GIB = 1 << 30
LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


def setup() -> mg.GpuSetup:
    return mg.GpuSetup(model_dir=Path("/m"))


def test_native_servers_get_a_fixed_share_and_kvcached_servers_none():
    native = mg.server_args(setup(), "native", 27 * GIB)
    i = native.index("--kv-cache-memory-bytes")
    assert int(native[i + 1]) == 27 * GIB
    # the start check must not refuse the second and third (free < 0.9 of the device)
    assert native[native.index("--gpu-memory-utilization") + 1] == "0.05"
    shared = mg.server_args(setup(), "kvcached", None)
    assert "--kv-cache-memory-bytes" not in shared and "--gpu-memory-utilization" not in shared
    for args in (native, shared):
        assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
        assert "--enable-per-request-metrics" in args
        assert args[args.index("--max-model-len") + 1] == "4096"
    with pytest.raises(ValueError, match="kv_share_bytes"):
        mg.server_args(setup(), "native", None)
    with pytest.raises(ValueError, match="config='static'"):
        mg.server_args(setup(), "static", 1)


def test_kvcached_servers_share_one_ledger_under_their_own_names(tmp_path):
    env = mg.server_env(setup(), "kvcached", "mm-b", tmp_path / "ledger")
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == "mm-b"
    assert env["KVCACHED_LEDGER_DIR"] == str(tmp_path / "ledger")
    assert env["KVCACHED_GPU_UTILIZATION"] == "0.95"
    assert mg.server_env(setup(), "native", "mm-b", tmp_path) == {"ENABLE_KVCACHED": "false"}


def test_an_8b_token_is_128_kib_of_kv():
    assert mm.kv_bytes_per_token(LLAMA_8B) == 128 * 1024
    assert mm.kv_bytes_per_token({**LLAMA_8B, "head_dim": 64}) == 64 * 1024


def test_kv_plan_is_littles_law_against_the_share():
    plan = mg.kv_plan(4.0, 2560, 512, 128 * 1024, 27 * GIB, 18.0)
    assert plan["in_flight"] == 72.0
    held = 72 * (2560 + 256) * 128 * 1024
    assert plan["kv_held_gib"] == round(held / GIB, 2)
    assert plan["over_share"] == round(held / (27 * GIB), 2)


def test_the_gpu_trace_binds_a_static_third_where_upstreams_never_does():
    """A third of an H200's KV budget (~27 GiB) holds upstream's requests at its
    highest peak; the GPU trace's requests (352 MiB each) fill a third of the
    H100's (8.15 GiB) at the knee that gpu_plan finds inside the default sweep."""
    per_token, share = 128 * 1024, 27 * GIB
    upstream = mg.kv_plan(20.0, 256, 256, per_token, share, 7.0)
    assert upstream["over_share"] < 0.5
    plan = gpu_plan.multi_model_plan(gpu_plan.H100.total_bytes, **gpu_plan.GPU_TRACE_SHAPE)
    assert plan["peaks"][0] < plan["knee_peak"] < plan["peaks"][-1]
    # gpu_plan's trace is this harness's
    for key, value in gpu_plan.GPU_TRACE_SHAPE.items():
        assert mg.GPU_TRACE[key] == value
    # and a request fits the GPU servers' context
    assert mg.GPU_TRACE["prompt_max"] + mg.GPU_TRACE["max_tokens"] <= setup().max_model_len


def test_defaults_per_device():
    cpu = mm.parse_args([])
    assert cpu.peaks == [1.0, 2.0, 3.0, 4.0] and not cpu.upstream_delay
    assert cpu.deadline_s is None and cpu.drain_s is None and cpu.prompt_max == 320
    gpu = mm.parse_args(["--device", "gpu"])
    assert gpu.peaks is None and gpu.upstream_delay  # sized to the card in main()
    assert (gpu.prompt_min, gpu.prompt_max, gpu.max_tokens) == (2048, 3072, 512)
    assert gpu.deadline_s == 540.0 and gpu.drain_s == 60.0 and gpu.utilization == 0.95
    mm.size_gpu_run(gpu, gpu_plan.H100)
    assert gpu.peaks == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    specs = mm.trace_specs(gpu)
    assert [s.stagger_s for s in specs[:2]] == [1.125, 2.25]  # PEAK/4 + 2*PEAK
    assert specs[0].low == 0.5 and specs[1].low == 1.0  # no low above the peak
    assert mm.parse_args(["--device", "gpu", "--peaks", "8"]).peaks == [8.0]
    with pytest.raises(SystemExit):
        mm.parse_args(["--device", "gpu", "--short"])
    with pytest.raises(SystemExit):
        mm.parse_args(["--resume", "/nonexistent/result.json"])


def _part(tmp_path: Path) -> Path:
    """An earlier part on disk: one kvcached run at peak 1 of a two-peak trace."""
    out = tmp_path / "r.json"
    trace = out.with_name("r-trace.json")
    write_traces(trace, [TraceSpec(peak=1.0, models=3), TraceSpec(peak=2.0, models=3)], 5)
    requests = [{"ok": True, "ttft_s": 0.1, "e2e_s": 1.0, "tokens": 4, "late_s": 0.0}]
    summary = {
        "config": "kvcached",
        "round": 0,
        "peak": 1.0,
        "trace_seed": 5,
        "wall_s": 12.0,
        "cpu_s": [1.0, 2.0, 3.0],
        "samples": [{"t": 0.0}],
        "drain_s": None,
    }
    out.write_text(
        json.dumps(
            {
                "trace": {"sha256": mm.file_sha256(trace)},
                "setup": {"kv_total_bytes": 3 * GIB},
                "blocks": [{"config": "kvcached", "tag": "kvcached-r0"}],
                "runs": [summary],
            }
        )
    )
    out.with_name("r-requests.json").write_text(
        json.dumps([{"config": "kvcached", "round": 0, "peak": 1.0, "requests": requests}])
    )
    return out


def test_resume_reads_an_earlier_parts_runs_back(tmp_path):
    prev = mm.read_previous(_part(tmp_path))
    assert prev.kv_total_bytes == 3 * GIB and prev.blocks[0]["tag"] == "kvcached-r0"
    [run] = prev.runs
    assert (run.config, run.round, run.peak, run.trace_seed) == ("kvcached", 0, 1.0, 5)
    assert run.requests[0]["ttft_s"] == 0.1 and run.cpu_s == [1.0, 2.0, 3.0]
    # read back, it sums up as it did when measured
    assert mm.run_summary(run)["ttft_s"]["mean"] == 0.1


def test_resume_refuses_a_part_whose_files_do_not_match(tmp_path):
    out = _part(tmp_path)
    trace = out.with_name("r-trace.json")
    trace.write_text(trace.read_text().replace('"seed":5', '"seed":6', 1))
    with pytest.raises(ValueError, match="not the trace it ran"):
        mm.read_previous(out)
    out = _part(tmp_path)
    out.with_name("r-requests.json").write_text("[]")
    with pytest.raises(ValueError, match="lacks the run"):
        mm.read_previous(out)
    out.with_name("r-requests.json").unlink()
    with pytest.raises(ValueError, match="r-requests.json is missing"):
        mm.read_previous(out)


def test_a_trace_is_given_its_arrivals_the_drain_and_the_idle_wait():
    trace = {"spec": {"peak": 2.0}, "duration_s": 30.0}
    assert mm.trace_need_s(trace, 60.0) == 105.0
    assert mm.trace_need_s(trace, None) == 105.0  # no drain limit: a minute is assumed
    assert mm.trace_need_s({"spec": {"peak": 2.0, "slope": 1.0}}, 0.0) > 0


def test_the_gpu_result_carries_the_long_tail_figures_beside_it(tmp_path):
    missing = mm.long_tail_figures(tmp_path / "long-tail-gpu.json")
    assert missing["models_per_gpu"] is None and "has not run" in missing["note"]
    (tmp_path / "long-tail-gpu.json").write_text(
        json.dumps(
            {
                "complete": True,
                "commit": "abc",
                "models_per_gpu": {"kvcached": 14, "static": 7},
                "slo": {"bound_s": 2.0},
                "goal": {"met": True},
                "wake_s": {},
            }
        )
    )
    got = mm.long_tail_figures(tmp_path / "long-tail-gpu.json")
    assert got["models_per_gpu"] == {"kvcached": 14, "static": 7}
    assert got["slo"] == {"bound_s": 2.0} and got["complete"] is True


def test_server_logs_travel_in_one_tarball_and_a_failed_start_quotes_them(tmp_path):
    import tarfile

    for name in ("kvcached-r0-mm-a.log", "native-r0-mm-a.log"):
        (tmp_path / name).write_text("\n".join(f"line {i}" for i in range(100)) + "\n")
    (tmp_path / "other.txt").write_text("not a log")
    dest = mg.pack_logs(tmp_path, tmp_path / "r-logs.tar.gz")
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == ["kvcached-r0-mm-a.log", "native-r0-mm-a.log"]
    tail = mg.log_tail(tmp_path / "native-r0-mm-a.log", 3)
    assert tail == "line 97\nline 98\nline 99"
    assert "FileNotFoundError" in mg.log_tail(tmp_path / "missing.log")


def test_the_gpu_run_is_sized_to_its_card_and_written_under_its_folder(tmp_path):
    args = mm.parse_args(["--device", "gpu"])
    with pytest.raises(SystemExit, match="no GPU found"):
        mm.size_gpu_run(args, None)  # neither a card nor --peaks
    given = mm.parse_args(["--device", "gpu", "--peaks", "4"])
    mm.size_gpu_run(given, None)
    assert given.peaks == [4.0]
    resumed = mm.parse_args(["--device", "gpu", "--resume", str(_part(tmp_path))])
    mm.size_gpu_run(resumed, gpu_plan.H100)
    assert resumed.peaks is None  # the resumed trace's peaks
    assert mm.card_results(gpu_plan.H100) == mm.ROOT / "benchmarks/results/h100"
    assert mm.card_results(gpu_plan.H200) == mm.ROOT / "benchmarks/results/h200"
    h200 = mm.parse_args(["--device", "gpu"])
    mm.size_gpu_run(h200, gpu_plan.H200)
    assert h200.peaks[0] > 1.0 and len(h200.peaks) >= 6


def test_the_result_carries_the_plan_with_the_ledgers_budget():
    args = mm.parse_args(["--device", "gpu"])
    plan = mm.gpu_run_plan(args, gpu_plan.H100, 26_255_346_893, [1.0, 2.5])
    assert plan["card"] == {"name": gpu_plan.H100.name, "memory_mib": 81559, "folder": "h100"}
    assert plan["kv_budget_source"] == "ledger" and plan["share_gib"] == 8.15
    assert [p["peak"] for p in plan["per_peak"]] == [1.0, 2.5]
    assert plan["per_peak"][1]["over_share_burst"] > 1 > plan["per_peak"][0]["over_share_burst"]
    assert mm.gpu_run_plan(args, None, None, [1.0])["card"] is None


def test_kvcached_env_reaches_the_kvcached_servers_only():
    args = mm.parse_args(["--device", "gpu", "--kvcached-env", "KVCACHED_YIELD_IDLE=true"])
    assert args.kvcached_env == {"KVCACHED_YIELD_IDLE": "true"}
    gsetup = mg.GpuSetup(model_dir=Path("/m"), kvcached_env=(("KVCACHED_YIELD_IDLE", "true"),))
    assert mg.server_env(gsetup, "kvcached", "mm-a", Path("/l"))["KVCACHED_YIELD_IDLE"] == "true"
    assert "KVCACHED_YIELD_IDLE" not in mg.server_env(gsetup, "native", "mm-a", Path("/l"))
    cpu = mm.Setup(kvcached_env=(("KVCACHED_YIELD_IDLE", "true"),))
    opts = mm.server_options("kvcached", cpu, "mm-a", Path("/l"))
    assert opts.extra_env["KVCACHED_YIELD_IDLE"] == "true"
    assert (
        "KVCACHED_YIELD_IDLE" not in mm.server_options("native", cpu, "mm-a", Path("/l")).extra_env
    )


@pytest.mark.parametrize(
    "item,match",
    [
        ("KVCACHED_YIELD_IDLE", "NAME=VALUE"),
        ("KVCACHED_NO_SUCH=1", "NAME=VALUE"),
        ("KVCACHED_YIELD_IDLE=maybe", "KVCACHED_YIELD_IDLE=maybe"),
        ("KVCACHED_LEDGER_DIR=/tmp", "set by the harness"),
    ],
)
def test_kvcached_env_refuses_what_kvcached_would_not_read(item, match, capsys):
    with pytest.raises(SystemExit):
        mm.parse_args(["--kvcached-env", item])
    assert match in capsys.readouterr().err


def test_resume_refuses_a_part_run_with_other_kvcached_settings(tmp_path):
    part = _part(tmp_path)
    with pytest.raises(SystemExit, match="ran with --kvcached-env none, this call with"):
        mm.main(["--resume", str(part), "--kvcached-env", "KVCACHED_YIELD_IDLE=true"])
