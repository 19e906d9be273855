"""Output paths of ``train`` checked when their options are parsed (``--trace``, ``--tensorboard``,
``--metrics-file``, ``--checkpoint-dir``): a file is made and removed there, so a path the run could
not write is refused in one line before the run rather than after it, and nothing is left behind."""

from __future__ import annotations

import errno
import os
import tempfile

from pystronghold.options import ConfigError

__all__ = ["check_creatable_dir", "check_creatable_file"]


def _probe_dir(directory: str) -> None:
    """Create and remove a file in ``directory`` (OSError when that fails): a permission test alone
    misses a read-only file system, ACLs, root squash. The name is unique: every torchrun rank
    checks the same paths at once."""
    fd, name = tempfile.mkstemp(prefix=".pystronghold-check-", dir=directory)
    os.close(fd)
    os.unlink(name)


def check_creatable_dir(flag: str, path: str) -> None:
    """ConfigError naming ``flag`` and ``path`` unless ``path`` is a writable directory or can be made
    one (a file can be made in its nearest existing ancestor). Checked when the option is parsed,
    so a bad output path is refused before the run rather than after it; nothing is left behind."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        _probe_dir(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {probe} is not a writable directory ({e.strerror or e})") from None


def check_creatable_file(flag: str, path: str) -> None:
    """ConfigError naming ``flag`` and ``path`` unless ``path`` can be opened for writing: an existing
    file is opened for appending (its content kept), else a file is made and removed in its directory."""
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        if os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:
            _probe_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise ConfigError(f"{flag} {path}: not a writable file ({e.strerror or e})") from None
