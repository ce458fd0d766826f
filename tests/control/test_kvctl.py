"""kvctl end to end, against real instances running in processes of their own.

Each instance (``instance_child.py``) opens a KV cache with ``open_kv_cache`` on
the host backend, charged to a ledger in a temporary directory, and publishes
its snapshot. kvctl finds that ledger through the snapshot (no environment
needed); most runs are in-process (``kvctl.main``), a few through ``python -m
kvcached.cli.kvctl`` to check the real entry point and exit codes.

Exact bytes: the instances map one physical handle per page
(``max_handle_bytes=0``), so memory goes back page by page, and a limit equal
to the bytes of the pages in use must leave exactly those pages mapped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import pytest

from kvcached.cli import kvctl
from tests.control.kvctl_helpers import REPO, Child, run_kvctl, unique_index, wait_until

KVCTL_X_IMPORTTIME = [sys.executable, "-X", "importtime", "-m", "kvcached.cli.kvctl"]

MIB = 1 << 20


@pytest.fixture(scope="module")
def pair():
    """Two named instances on one host device, and their ledger directory."""
    # Readable by every user (the permission test runs kvctl as nobody when root):
    # the ledger file itself is what must refuse.
    ledger_dir = tempfile.mkdtemp(prefix="kvctl-test-")
    os.chmod(ledger_dir, 0o755)
    index = unique_index()
    tag = uuid.uuid4().hex[:6]
    a = Child(ledger_dir, index, name=f"kvt-{tag}-a")
    b = None
    try:
        b = Child(ledger_dir, index, name=f"kvt-{tag}-b")
        yield a, b, ledger_dir, index
    finally:
        for c in (a, b):
            if c is not None:
                c.close()
        shutil.rmtree(ledger_dir, ignore_errors=True)


def ctl(capsys, *argv: str) -> tuple[int, str, str]:
    rc = kvctl.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def listed(capsys, *names: str) -> dict[str, dict]:
    rc, out, err = ctl(capsys, "list", "--json", *names)
    assert rc == 0, err
    return {row["name"]: row for row in json.loads(out)}


def test_list_shows_both_instances(pair, capsys):
    a, b, _, index = pair
    rc, out, err = ctl(capsys, "list", a.name, b.name)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "GPU", "USED", "RESERVED", "LIMIT", "PID", "STATE"]
    row_a = next(line for line in lines if line.startswith(a.name))
    assert f"host-{index}" in row_a and str(a.pid) in row_a and row_a.endswith("live")
    rows = listed(capsys, a.name, b.name)
    assert set(rows) == {a.name, b.name}
    assert rows[b.name]["pids"] == [b.pid] and rows[b.name]["gpu"] == f"host-{index}"
    assert rows[a.name]["engine"] == "test" and rows[a.name]["engine_version"] == "1.0"


def test_list_through_the_real_entry_point(pair):
    a, _, _, _ = pair
    done = run_kvctl("list", "--json", a.name)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["name"] == a.name and row["pids"] == [a.pid] and row["state"] == "live"
    assert row["used_bytes"] == a.cmd("usage")["bytes_mapped"]


def test_status(pair, capsys):
    a, _, ledger_dir, index = pair
    a.cmd("alloc 300")
    try:
        assert wait_until(lambda: listed(capsys, a.name)[a.name]["blocks_used"] == 300)
        rc, out, err = ctl(capsys, "status", a.name)
        assert rc == 0, err
        assert f"instance   {a.name}" in out and f"host-{index} (host)" in out
        assert "300 of" in out and ledger_dir in out and "engine     test 1.0" in out
        rc, out, _ = ctl(capsys, "status", a.name, "--json")
        doc = json.loads(out)
        assert doc["instance"] == a.name and doc["gpus"][0]["blocks_used"] == 300
    finally:
        a.cmd("free 300")


def test_limit_down_releases_idle_pages_exactly_and_up_grows_again(pair, capsys):
    a, b, _, _ = pair
    page, bpp = a.page_bytes, a.blocks_per_page
    assert a.cmd(f"alloc {bpp * 10}")["ok"]
    a.cmd(f"free {bpp * 8}")  # two pages of blocks stay in use (plus the null block's page)
    before = a.cmd("usage")
    used_bytes = before["pages_used"] * page
    assert before["bytes_mapped"] > used_bytes, "the test needs idle pages to release"
    b_before = b.cmd("usage")["bytes_mapped"]

    # Down to exactly the pages in use: every idle page goes, no used one.
    started = time.monotonic()
    rc, out, err = ctl(capsys, "limit", a.name, str(used_bytes), "--wait", "5")
    assert rc == 0, err
    assert "applied" in out and "revision " in out
    assert time.monotonic() - started < 5
    after = a.cmd("usage")
    assert after["bytes_mapped"] == used_bytes
    assert after["ledger_charged"] == used_bytes
    assert after["pages_reserved"] == 0
    assert after["blocks_used"] == before["blocks_used"]  # in-use blocks never taken
    assert b.cmd("usage")["bytes_mapped"] == b_before  # the other instance is untouched
    row = listed(capsys, a.name)[a.name]
    assert wait_until(lambda: listed(capsys, a.name)[a.name]["used_bytes"] == used_bytes)
    assert row["limit_bytes"] == used_bytes and row["charged_bytes"] == used_bytes

    # Growth past the limit is a miss, and the miss is published.
    assert a.cmd(f"alloc {bpp * 2}")["ok"] is False
    assert wait_until(lambda: listed(capsys, a.name)[a.name]["misses"] == 1)

    # Below what is in use: in force, deferred, nothing in use is taken.
    rc, out, err = ctl(capsys, "limit", a.name, str(page), "--wait", "0.5")
    assert rc == 0, err
    assert "deferred" in out
    assert a.cmd("usage")["bytes_mapped"] == used_bytes
    assert listed(capsys, a.name)[a.name]["state"] == "over-limit"

    # Up again (a size up to the startup one): it grows past the old limit.
    rc, out, err = ctl(capsys, "limit", a.name, "128M", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["status"] == "applied" and doc["devices"][0]["limit_bytes"] == 128 * MIB
    assert wait_until(lambda: a.cmd(f"alloc {bpp * 4}")["ok"], timeout=5)
    assert a.cmd("usage")["bytes_mapped"] > used_bytes

    # And removed.
    rc, out, err = ctl(capsys, "limit", a.name, "none")
    assert rc == 0 and "limit none" in out and "applied" in out, err
    assert listed(capsys, a.name)[a.name]["limit_bytes"] is None
    a.cmd(f"free {a.cmd('usage')['blocks_used']}")


def test_limit_percent_and_revisions(pair, capsys):
    a, _, _, _ = pair
    total = 256 * MIB
    rc, out, _ = ctl(capsys, "limit", a.name, "--percent", "50", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["devices"][0]["limit_bytes"] == total // 2
    rev = doc["devices"][0]["revision"]
    rc, out, _ = ctl(capsys, "limit-percent", a.name, "25", "--json")
    assert rc == 0 and json.loads(out)["devices"][0]["limit_bytes"] == total // 4
    rc, out, _ = ctl(capsys, "limit", a.name, "1.5g", "--revision", str(rev), "--json")
    assert rc == 1 and json.loads(out)["status"] == "stale"
    rc, out, _ = ctl(capsys, "limit", a.name, "100M", "--revision", str(rev + 1))
    assert rc == 1 and "conflict" in out
    rc, out, _ = ctl(capsys, "limit", a.name, str(total // 4), "--revision", str(rev + 1))
    assert rc == 0 and "applied" in out  # a retry of the stored value
    assert ctl(capsys, "limit", a.name, "none")[0] == 0


def test_python_api_for_controllers(pair):
    from kvcached.config import get_config
    from kvcached.control.limits import set_limit
    from kvcached.ledger.snapshot import LimitStatus

    a, _, _, _ = pair
    # A controller reads its settings and hands them down; the instances run with
    # their own directory, found through their snapshots.
    here = get_config().ledger_dir
    result = set_limit(a.name, 64 * MIB, configured_dir=here, wait_s=5)
    assert result.status == LimitStatus.APPLIED
    assert result.as_dict()["devices"][0]["limit_bytes"] == 64 * MIB
    assert set_limit(a.name, 32 * MIB, revision=1, configured_dir=here).status == LimitStatus.STALE
    assert set_limit(a.name, None, configured_dir=here).status == LimitStatus.APPLIED
    with pytest.raises(ValueError, match=r"limit_bytes=\d+: must be at most 9223372036854775807"):
        set_limit(a.name, 1 << 63, configured_dir=here)
    with pytest.raises(ValueError, match="give directory .* or configured_dir"):
        set_limit(a.name, 64 * MIB)  # no hidden read of KVCACHED_LEDGER_DIR


def test_gpus_and_metrics(pair, capsys):
    a, b, ledger_dir, index = pair
    rc, out, err = ctl(capsys, "gpus", "--ledger-dir", ledger_dir)
    assert rc == 0, err
    header, row = out.splitlines()[:2]
    assert header.split()[:6] == ["GPU", "TOTAL", "BUDGET", "MARGIN", "CHARGED", "HEADROOM"]
    assert row.startswith(f"host-{index}") and "256.00 MiB" in row and "ago" in row
    rc, out, _ = ctl(capsys, "gpus", "--ledger-dir", ledger_dir, "--json")
    (gpu,) = json.loads(out)
    assert gpu["total_bytes"] == 256 * MIB and sorted(gpu["instances"]) == sorted([a.name, b.name])
    assert gpu["budget_bytes"] > 0 and gpu["calibration_seq"] >= 1
    rc, out, _ = ctl(capsys, "metrics")
    assert rc == 0
    assert f'kvcached_instance_up{{instance="{a.name}",gpu="host-{index}"}} 1' in out
    assert f'kvcached_gpu_total_bytes{{gpu="host-{index}"}} {256 * MIB}' in out
    rc, out, _ = ctl(capsys, "metrics", "--json")
    assert {r["name"] for r in json.loads(out)["instances"]} >= {a.name, b.name}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["limit", "kvt-no-such", "1G"], "no kvcached instance named 'kvt-no-such' is running"),
        (["status", "kvt-no-such"], "no kvcached instance named 'kvt-no-such' is running"),
        (["list", "kvt-no-such"], "no kvcached instance named 'kvt-no-such' is running"),
        (["limit", "{a}", "12X"], "'12X' is not a size"),
        (["limit", "{a}", "-5M"], "unrecognized arguments: -5M"),
        (["limit", "{a}", "5 M B"], "'5 M B' is not a size"),
        (
            ["limit", "{a}", "0"],
            "SIZE '0' is out of range: give 1 byte to 9223372036854775807 bytes",
        ),
        (
            ["limit", "{a}", "99999999999999999999999"],
            "SIZE '99999999999999999999999' is out of range: give 1 byte to 9223372036854775807 bytes",
        ),
        (["list", "{a}", "kvt-nosuch"], "no kvcached instance named 'kvt-nosuch' is running"),
        (["limit", "{a}"], "give SIZE"),
        (["limit", "{a}", "1G", "--percent", "10"], "not both"),
        (["limit", "{a}", "--percent", "0"], "percent 0 must be in (0, 100]"),
        (["limit-percent", "{a}", "150"], "percent 150 must be in (0, 100]"),
        (["limit-percent", "{a}", "lots"], "invalid float value: 'lots'"),
        (["limit", "{a}", "1G", "--revision", "0"], "--revision 0 must be 1 or more"),
        (["limit", "bad name!", "1G"], "instance name 'bad name!' is not valid"),
        (["watch", "-n", "0"], "refresh interval must be above 0"),
        (["top", "--count", "0"], "--count must be 1 or more"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(pair, capsys, argv, message):
    a, _, _, _ = pair
    argv = [x.format(a=a.name) for x in argv]
    try:
        rc = kvctl.main(argv)
    except SystemExit as exc:  # argparse's errors leave from inside main
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    if argv[0] == "list" and a.name in argv:  # the running ones are still listed
        assert a.name in out
    else:
        assert out == ""


def test_bad_input_exit_code_through_the_entry_point(pair):
    a, _, _, _ = pair
    for argv in (["limit", a.name, "12X"], ["limit", "kvt-no-such", "1G"], ["frobnicate"]):
        done = run_kvctl(*argv)
        assert done.returncode == 2, (argv, done)
        assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_no_kvcached_running(tmp_path, monkeypatch, capsys):
    from kvcached.control import snapshot

    monkeypatch.setattr(snapshot, "SHM_DIR", str(tmp_path))  # no snapshot anywhere
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    rc, out, err = ctl(capsys, "list")
    assert (rc, out) == (
        2,
        "",
    ) and err == "kvctl: no kvcached instance is running on this machine\n"
    rc, out, err = ctl(capsys, "list", "--json")  # an answer, like metrics --json: none
    assert (rc, json.loads(out), err) == (0, [], "")
    rc, out, err = ctl(capsys, "list", "--json", "nosuch")
    assert (rc, out) == (2, "") and "no kvcached instance is running" in err
    rc, out, err = ctl(capsys, "limit", "anything", "1G")
    assert rc == 2 and "no kvcached instance is running" in err
    rc, out, err = ctl(capsys, "gpus")
    assert rc == 2 and "no kvcached ledger in" in err and len(err.splitlines()) == 1
    rc, out, _ = ctl(capsys, "metrics")  # a scrape of an idle machine is still valid
    assert rc == 0 and "# TYPE kvcached_instance_used_bytes gauge" in out


def test_no_permission(pair, capsys):
    """A user who may not write the ledger gets one line and exit 2."""
    a, _, ledger_dir, _ = pair
    (path,) = [
        os.path.join(ledger_dir, n)
        for n in os.listdir(ledger_dir)
        if n.startswith("kvcached-ledger-")
    ]
    if os.geteuid() != 0:
        mode = os.stat(path).st_mode
        os.chmod(path, 0o444)
        try:
            rc, out, err = ctl(capsys, "limit", a.name, "64M")
        finally:
            os.chmod(path, mode)
    else:  # root reads anything: run kvctl as nobody, in a forked child
        import kvcached.control.limits  # noqa: F401  (imported before dropping privileges:
        import kvcached.control.metrics  # noqa: F401  the interpreter's own files may not be
        import kvcached.control.view  # noqa: F401  readable by nobody)

        kvctl.build_parser()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 99
            try:
                stream = open(w, "w", closefd=False)  # noqa: SIM115
                sys.stdout = sys.stderr = stream
                os.setgid(65534)
                os.setuid(65534)
                code = kvctl.main(["limit", a.name, "64M"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            err = f.read()
        rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert rc == 2, err
    assert err.startswith("kvctl: ") and len(err.strip().splitlines()) == 1, err
    # The ledger named may be another one this user may not open (any of them
    # refuses), or the folder of another live instance's ledger, which kvctl
    # lists first: either says what was denied and on which ledger.
    assert re.search(
        r"Permission denied while (opening the kvcached ledger|listing the kvcached ledger "
        r"directory)",
        err,
    ), err


@pytest.mark.slow
def test_instances_without_a_name_get_distinct_ones_and_dead_ones_go(tmp_path, capsys):
    index = unique_index()
    first = Child(str(tmp_path), index, name=None, engine="vllm")
    second = None
    try:
        second = Child(str(tmp_path), index, name=None, engine="vllm")
        assert first.name == f"vllm-{first.pid}" and second.name == f"vllm-{second.pid}"
        rows = listed(capsys, first.name, second.name)
        assert set(rows) == {first.name, second.name}
        os.kill(second.pid, signal.SIGKILL)
        second.proc.wait(10)
        # A dead instance is never left looking alive: its snapshot is cleaned up, and
        # asking for it by name is an error (the live one is still listed).
        rc, out, err = ctl(capsys, "list", "--json", first.name, second.name)
        assert rc == 2 and f"no kvcached instance named {second.name!r}" in err, err
        assert [r["name"] for r in json.loads(out)] == [first.name]
    finally:
        for c in (first, second):
            if c is not None:
                c.close()


def test_kvctl_stays_light():
    """kvctl runs where no GPU stack is installed: no torch, no CUDA, no numpy."""
    done = run_kvctl("list", "--ledger-dir", "/nonexistent-kvctl-dir")
    timed = subprocess.run(
        [*KVCTL_X_IMPORTTIME, "list"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    modules = [
        line.rsplit("|", 1)[1].strip()
        for line in timed.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    assert "kvcached.control.view" in modules and done.returncode in (0, 2)
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "cuda", "numpy", "triton")]
    assert heavy == [], heavy
    init = (REPO / "kvcached" / "control" / "__init__.py").read_text()
    assert "import" not in init  # importing any control module must not pull the rest
