"""Bad ledger files and directories: each is a clear error, and nothing is overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from kvcached.errors import LedgerError, LedgerLayoutError, LedgerPermissionError
from kvcached.ledger import Ledger, layout, ledger_path
from kvcached.units import GIB

from .conftest import FakeDevice, file_bytes, is_root

NOBODY = 65534


def make_ledger(directory: str, device_id: str = "fake-0") -> str:
    led = Ledger.open(device_id, FakeDevice(), directory=directory)
    pool = led.register_pool("a")
    assert pool.grant(GIB)
    path = led.path
    led.close()
    return path


def refused(
    directory: str,
    match: str,
    device_id: str = "fake-0",
    error: type[Exception] = LedgerLayoutError,
) -> None:
    path = ledger_path(directory, device_id)
    before = file_bytes(path) if os.path.lexists(path) and os.path.isfile(path) else None
    with pytest.raises(error, match=match):
        Ledger.open(device_id, FakeDevice(), directory=directory)
    after = file_bytes(path) if os.path.lexists(path) and os.path.isfile(path) else None
    assert after == before, "the refused file was modified"
    assert [n for n in os.listdir(directory) if n.endswith(".tmp")] == []


def patch_header(path: str, field: str, value: int) -> None:
    desc = getattr(layout.Header, field)
    with open(path, "r+b") as f:
        f.seek(desc.offset)
        f.write(value.to_bytes(desc.size, "little"))


def test_a_truncated_file_is_refused(ledger_dir):
    path = make_ledger(ledger_dir)
    os.truncate(path, 4096)
    refused(ledger_dir, r"truncated: 4096 bytes, the layout needs 24832.*remove the file")
    os.truncate(path, 100)
    refused(ledger_dir, r"truncated: 100 bytes, shorter than the 256-byte header")


def test_a_longer_file_is_refused(ledger_dir):
    path = make_ledger(ledger_dir)
    os.truncate(path, layout.FILE_SIZE + 4096)
    refused(ledger_dir, "longer than its layout")


def test_another_layout_version_is_refused(ledger_dir):
    path = make_ledger(ledger_dir)
    patch_header(path, "layout_version", 99)
    refused(ledger_dir, r"layout version 99; this kvcached uses version 3.*stop every kvcached")


@pytest.mark.parametrize(
    "field",
    [
        "header_size",
        "pool_record_size",
        "pool_slots",
        "instance_record_size",
        "instance_slots",
        "file_size",
    ],
)
def test_other_record_sizes_are_refused(ledger_dir, field):
    path = make_ledger(ledger_dir)
    patch_header(path, field, 12345)
    refused(ledger_dir, f"declares {field}=12345")


def test_another_magic_is_refused(ledger_dir):
    path = ledger_path(ledger_dir, "fake-0")
    with open(path, "wb") as f:
        f.write(b"SOMETHING ELSE ENTIRELY" * 2000)
    refused(ledger_dir, r"not a kvcached ledger: its magic is b'SOMETHIN'")
    open(path, "wb").close()
    refused(ledger_dir, r"not a kvcached ledger: its magic is b''.*\(0 bytes\)")


def test_a_ledger_of_another_device_is_refused(ledger_dir):
    path = make_ledger(ledger_dir, "dev-a")
    os.rename(path, ledger_path(ledger_dir, "dev-b"))
    refused(ledger_dir, "belongs to device 'dev-a', not 'dev-b'", device_id="dev-b")


def test_a_symlink_in_place_of_the_file_is_refused(ledger_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = make_ledger(str(elsewhere))
    before = file_bytes(target)
    os.symlink(target, ledger_path(ledger_dir, "fake-0"))
    refused(ledger_dir, "symbolic link.*O_NOFOLLOW", error=LedgerError)
    assert os.path.islink(ledger_path(ledger_dir, "fake-0"))
    assert file_bytes(target) == before
    os.symlink(str(tmp_path / "missing"), ledger_path(ledger_dir, "dangling"))
    refused(ledger_dir, "symbolic link", device_id="dangling", error=LedgerError)
    assert not os.path.exists(tmp_path / "missing")  # not created through the link


def test_a_directory_in_place_of_the_file_is_refused(ledger_dir):
    os.mkdir(ledger_path(ledger_dir, "fake-0"))
    refused(ledger_dir, "is a directory", error=LedgerError)


def test_a_missing_directory_names_the_variable(tmp_path):
    with pytest.raises(LedgerError, match="KVCACHED_LEDGER_DIR=.*is not a directory"):
        Ledger.open("fake-0", FakeDevice(), directory=str(tmp_path / "nope"))


def _as_nobody(directory: str) -> dict:
    """Open the ledger in a forked child that dropped root (or as ourselves if we
    are not root); returns what happened."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        out: dict = {}
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            Ledger.open("fake-0", FakeDevice(), directory=directory).close()
            out["error"] = None
        except BaseException as exc:
            out = {
                "error": type(exc).__name__,
                "message": str(exc),
                "permission": isinstance(exc, PermissionError),
                "errno": getattr(exc, "errno", None),
                "filename": getattr(exc, "filename", None),
            }
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def shared_dir():
    """A directory every user can enter (pytest's tmp_path is private to root)."""
    path = tempfile.mkdtemp(prefix="kvcached-perm-")
    os.chmod(path, 0o755)
    yield path
    os.chmod(path, 0o755)
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def test_a_directory_without_write_permission(shared_dir):
    os.chmod(shared_dir, 0o555)
    if not is_root() and os.access(shared_dir, os.W_OK):
        pytest.skip("permission bits do not bind here")
    out = _as_nobody(shared_dir)
    assert out["error"] == LedgerPermissionError.__name__ and out["permission"], out
    assert out["errno"] == 13 and out["filename"].startswith(shared_dir), out
    assert "Permission denied" in out["message"] and "common group" in out["message"], out
    assert os.listdir(shared_dir) == []


def test_a_file_without_write_permission(shared_dir):
    path = make_ledger(shared_dir)
    os.chmod(path, 0o644)
    before = file_bytes(path)
    out = _as_nobody(shared_dir)
    assert out["error"] == LedgerPermissionError.__name__ and out["permission"], out
    assert out["filename"] == path
    assert file_bytes(path) == before
    assert os.stat(path).st_mode & 0o777 == 0o644  # never chmod-ed
    assert sorted(os.listdir(shared_dir)) == [os.path.basename(path)]


def test_racing_creators_all_open_the_same_complete_file(ledger_dir):
    """Processes that start together: one creates, all see the same file."""
    code = (
        "import os, sys, time, json\n"
        "from kvcached.ledger import Ledger\n"
        "class D:\n"
        "    def mem_info(self): return 8 << 30, 10 << 30\n"
        "start = float(sys.argv[2])\n"
        "while time.time() < start: pass\n"
        "led = Ledger.open('race-0', D(), directory=sys.argv[1], gpu_utilization=0.9)\n"
        "st = os.stat(led.path)\n"
        "print(json.dumps([st.st_ino, led.budget, led.snapshot().header.created_ns]))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    start = str(__import__("time").time() + 1.5)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, ledger_dir, start],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({tuple(o) for o in outs}) == 1, outs
    assert outs[0][1] == 7 * GIB
    assert os.listdir(ledger_dir) == ["kvcached-ledger-race-0"]
