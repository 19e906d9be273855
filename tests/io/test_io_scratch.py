import errno
import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from pystronghold.io import DiskSpaceError, ScratchDir, check_free_space, free_bytes
from pystronghold.io import scratch as scratch_mod

PREFIX = "pystronghold-scratch-"


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (so os.kill(pid, 0) fails)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def fake_scratch(parent, pid: int, *, hostname: str | None = None, owner: bool = True,
                 payload_bytes: int = 1000):
    """A scratch directory as a process ``pid`` on ``hostname`` would have left it."""
    path = parent / f"{PREFIX}{pid}-deadbeef"
    path.mkdir()
    (path / "states").mkdir()
    (path / "states" / "master.psr").write_bytes(b"\0" * payload_bytes)
    if owner:
        info = {"pid": pid, "hostname": hostname or socket.gethostname(), "start_time": 0.0}
        (path / "owner.json").write_text(json.dumps(info))
    return path


# ---- ScratchDir

def test_scratch_dirs_are_unique_named_and_owned(tmp_path):
    parent = tmp_path / "nvme" / "run"  # created, parents included
    with ScratchDir(parent) as a, ScratchDir(parent) as b:
        assert a.path != b.path and a.path.parent == b.path.parent == parent
        for s in (a, b):
            assert s.path.is_dir() and os.fspath(s) == str(s.path)
            assert re.fullmatch(rf"{PREFIX}{os.getpid()}-[0-9a-f]+", s.path.name)
            owner = json.loads((s.path / "owner.json").read_text())
            assert owner["pid"] == os.getpid() and owner["hostname"] == socket.gethostname()
            assert abs(owner["start_time"] - time.time()) < 60
    assert list(parent.iterdir()) == []


def test_custom_prefix_and_bad_prefix(tmp_path):
    with ScratchDir(tmp_path, prefix="run7-") as s:
        assert s.path.name.startswith(f"run7-{os.getpid()}-")
    with pytest.raises(ValueError, match="prefix"):
        ScratchDir(tmp_path, prefix="a/b")


def test_close_removes_the_tree_and_is_idempotent(tmp_path):
    s = ScratchDir(tmp_path)
    (s.path / "states").mkdir()
    (s.path / "states" / "exp_avg.psr").write_bytes(b"x" * 4096)
    s.close()
    assert not s.path.exists() and s.closed
    s.close()  # idempotent
    s2 = ScratchDir(tmp_path)
    (s2.path / "owner.json").unlink()
    s2.path.rmdir()  # removed behind its back: close() does not raise
    s2.close()
    assert list(tmp_path.iterdir()) == []


def test_stale_dir_of_a_dead_pid_is_removed(tmp_path, caplog):
    pid = dead_pid()
    stale = fake_scratch(tmp_path, pid, payload_bytes=12345)
    size = 12345 + (stale / "owner.json").stat().st_size
    with caplog.at_level(logging.INFO, logger="pystronghold.io.scratch"):
        s = ScratchDir(tmp_path)
    assert not stale.exists()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1 and str(stale) in lines[0] and f"{size:,} bytes" in lines[0], lines
    s.close()


def test_live_other_host_and_foreign_dirs_are_kept(tmp_path):
    live = subprocess.Popen(["sleep", "30"])
    try:
        pid = dead_pid()
        kept = [
            fake_scratch(tmp_path, live.pid),  # owner alive
            fake_scratch(tmp_path, pid, hostname="another-host.invalid"),  # cannot tell from here
        ]
        no_owner = tmp_path / f"{PREFIX}{pid}-0123"
        no_owner.mkdir()  # maybe being created right now
        bad_owner = tmp_path / f"{PREFIX}{pid}-4567"
        bad_owner.mkdir()
        (bad_owner / "owner.json").write_text("{not json")
        wrong_pid = tmp_path / f"{PREFIX}{pid}-89ab"
        wrong_pid.mkdir()  # owner.json names another (live) process than the name does
        (wrong_pid / "owner.json").write_text(json.dumps({"pid": live.pid, "hostname": socket.gethostname()}))
        other_prefix = tmp_path / f"other-{pid}-cdef"
        other_prefix.mkdir()
        (other_prefix / "owner.json").write_text(json.dumps({"pid": pid, "hostname": socket.gethostname()}))
        a_file = tmp_path / f"{PREFIX}{pid}-ef01"
        a_file.write_text("not a directory")
        kept += [no_owner, bad_owner, wrong_pid, other_prefix, a_file]
        with ScratchDir(tmp_path) as s:
            for path in kept:
                assert path.exists(), path
        assert not s.path.exists()
    finally:
        live.kill()
        live.wait()


