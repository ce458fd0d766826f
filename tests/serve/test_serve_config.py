"""The serve configuration: every error names the file, the line and the key."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvcached.serve.config import ServeConfigError, describe, load_config, parse_config
from tests.engines import require_installed

GOOD = """\
host: 127.0.0.1
port: 8123
api_key: sekrit
pressure: sleep-lru
models:
  - name: llama-a
    model: /models/a
    aliases: [a, chat]
    args: [--max-model-len, "4096"]
    sleep: {level: weights, idle_after: 60, weights_level: 2}
  - name: llama-b
    model: /models/b
    port: 8002
    start: lazy
    env: {VLLM_CPU_KVCACHE_SPACE: 2, FLAG: true}
    sleep:
      level: stop
      idle_after: 30
      stop_after: 120
    restart: {policy: always, max_restarts: 2, backoff_s: 0.5}
  - name: other
    engine: command
    command: "./serve.sh --port {port} --host {host}"
"""


def write(tmp_path, text: str):
    path = tmp_path / "serve.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_file_loads_with_every_key(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    a, b, other = cfg.models
    assert (cfg.host, cfg.port, cfg.api_key, cfg.pressure) == (
        "127.0.0.1",
        8123,
        "sekrit",
        "sleep-lru",
    )
    assert a.aliases == ("a", "chat") and a.sleep.level == "weights" and a.sleep.weights_level == 2
    argv = a.argv("127.0.0.1", 9000)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-sleep-mode" in argv and argv[-2:] == ["--max-model-len", "4096"]
    env = a.environment({"PATH": "/bin"})
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == "llama-a"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["PATH"] == "/bin"
    assert b.port == 8002 and b.start == "lazy" and b.sleep.stop_after == 120
    assert b.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "FLAG": "true"}
    assert b.restart.policy == "always" and b.restart.max_restarts == 2
    assert other.argv("127.0.0.1", 9001) == ["./serve.sh", "--port", "9001", "--host", "127.0.0.1"]
    assert cfg.model("chat") is a and cfg.model("nope") is None
    plan = describe(cfg)
    assert "llama-a" in plan and "vLLM sleep level 2" in plan and "port auto" in plan
    assert "--port '<free port>'" in plan and "--port 8002" in plan


@pytest.mark.parametrize(
    "text, line, message",
    [
        (
            "models:\n  - name: a\n    model: m\n    sleep:\n      levl: kv\n",
            5,
            "models[0].sleep.levl: unknown key 'levl'",
        ),
        (
            "models:\n  - name: a\n    model: m\n    sleep: {level: deep}\n",
            4,
            "models[0].sleep.level: must be one of none, kv, weights, stop; got 'deep'",
        ),
        (
            "models:\n  - name: a\n    model: m\n    wake_timeout: soon\n",
            4,
            "models[0].wake_timeout: must be a number, got 'soon'",
        ),
        ("port: 70000\nmodels:\n  - name: a\n    model: m\n", 1, "port: must be a TCP port"),
        ("models: []\n", 1, "models: needs a list of at least one model"),
        ("models:\n  - name: a\n", 2, "models[0]: engine vllm needs model"),
        (
            "models:\n  - name: a\n    model: m\n  - name: b\n    model: m\n    aliases: [a]\n",
            4,
            "'a' is already the name or an alias of a",
        ),
        ("models:\n  - name: a b\n    model: m\n", 2, "models[0].name: 'a b' is not a usable name"),
        (
            "models:\n  - name: a\n    engine: command\n    command: [x]\n    sleep: {level: weights}\n",
            5,
            "sleep level weights needs an engine with a sleep API",
        ),
        ("listen: 1\nmodels:\n  - name: a\n    model: m\n", 1, "unknown key 'listen'"),
        ("models:\n  - name: a\n    model: m\n   bad: [\n", 4, "not valid YAML"),
    ],
)
def test_errors_name_the_line_and_the_key(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(ServeConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:{line}: "), str(err.value)
    assert message in str(err.value)


def test_a_plain_dict_is_accepted_too():
    cfg = parse_config({"models": [{"name": "m", "engine": "command", "command": ["x"]}]})
    assert cfg.models[0].command == ("x",) and cfg.port == 8000


def test_check_prints_the_plan_and_starts_nothing(tmp_path):
    require_installed("vllm")  # the plan's models are vLLM's: --check wants it installed
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    script = tmp_path / "serve.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    text = GOOD.replace("/models/", f"{tmp_path}/").replace("8123", "0").replace("8002", "0")
    path = write(tmp_path, text.replace("port: 0\n    start", "start"))
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", "--check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "model    llama-b" in out.stdout and "--enable-sleep-mode" in out.stdout
    bad = write(tmp_path, "models:\n  - name: a\n    model: m\n    sleep: {idle: 3}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", "--check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"{bad}:4: models[0].sleep.idle: unknown key" in out.stderr


def test_the_core_package_imports_without_the_serve_extra():
    code = (
        "import sys; sys.modules['aiohttp'] = None; sys.modules['yaml'] = None\n"
        "import kvcached, kvcached.control, kvcached.cli.main, kvcached.cli.kvctl\n"
        "from kvcached.cli.main import main\n"
        "import tempfile, os\n"
        "p = os.path.join(tempfile.mkdtemp(), 'c.yaml'); open(p, 'w').write('models: []')\n"
        "sys.exit(main(['serve', '--check', p]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert 'pip install ".[serve]"' in out.stderr
