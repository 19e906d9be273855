"""A small, fresh tmpfs for the tests of a full disk (shared by tests/io/ and tests/runtime/; not a
test file)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path


@contextlib.contextmanager
def small_tmpfs(size_bytes: int, *, inodes: int | None = None):
    """A fresh tmpfs of size_bytes (and at most ``inodes`` files and directories, itself included)
    (root only); None where it cannot be mounted."""
    if os.geteuid() != 0:
        yield None
        return
    mount_point = tempfile.mkdtemp(prefix="ps-tmpfs-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o",
                           f"size={size_bytes}" + (f",nr_inodes={inodes}" if inodes else ""), "tmpfs", mount_point],
                          capture_output=True)
    if done.returncode != 0:
        os.rmdir(mount_point)
        yield None
        return
    try:
        yield Path(mount_point)
    finally:
        subprocess.run(["umount", "-l", mount_point], check=False)
        os.rmdir(mount_point)