def test_atexit_removes_the_directory(tmp_path):
    # NOTE: the module is loaded from its file, not through the package, so the child does not
    # import torch (seconds); it only needs the standard library.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('scratch', {scratch_mod.__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "s = mod.ScratchDir(sys.argv[1])\n"
        "open(s.path / 'data', 'wb').write(b'x' * 100)\n"
        "print(s.path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip()
    assert out.startswith(str(tmp_path / PREFIX))
    assert not os.path.exists(out)
    assert tmp_path.is_dir()


def test_parent_under_a_regular_file_raises_clearly(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("in the way")
    with pytest.raises(OSError, match=re.escape(f"{a_file} for scratch files: it exists and is not a directory")):
        ScratchDir(a_file)
    with pytest.raises(OSError, match=re.escape(str(a_file / "sub")) + ".*is a file, not a directory"):
        ScratchDir(a_file / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_parent_raises_clearly(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    try:
        with pytest.raises(OSError, match=re.escape(str(parent)) + ".*Permission denied"):
            ScratchDir(parent)
    finally:
        parent.chmod(0o700)


def test_read_only_file_system_raises_clearly(tmp_path, monkeypatch):
    # NOTE: the test machine runs as root, which writes through permission bits; a read-only
    # file system is simulated where pathlib creates directories.
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    with pytest.raises(OSError, match=re.escape(str(tmp_path)) + ".*Read-only file system"):
        ScratchDir(tmp_path)


def test_a_forked_child_does_not_remove_its_parents_directory(tmp_path):
    s = ScratchDir(tmp_path)
    pid = os.fork()
    if pid == 0:  # child: close (as its atexit hook would) and leave without running pytest
        try:
            s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert s.path.is_dir()
    s.close()
    assert not s.path.exists()


# ---- free space

def test_free_bytes_of_a_missing_path_is_that_of_its_ancestor(tmp_path):
    st = os.statvfs(tmp_path)
    expected = st.f_bavail * st.f_frsize
    # NOTE: other processes may write meanwhile; 256 MiB of slack keeps the test deterministic
    assert abs(free_bytes(tmp_path / "not" / "yet") - expected) < 2**28
    assert abs(free_bytes(tmp_path) - expected) < 2**28


def test_free_space_error_has_the_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch_mod, "free_bytes", lambda path: 2**30)
    check_free_space(tmp_path, 2**30, what="anything")  # exactly enough
    with pytest.raises(DiskSpaceError) as info:
        check_free_space(tmp_path, 12 * 2**30, what="the NVMe tier's optimizer states")
    err = info.value
    assert isinstance(err, OSError)
    assert (err.need_bytes, err.free_bytes, err.directory) == (12 * 2**30, 2**30, str(tmp_path))
    message = str(err)
    for part in (str(tmp_path), "the NVMe tier's optimizer states", "12,884,901,888 bytes (12.00 GiB)",
                 "1,073,741,824 bytes (1.00 GiB) free", "free space, choose another --nvme directory, "
                 "or give more --host-memory"):
        assert part in message, (part, message)


def test_huge_need_fails_on_the_real_file_system(tmp_path):
    with pytest.raises(DiskSpaceError, match="need 1,125,899,906,842,624,000 bytes"):
        check_free_space(tmp_path, 1000 * 2**50, what="a test")
    with pytest.raises(ValueError, match="need_bytes"):
        check_free_space(tmp_path, -1, what="a test")


def test_the_nvme_probe_leaves_no_file_and_removes_those_of_dead_processes(tmp_path, monkeypatch):
    """The probe file is removed when the probe fails, and a probe file a killed process left (it
    could not remove it) is removed by the next check; a live process's and another host's stay."""
    from pystronghold.io.scratch import PROBE_PREFIX, check_io_directory

    host = socket.gethostname()
    dead = tmp_path / f"{PROBE_PREFIX}{host}-{dead_pid()}-deadbeef"
    live = tmp_path / f"{PROBE_PREFIX}{host}-1-deadbeef"
    other = tmp_path / f"{PROBE_PREFIX}not-{host}-{dead_pid()}-deadbeef"
    for p in (dead, live, other):
        p.write_bytes(b"")
    assert check_io_directory(tmp_path, flag="--nvme") in (True, False)
    assert sorted(tmp_path.iterdir()) == sorted([live, other])

    def full(fd, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scratch_mod.os, "pwrite", full)
    with pytest.raises(ValueError, match="No space left on device"):
        check_io_directory(tmp_path, flag="--nvme")
    assert sorted(tmp_path.iterdir()) == sorted([live, other])
