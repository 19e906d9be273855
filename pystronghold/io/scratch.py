"""Scratch space for the live file tier (NVMe): a private directory that lives as long as the run.

``ScratchDir(parent)`` creates ``pystronghold-scratch-<pid>-<hex>`` under ``--nvme DIR`` and
removes it on close or normal exit; nothing a checkpoint needs lives there. Stale directories
of dead processes on this host are removed by the next ``ScratchDir``. ``check_free_space``
refuses too little room up front. Sizes are in bytes.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

from pystronghold.options import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DiskSpaceError", "ScratchDir", "free_bytes", "check_free_space", "check_io_directory", "OWNER_FILE"]

OWNER_FILE = "owner.json"
"""File inside every scratch directory naming its owner (pid, hostname, start time)."""


def _fmt_bytes(n: int) -> str:
    """``12,884,901,888 bytes (12.00 GiB)``."""
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


# ---- a directory the file tier can use

PROBE_BYTES = 4096
"""Size of the probe file of ``check_io_directory`` (one O_DIRECT-aligned block)."""


def check_io_directory(path: str | os.PathLike, *, flag: str) -> bool:
    """Make sure the file tier can work in directory ``path``: create it when missing (logged), then
    write a ``PROBE_BYTES`` probe file (O_DIRECT where the file system supports it, as the tier
    does), fsync it, read it back, compare and remove it, on every path out (a process killed
    with SIGKILL cannot: the next check removes the probe files of dead processes of this host).
    Returns whether O_DIRECT works.

    Raises ConfigError naming ``flag`` (the option that gave ``path``) and the reason.
    """
    p = Path(path)
    if not p.exists():
        try:
            p.mkdir(parents=True)
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
        logger.warning("%s %s did not exist: created it", flag, path)
    elif not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    _remove_stale_probes(p)
    probe = p / f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    data = secrets.token_bytes(PROBE_BYTES)
    try:
        try:
            return _probe(probe, data, direct=hasattr(os, "O_DIRECT"))
        except OSError as e:
            if e.errno != errno.EINVAL or not hasattr(os, "O_DIRECT"):
                raise
            probe.unlink(missing_ok=True)
            return _probe(probe, data, direct=False)  # a file system without O_DIRECT (tmpfs): buffered
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write and read back a file there ({e.strerror or e}); "
                         "give a writable directory on a local disk") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass


PROBE_PREFIX = ".pystronghold-probe-"
"""Start of a probe file's name; then the hostname, the pid and 8 hex digits."""


def _remove_stale_probes(directory: Path) -> None:
    """Remove the probe files in ``directory`` of processes of this host that no longer exist."""
    pattern = re.compile(re.escape(PROBE_PREFIX + socket.gethostname()) + r"-(\d+)-[0-9a-f]{8}")
    try:
        names = os.listdir(directory)
    except OSError:
        return  # the probe itself then says what is wrong with the directory
    for name in names:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            try:
                os.unlink(directory / name)
            except OSError:
                pass  # removed by another process meanwhile, or not ours to remove


def _probe(path: Path, data: bytes, *, direct: bool) -> bool:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o600)
    try:
        out, back = mmap.mmap(-1, len(data)), mmap.mmap(-1, len(data))  # page-aligned for O_DIRECT
        out.write(data)
        if os.pwrite(fd, out, 0) != len(data):
            raise OSError(errno.EIO, "short write")
        os.fsync(fd)
        if os.preadv(fd, [back], 0) != len(data) or back[:] != data:
            raise OSError(errno.EIO, "what was read back differs from what was written")
        return direct
    finally:
        os.close(fd)


# ---- free space

