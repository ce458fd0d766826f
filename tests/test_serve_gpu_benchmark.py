"""The GPU serve benchmark's pure pieces (benchmarks/serve_gpu.py): its serve
config, the nvidia-smi and vLLM log readings, and the figures' arithmetic. The
run itself needs a GPU; ``--cpu`` checks the harness on vLLM's CPU build."""

from __future__ import annotations

import pytest

import serve_gpu as sg
from kvcached.serve.config import parse_config

GIB, MIB = 1 << 30, 1 << 20
LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def test_the_gpu_config_serves_every_level_and_presses():
    doc = sg.serve_config("/m", 9000, "/tmp/s")
    cfg = parse_config(doc)  # serve's own validation (level 2 needs files it can reload)
    assert cfg.pressure == "sleep-lru" and cfg.on_model_failure == "keep-serving"
    by = {m.name: m for m in cfg.models}
    assert list(by) == list(sg.GPU_MODELS)
    assert {n: m.sleep.level for n, m in by.items()} == {
        "kv": "kv",
        "w1": "weights",
        "w2": "weights",
        "stop": "stop",
        "grow": "kv",
    }
    assert (by["w1"].sleep.weights_level, by["w2"].sleep.weights_level) == (1, 2)
    for name, m in by.items():
        argv = m.argv("127.0.0.1", 1)
        env = m.environment({})
        native = name in ("w1", "w2")
        # sleep mode and a fixed KV size only where vLLM's own cache serves
        assert ("--enable-sleep-mode" in argv) is native
        assert ("--kv-cache-memory-bytes" in argv) is native
        assert (env.get("ENABLE_KVCACHED") == "true") is not native
        assert (env.get("VLLM_SERVER_DEV_MODE") == "1") is native
        assert "--enforce-eager" in argv and "dummy" not in argv
        assert m.sleep.idle_after >= 3600 and m.restart.policy == "never"
    assert by["stop"].sleep.stop_after == sg.STOP_AFTER_S
    i = by["w1"].argv("h", 1).index("--kv-cache-memory-bytes")
    assert int(by["w1"].argv("h", 1)[i + 1]) == 8 * GIB


def test_the_cpu_config_is_kv_and_stop_on_the_tiny_llama():
    cfg = parse_config(sg.serve_config("/tiny", 9000, "/tmp/s", cpu=True))
    assert [m.name for m in cfg.models] == list(sg.CPU_MODELS)
    for m in cfg.models:
        argv = m.argv("h", 1)
        assert "--skip-tokenizer-init" in argv and argv[argv.index("--block-size") + 1] == "32"
        assert m.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_nvidia_smi_readings():
    apps = "1234, 20480\n5678, 512\n1234, 16\nNo running processes found\n"
    assert sg.parse_apps(apps) == {1234: 20496, 5678: 512}
    gpu = "101000, 42771, 143771\n"
    assert sg.parse_gpu(gpu) == {"used_mib": 101000, "free_mib": 42771, "total_mib": 143771}
    assert sg.parse_gpu("[N/A], [N/A], [N/A]") is None


def test_a_models_memory_is_its_process_group_or_else_the_process_that_dropped():
    before = {10: 500, 11: 24000, 20: 17000}
    after = {10: 500, 11: 900, 20: 17000}
    mine = sg.model_memory(before, after, [10, 11, 12])
    assert mine["method"] == "engine process group"
    assert (mine["before_mib"], mine["after_mib"], mine["released_mib"]) == (24500, 1400, 23100)
    assert mine["fraction"] == pytest.approx(23100 / 24500)
    # nvidia-smi's pids are another namespace's: the one whose memory went is the sleeper
    other = sg.model_memory(before, after, [99, 100])
    assert other["method"].startswith("largest drop (nvidia-smi pid 11)")
    assert other["fraction"] == pytest.approx(23100 / 24000)
    gone = sg.model_memory({7: 18000, 8: 100}, {8: 100}, [7])  # a stopped engine
    assert gone["fraction"] == 1.0
    assert sg.model_memory(None, None, [1])["fraction"] is None
    assert sg.model_memory({1: 5}, {1: 5}, [2])["fraction"] is None


