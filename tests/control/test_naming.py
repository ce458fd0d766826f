"""Instance names: KVCACHED_IPC_NAME, or a distinct readable default shared with children."""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.config import get_config
from kvcached.control.naming import ENV, default_name, instance_name


def test_the_configured_name_wins(monkeypatch):
    monkeypatch.setenv(ENV, "my-server")
    from kvcached import config

    config.reload_config()
    assert instance_name("vllm", get_config().ipc_name) == "my-server"


def test_the_default_is_engine_and_pid_and_children_inherit_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    from kvcached import config

    config.reload_config()
    name = instance_name("vllm", get_config().ipc_name)
    assert name == f"vllm-{os.getpid()}"
    assert os.environ[ENV] == name and get_config().ipc_name == name  # said once, for all
    assert instance_name("sglang", get_config().ipc_name) == name  # a second pool of the server
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ['KVCACHED_IPC_NAME'])"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert child.stdout.strip() == name


def test_default_names_are_valid_instance_names():
    from kvcached.ledger import check_instance_name

    for engine in ("vllm", "SGLang 0.5", "../../etc", "", "a" * 80, "x_y.z"):
        check_instance_name(default_name(engine, pid=4_194_304))
    assert default_name("SGLang 0.5", pid=7) == "SGLang-0.5-7"
    assert default_name("", pid=7) == "kvcached-7"


def test_current_instance_before_there_is_one_says_what_creates_it():
    code = (
        "from kvcached.control.instance import current_instance\n"
        "try:\n"
        "    current_instance()\n"
        "except LookupError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "no kvcached instance yet" in out.stdout and "open_kv_cache()" in out.stdout