class DiskSpaceError(OSError):
    """Not enough free space on the file system of ``directory`` for ``need_bytes``.

    Attributes ``directory`` (str), ``need_bytes`` and ``free_bytes`` (int, bytes) and ``what``.
    """

    def __init__(self, directory: str | os.PathLike, need_bytes: int, free: int, what: str) -> None:
        self.directory, self.need_bytes, self.free_bytes, self.what = str(directory), need_bytes, free, what
        super().__init__(
            f"not enough free space in {self.directory} for {what}: need {_fmt_bytes(need_bytes)}, "
            f"{_fmt_bytes(free)} free; free space, choose another --nvme directory, "
            f"or give more --host-memory")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer can still use on the file system holding ``path``
    (``f_bavail * f_frsize``: the blocks reserved for root do not count). A ``path`` that does not
    exist yet is measured at its nearest existing ancestor, where it would be created."""
    st = os.statvfs(_nearest_existing(Path(path)))
    return st.f_bavail * st.f_frsize


def check_free_space(directory: str | os.PathLike, need_bytes: int, *, what: str) -> None:
    """Raise ``DiskSpaceError`` if the file system of ``directory`` has fewer than ``need_bytes``
    free bytes. ``what`` names what the bytes are for ("the NVMe tier's optimizer states")."""
    if need_bytes < 0:
        raise ValueError(f"need_bytes must be >= 0, got {need_bytes}")
    free = free_bytes(directory)
    if free < need_bytes:
        raise DiskSpaceError(directory, need_bytes, free, what)


# ---- stale directories

def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile; the size is for the log line only
    return total


def _remove_stale(parent: Path, prefix: str) -> None:
    """Remove directories in ``parent`` left by dead processes of this host.

    NOTE: deliberately conservative, since ``parent`` is a user's directory: a candidate must
    match ``<prefix><pid>-<hex>``, be a real directory (not a symlink), hold a readable
    ``owner.json`` whose pid matches its name and whose hostname is ours, and that pid must not
    exist. A directory without ``owner.json`` is kept: it may be one being created right now.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]+")
    host = socket.gethostname()
    try:
        entries = list(parent.iterdir())
    except OSError as e:  # e.g. write-only: creating our own directory may still work
        logger.warning("cannot list %s to remove stale scratch directories: %s", parent, e)
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
            pid, owner_host = owner["pid"], owner["hostname"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid != int(match.group(1)) or owner_host != host or pid == os.getpid() or _pid_alive(pid):
            continue
        size = _tree_bytes(entry)
        try:
            shutil.rmtree(entry)
        except FileNotFoundError:
            continue  # another process cleaned it first
        except OSError as e:
            logger.warning("could not remove stale scratch directory %s: %s", entry, e)
            continue
        logger.info("removed stale scratch directory %s (%s; owner pid %d on %s is gone)",
                    entry, _fmt_bytes(size), pid, host)


# ---- the scratch directory

class ScratchDir:
    """A fresh private directory ``<parent>/<prefix><pid>-<random hex>``, removed on ``close()``.

    Creating it creates ``parent`` if needed and first removes stale scratch directories of dead
    processes there (see ``_remove_stale``). ``close()`` removes the whole tree; it is idempotent,
    logs errors instead of raising, and also runs at a normal interpreter exit. Use as a context
    manager, or as a path (``os.fspath(scratch)``). A ``parent`` that cannot be created or
    written raises ``OSError`` naming it and the reason.
    """

    def __init__(self, parent: str | os.PathLike, *, prefix: str = "pystronghold-scratch-") -> None:
        if not prefix or os.sep in prefix or (os.altsep and os.altsep in prefix):
            raise ValueError(f"ScratchDir prefix must be a non-empty file name part, got {prefix!r}")
        parent = Path(parent).absolute()
        self._pid = os.getpid()  # the owner: only this process removes the directory
        self._closed = False
        _make_parent(parent)
        _remove_stale(parent, prefix)
        self.path = _make_unique(parent, f"{prefix}{self._pid}-")
        """The scratch directory (absolute ``Path``)."""
        owner = {"pid": self._pid, "hostname": socket.gethostname(), "start_time": time.time()}
        try:
            (self.path / OWNER_FILE).write_text(json.dumps(owner) + "\n")
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise OSError(f"cannot write {self.path / OWNER_FILE}: {e.strerror or e}") from None
        # NOTE: a bound method keeps self alive until exit or close(); close() unregisters it.
        atexit.register(self.close)
        logger.debug("scratch directory %s", self.path)

    def close(self) -> None:
        """Remove the directory tree. Idempotent; errors are logged, not raised.

        NOTE: a forked child inherits this object and the atexit hook; only the process that
        created the directory removes it, so a child's exit does not pull it from under its parent.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if os.getpid() != self._pid:
            return
        try:
            shutil.rmtree(self.path)
        except FileNotFoundError:
            pass  # already gone: nothing to do
        except OSError as e:
            logger.warning("could not remove scratch directory %s: %s", self.path, e)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._closed

    def __enter__(self) -> ScratchDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"ScratchDir({str(self.path)!r}{', closed' if self._closed else ''})"


def _make_parent(parent: Path) -> None:
    """Create ``parent`` (and its parents); turn failures into one clear ``OSError``."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OSError(f"cannot use {parent} for scratch files: it exists and is not a directory") from None
    except NotADirectoryError:
        raise OSError(f"cannot create the scratch parent directory {parent}: a component of "
                      f"that path is a file, not a directory") from None
    except OSError as e:
        raise OSError(f"cannot create the scratch parent directory {parent}: "
                      f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")) from None
    if not parent.is_dir():  # mkdir(exist_ok=True) passes for a symlink to a non-directory
        raise OSError(f"cannot use {parent} for scratch files: it is not a directory")


def _make_unique(parent: Path, stem: str) -> Path:
    """Create ``parent/<stem><random hex>`` (mode 0700) and return it."""
    for _ in range(100):  # 64 random bits: a collision is not expected even once
        path = parent / f"{stem}{secrets.token_hex(8)}"
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise OSError(f"cannot create a scratch directory in {parent}: {e.strerror or e}") from None
    raise OSError(f"cannot create a scratch directory in {parent}: 100 names taken")
