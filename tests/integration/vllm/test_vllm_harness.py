"""The server harness's own rules, checked without starting vLLM (fast, always run)."""

from __future__ import annotations

import pytest

from kvharness.vllm_server import ServerOptions, cpu_binding
from tests.integration.vllm.vllm_log import find_error_signatures, kvcached_lines

# Lines as vLLM 0.32 writes them (taken from a real server log, shortened).
BENIGN_WARMUP = """\
(APIServer pid=5780) WARNING 12-02 16:10:03 [base.py:380] Chat template warmup failed
(APIServer pid=5780) WARNING 12-02 16:10:03 [base.py:380] Traceback (most recent call last):
(APIServer pid=5780) WARNING 12-02 16:10:03 [base.py:380]   File "vllm/renderers/base.py", line 373, in warmup
(APIServer pid=5780) WARNING 12-02 16:10:03 [base.py:380] ValueError: Tokenizer not available when `skip_tokenizer_init=True`
(APIServer pid=5780) INFO 12-02 16:10:03 [entry.py:140] Starting vLLM server on http://127.0.0.1:18123
"""
ENGINE_FAILURE = """\
(EngineCore pid=13959) ERROR 12-02 16:22:13 [core.py:1510] EngineCore failed to start.
(EngineCore pid=13959) ERROR 12-02 16:22:13 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=13959) ERROR 12-02 16:22:13 [core.py:1510]   File "vllm/v1/engine/core.py", line 1482, in run_engine_core
"""


def test_benign_warmup_traceback_is_not_an_error() -> None:
    assert find_error_signatures(BENIGN_WARMUP) == []


def test_engine_traceback_is_an_error() -> None:
    found = find_error_signatures(BENIGN_WARMUP + ENGINE_FAILURE)
    assert len(found) == 1 and found[0].startswith("traceback: (EngineCore")


def test_traceback_outside_a_log_record_is_an_error() -> None:
    raw = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom\n'
    assert [f.split(":")[0] for f in find_error_signatures(raw)] == ["traceback"]


def test_benign_record_does_not_cover_the_next_record() -> None:
    """A traceback in a later record from the same place is not excused by an
    earlier benign one when another record came in between."""
    later = (
        "(APIServer pid=5780) WARNING 12-02 16:10:04 [base.py:380] something else\n"
        "(APIServer pid=5780) WARNING 12-02 16:10:04 [base.py:380] "
        "Traceback (most recent call last):\n"
    )
    other = "(APIServer pid=5780) INFO 12-02 16:10:03 [entry.py:140] between\n"
    assert len(find_error_signatures(BENIGN_WARMUP + other + later)) == 1


def test_kvcached_errors_and_out_of_memory_are_errors() -> None:
    log = (
        "[kvcached] ERROR 16:10:03 page map failed\n"
        "(Worker pid=1) ERROR 12-02 16:10:03 [x.py:1] torch.OutOfMemoryError: CUDA out of memory\n"
    )
    names = {f.split(":")[0] for f in find_error_signatures(log)}
    assert names == {"kvcached error", "out of memory"}
    assert kvcached_lines(log) == ["[kvcached] ERROR 16:10:03 page map failed"]


def test_native_server_env_drops_kvcached_settings_of_the_shell() -> None:
    shell = {
        "PATH": "/bin",
        "KVCACHED_IPC_NAME": "x",
        "ENABLE_KVCACHED": "true",
        "KVCACHED_DRIVER": "host",
    }
    env = ServerOptions().env(shell)
    assert env["ENABLE_KVCACHED"] == "false"
    assert not any(k.startswith("KVCACHED_") for k in env)
    assert env["PATH"] == "/bin" and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_kvcached_server_env() -> None:
    env = ServerOptions(kvcached=True, ipc_name="a-1").env({})
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == "a-1"


def test_server_args_carry_the_seed_flags() -> None:
    args = ServerOptions(block_size=64, tensor_parallel=2).args("/m", 1234)  # type: ignore[arg-type]
    for flag in (
        "--skip-tokenizer-init",
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching",
    ):
        assert flag in args
    assert args[args.index("--block-size") + 1] == "64"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--port") + 1] == "1234"


@pytest.mark.parametrize("bad", [0, 16, 48])
def test_block_size_must_be_a_multiple_of_32(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        ServerOptions(block_size=bad)


def test_cpu_binding_gives_each_rank_its_own_cpus() -> None:
    binding = cpu_binding(2)
    if binding == "nobind":
        pytest.skip("fewer than two CPUs here")
    ranks = [set(part.split(",")) for part in binding.split("|")]
    assert len(ranks) == 2 and not ranks[0] & ranks[1]


@pytest.mark.parametrize("amx", [True, False])
def test_only_native_servers_on_amx_cpus_get_the_amx_request(monkeypatch, amx: bool) -> None:
    """kvcached servers ask for AMX through kvcached's plugin; a native one gets
    tests/amx_permission/ first on its PYTHONPATH, and only where the CPU has AMX."""
    from kvharness import vllm_server

    monkeypatch.setattr(vllm_server, "cpu_has_amx", lambda: amx)
    base = {"PYTHONPATH": "/elsewhere"}
    native = ServerOptions(kvcached=False).env(base)["PYTHONPATH"].split(":")
    assert native == ([vllm_server.AMX_SHIM] if amx else []) + ["/elsewhere"]
    assert ServerOptions(kvcached=True).env(base)["PYTHONPATH"] == "/elsewhere"
    twice = ServerOptions(kvcached=False).env({"PYTHONPATH": vllm_server.AMX_SHIM})
    assert twice["PYTHONPATH"] == vllm_server.AMX_SHIM