def test_weights_bytes_are_the_safetensors_tensors(tmp_path):
    import torch

    save_file = pytest.importorskip(
        "safetensors.torch", reason="writes real safetensors: pip install safetensors"
    ).save_file

    save_file({"a": torch.zeros(3, 4, dtype=torch.bfloat16)}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": torch.zeros(10, dtype=torch.float32)}, str(tmp_path / "m-2.safetensors"))
    assert sg.safetensors_bytes(tmp_path) == 3 * 4 * 2 + 10 * 4


def test_kv_bytes_per_token_and_the_pressure_arithmetic():
    per_token = sg.kv_bytes_per_token(LLAMA_8B)
    assert per_token == 128 * 1024  # K and V, 32 layers, 8 heads of 128, bf16
    assert sg.ballast_bytes(30 * GIB, 256 * MIB) == 30 * GIB - 256 * MIB
    assert sg.ballast_bytes(100 * MIB, 256 * MIB) == 0
    headroom, own, victim, tokens = 256 * MIB, 640 * MIB, 2600 * MIB, 1500 + 64
    n = sg.grow_requests(headroom, own, victim, per_token, tokens)
    need = n * tokens * per_token
    # more than grow can get without a sleep, less than after the LRU model's
    assert headroom + own < need <= headroom + own + victim
    assert sg.grow_requests(0, 0, 0, per_token, tokens) == 4  # bounded
    assert sg.grow_requests(100 * GIB, 0, 0, per_token, tokens) == 48


VLLM_LOG = """\
(EngineCore pid=77) INFO 12-05 10:00:01 [cumem.py:271] CuMemAllocator: sleep freed 23.10 GiB memory in total, of which 14.96 GiB is backed up in CPU and the rest 8.14 GiB is discarded directly.
(EngineCore pid=77) INFO 12-05 10:00:01 [abstract.py:327] It took 3.512345 seconds to fall asleep.
(EngineCore pid=77) INFO 12-05 10:00:05 [abstract.py:345] It took 0.412000 seconds to wake up tags {'weights', 'kv_cache'}.
(EngineCore pid=77) INFO 12-05 10:00:09 [abstract.py:345] It took 0.100000 seconds to wake up tags ['weights'].
(EngineCore pid=77) INFO 12-05 10:00:15 [gpu_model_runner.py:5546] Reloading and processing weights took 6.25 seconds
"""


def test_vllm_log_readings():
    assert sg.backed_up_bytes(VLLM_LOG) == round(14.96 * GIB)
    assert sg.backed_up_bytes("nothing") is None
    assert sg.engine_wake_times(VLLM_LOG) == [0.412, 0.1]
    assert sg.engine_sleep_times(VLLM_LOG) == [3.512345]
    assert sg.engine_reload_s(VLLM_LOG) == 6.25 and sg.engine_reload_s("") is None


def test_a_level_1_wake_against_the_h2d_bandwidth():
    moved = 16 * 10**9
    got = sg.wake_vs_h2d(moved, 0.5, 50.0)
    assert got["effective_gbps"] == pytest.approx(32.0)
    assert got["ratio"] == pytest.approx(0.64)
    assert got["copy_at_h2d_s"] == pytest.approx(0.32)
    assert got["beyond_copy_s"] == pytest.approx(0.18)
    assert sg.wake_vs_h2d(None, 0.5, 50.0)["ratio"] is None


def test_the_headline_figures_and_their_targets():
    def weights_round(ttft: float, fraction: float, ratio: float | None = None) -> dict:
        return {
            "wake": {"first_ttft_s": ttft},
            "memory": {"fraction": fraction},
            "vs_h2d": {"ratio": ratio},
        }

    result = {
        "levels": {
            "kv": {"rounds": [{"wake_ms": x} for x in (30.0, 12.0, 60.0, None)]},
            "weights_l1": {"rounds": [weights_round(0.6, 0.97), weights_round(0.5, 0.96, 0.7)]},
            "weights_l2": {"rounds": [weights_round(9.0, 0.94)]},
            "stop": {"wake": {"first_ttft_s": 80.0}},
        },
        "failures": [],
        "pressure": {"checks": {"lru_slept": True}},
    }
    h = sg.headline(result)
    assert h["kv_wake_ms_p50"] == 30.0
    assert h["l1_wake_to_first_token_s"] == pytest.approx(0.55)
    assert h["weights_sleep_released_fraction"] == 0.94  # the worst weights sleep, either level
    assert h["l1_wake_vs_h2d"] == 0.7 and h["l2_wake_to_first_token_s"] == 9.0
    assert h["stop_cold_start_s"] == 80.0 and h["pressure_slept_lru"] is True
    met = {k: v["met"] for k, v in h["targets"].items()}
    assert met == {
        "l1_wake_to_first_token_s": True,
        "kv_wake_ms_p50": True,
        "weights_sleep_released_fraction": False,
        "failed_requests": True,
    }
    empty = sg.headline({})
    assert empty["failed_requests"] == 0 and empty["targets"]["kv_wake_ms_p50"]["met"] is None


def test_without_a_process_listing_a_weights_sleep_is_the_devices_drop_over_what_it_held():
    got = sg.device_drop_memory({"used_mib": 100_000}, {"used_mib": 77_000}, 24_000)
    assert got["fraction"] == pytest.approx(23_000 / 24_000)
    assert "upper bound" in got["method"] and got["released_mib"] == 23_000
    assert sg.device_drop_memory(None, {"used_mib": 1}, 24_000)["fraction"] is None


def test_on_an_h100_the_models_that_do_not_fit_start_lazily():
    import gpu_plan

    weights = gpu_plan.WEIGHTS_8B_BYTES
    names = sg.GPU_MODELS
    plan = sg.card_plan(gpu_plan.H100, weights, sg.PHASES, names)
    # kv (19 GiB) and w1, w2 (25 GiB each) fit 0.95 of 79.65 GiB; stop and grow wait
    assert plan["eager"] == ["kv", "w1", "w2"] and plan["lazy"] == ["stop", "grow"]
    assert plan["sleep_after_phase"] == {"weights_l1": ["w1"], "weights_l2": ["w2"]}
    assert plan["fits"] and plan["level_1_fits_host"]
    assert plan["card"] == {"name": gpu_plan.H100.name, "memory_mib": 81559}
    # the H200 starts all five together, as before
    assert sg.card_plan(gpu_plan.H200, weights, sg.PHASES, names)["lazy"] == []
    # the CPU run (no card) starts its two eagerly
    assert sg.card_plan(None, 0, sg.PHASES, sg.CPU_MODELS)["eager"] == list(sg.CPU_MODELS)
    # and serve takes the config: lazy models start on their first request or wake
    doc = sg.serve_config("/m", 9000, "/tmp/s", lazy=tuple(plan["lazy"]))
    by = {m.name: m for m in parse_config(doc).models}
    assert {n for n, m in by.items() if m.start == "lazy"} == {"stop", "grow"}
    assert sg.serve_config("/m", 9000, "/tmp/s")["models"][3].get("start") is None


def test_a_resumed_run_keeps_its_done_phases_and_starts_only_what_is_left():
    old = {
        "benchmark": "serve-gpu",
        "phases": {"kv": "done in 14.2 s", "weights_l1": "done in 30.1 s",
                   "weights_l2": "error after 3.0 s: x", "pressure": "skipped: 40 s left"},
        "levels": {"kv": {"rounds": [1]}, "weights_l1": {"rounds": [2]},
                   "weights_l2": {"rounds": []}},
        "failures": [{"phase": "kv", "model": "kv", "error": "e"},
                     {"phase": "weights_l2", "model": "w2", "error": "e"}],
        "h2d": {"h2d_gbps": 54.9},
        "provenance": {"commit": "abc"},
    }  # fmt: skip
    kept = sg.resumed_phases(old)
    assert kept["done"] == ["kv", "weights_l1"]
    assert set(kept["levels"]) == {"kv", "weights_l1"} and kept["pressure"] is None
    assert kept["failures"] == [{"phase": "kv", "model": "kv", "error": "e"}]
    assert kept["calls"] == [{"commit": "abc"}] and kept["h2d"] == {"h2d_gbps": 54.9}
    # what is left starts without w1 (no phase to run needs it)
    import gpu_plan

    todo = [(p, n) for p, n in sg.PHASES if p not in kept["done"]]
    plan = sg.card_plan(gpu_plan.H100, gpu_plan.WEIGHTS_8B_BYTES, todo, sg.GPU_MODELS)
    assert "w1" in plan["lazy"] and plan["not_needed"] == ["w1"]
    assert plan["eager"][0] == "w2" and plan["fits"]
    assert sg.resumed_phases(None)["done"] == []
    with pytest.raises(SystemExit, match="not a serve_gpu result"):
        sg.resumed_phases({"benchmark": "long-tail"})


def test_the_result_goes_under_the_cards_folder():
    import gpu_plan

    results = sg.ROOT / "benchmarks" / "results"
    assert sg.default_out(False, gpu_plan.H100) == results / "h100" / "serve-gpu.json"
    assert sg.default_out(False, gpu_plan.H200) == results / "h200" / "serve-gpu.json"
    assert sg.default_out(True, None) == results / "serve-gpu-cpu.json"
    assert [p for p, _ in sg.PHASES] == ["kv", "weights_l1", "weights_l2", "pressure", "stop"]


def test_the_lazy_models_can_be_named_by_hand():
    assert sg.parse_lazy(None, sg.GPU_MODELS) is None  # the plan decides
    assert sg.parse_lazy("none", sg.GPU_MODELS) == ()
    assert sg.parse_lazy("stop, grow", sg.GPU_MODELS) == ("stop", "grow")
    with pytest.raises(SystemExit, match="not models of this run"):
        sg.parse_lazy("w1", sg.CPU_MODELS)
