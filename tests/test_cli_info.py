import json
import subprocess
import sys

import pytest


def run(*args, env=None):
    import os

    full_env = dict(os.environ, KVCACHED_DRIVER="host", KVCACHED_HOST_CAPACITY="256M")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvcached", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def test_info_runs_on_host_backend():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "backend      host" in out.stdout
    assert "written and read back: ok" in out.stdout
    for call in ("create", "map", "set_access", "unmap", "release"):
        assert call in out.stdout


@pytest.mark.slow
def test_info_json():
    out = run("info", "--json", "--pages", "3")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True
    assert report["device"]["backend"] == "host"
    assert report["total_bytes"] == 256 << 20
    assert report["check"]["pages"] == 3 and report["check"]["data_ok"]
    assert set(report["check"]["call_us_p50"]) >= {
        "create",
        "map",
        "set_access",
        "unmap",
        "release",
    }


def test_info_bad_config_exits_2_with_variable_named():
    out = run("info", env={"KVCACHED_PAGE_SIZE_MB": "3"})
    assert out.returncode == 2
    assert "KVCACHED_PAGE_SIZE_MB" in out.stderr and "'3'" in out.stderr


@pytest.mark.slow
def test_info_without_nvidia_driver_fails_clearly():
    out = run("info", "--backend", "cuda")
    assert out.returncode == 1
    assert "no NVIDIA driver" in out.stderr or "cuda" in out.stderr.lower()
