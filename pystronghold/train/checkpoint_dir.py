"""What a checkpoint directory holds and who owns it: names, manifests and their integrity, the one
run allowed to write it (a lock), and which of its checkpoints that run may delete.

One run per directory (an exclusive ``flock`` on ``<dir>/.lock``; a second run refuses in one
line). A fresh run refuses a directory with checkpoints unless ``--resume`` or ``--overwrite``.
The directory's run (``<dir>/.run``: the first run id of a lineage) is set by a fresh run in one
rename just before its first checkpoint counts; from then on ``--resume`` and ``export`` take only
that lineage's checkpoints, so an ``--overwrite`` run killed before it deleted its predecessor's
is never mixed with them. ``--resume`` renames a damaged checkpoint to ``step-NNNNNNNN.corrupt``
and falls back to the next older one. ``prune_checkpoints`` keeps the newest ``keep`` checkpoints
of this run's lineage (the run ids in each manifest) and deletes other runs' only under
``--overwrite`` (given to this run, or to the one that started the directory's lineage).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

__all__ = ["FORMAT", "VERSION", "CheckpointError", "checkpoint_name", "block_file", "checkpoint_steps",
           "latest_checkpoint", "read_manifest", "newest_valid_checkpoint", "valid_checkpoints", "set_aside",
           "UnusableCheckpoint", "new_run_id", "mark_run",
           "DirectoryLock", "open_run_directory", "open_run_directory_on_rank_0", "prune_checkpoints", "describe_model"]

log = logging.getLogger(__name__)

FORMAT = "pystronghold-checkpoint"
VERSION = 1
_PREFIX = "step-"
_ASIDE = ".corrupt"
LOCK_FILE = ".lock"
RUN_FILE = ".run"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, incomplete or made for another model, or a checkpoint
    directory this run may not use."""


class UnusableCheckpoint(CheckpointError):
    """A whole checkpoint this run cannot continue from (made for another model or block count,
    holding inf/NaN states, of another format version, or of another run than the directory's):
    a resume falls back to an older one; it is never moved aside."""


class _OtherVersion(UnusableCheckpoint):
    """A whole checkpoint of another format version."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: ``step-NNNNNNNN``."""
    return f"{_PREFIX}{step:08d}"


def block_file(index: int) -> str:
    """The path, inside a checkpoint, of global block ``index``'s file."""
    return f"blocks/block-{index:05d}.safetensors"


def checkpoint_steps(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-NNNNNNNN`` directory under ``root``, by step: complete or
    damaged (saves in progress are ``.tmp-*``, damaged ones set aside end in ``.corrupt``)."""
    root, out = Path(root), []
    if root.is_dir():
        for p in root.iterdir():
            digits = p.name[len(_PREFIX):]
            if p.name.startswith(_PREFIX) and digits.isdigit() and p.is_dir():
                out.append((int(digits), p))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step under ``root`` (not verified), or None."""
    found = checkpoint_steps(root)
    return found[-1][1] if found else None


# ---- manifests

def _manifest_json(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no manifest.json (not a checkpoint, or incomplete)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json is corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a {FORMAT} manifest")
    return manifest


def _check_listing(path: Path, manifest: dict) -> None:
    """CheckpointError unless the manifest has its step, model and an entry for every file."""
    files, blocks = manifest.get("files"), manifest.get("blocks")
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("model"), dict) \
            or not isinstance(blocks, int):
        raise CheckpointError(f"checkpoint {path}: manifest.json is damaged (no step, model or block count)")
    if not isinstance(files, dict) or not all(isinstance(m, dict) and isinstance(m.get("sha256"), str)
                                              for m in files.values()):
        raise CheckpointError(f"checkpoint {path}: manifest.json is damaged (no list of files and checksums)")
    missing = [rel for rel in ["state.pt", "head_tail.safetensors", *map(block_file, range(blocks))]
               if rel not in files]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path}: manifest.json is damaged (it does not list {missing[0]}{more})")


def read_manifest(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """The manifest of checkpoint ``path``, checked to list every file; with ``verify``, every
    file's checksum is checked too. Raises CheckpointError naming what is wrong."""
    path = Path(path)
    manifest = _manifest_json(path)
    if manifest.get("version") != VERSION:
        raise _OtherVersion(f"checkpoint {path}: format version {manifest.get('version')}, this "
                              f"pystronghold reads version {VERSION}")
    _check_listing(path, manifest)
    if verify:
        _verify_files(path, manifest)
    return manifest


def _verify_files(path: Path, manifest: dict) -> None:
    """CheckpointError naming the first file of ``manifest`` missing or not matching its sha256."""
    for rel, meta in manifest["files"].items():
        h = hashlib.sha256()
        try:
            with open(path / rel, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path}: {rel} is missing") from None
        if h.hexdigest() != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {rel} is corrupt (sha256 mismatch)")


def _lineage(manifest: dict) -> list:
    lineage = manifest.get("lineage")
    return lineage if isinstance(lineage, list) else []


def _writer(path: Path) -> str | None:
    """The run id that wrote checkpoint ``path`` (its lineage's last), None when unknown."""
    try:
        lineage = _lineage(_manifest_json(path))
    except CheckpointError:
        return None
    return lineage[-1] if lineage and isinstance(lineage[-1], str) else None


# ---- the directory's run

def _directory_run(root: Path) -> dict:
    """``{"run": id, "overwrite": bool}`` of ``root/.run``; {} when there is none (a directory
    written before runs were marked, or no run has checkpointed there yet) or it is unreadable."""
    try:
        marker = json.loads((root / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) and isinstance(marker.get("run"), str) else {}


def mark_run(root: str | os.PathLike, lineage: list[str], *, overwrite: bool) -> None:
    """Make ``lineage``'s run (its first id) the directory's, unless it is already, in one rename
    (written, fsynced, renamed into place). A fresh run calls it just before its first checkpoint
    counts; ``overwrite``: the run was given --overwrite (what is not of its lineage goes)."""
    root = Path(root)
    if _directory_run(root).get("run") == lineage[0]:
        return
    tmp = root / f".tmp-run-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"run": lineage[0], "overwrite": overwrite}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(root / RUN_FILE)


def describe_model(model: dict) -> str:
    """A few words naming the model of a manifest's ``model`` entry."""
    if "architecture" in model:
        return f"{model['architecture']} from hf:{model.get('source')}"
    fields = ("layers", "hidden", "heads", "vocab_size")
    return "GPT " + ", ".join(f"{k} {model[k]}" for k in fields if k in model)


# ---- damaged checkpoints

def set_aside(path: str | os.PathLike) -> Path:
    """Rename damaged checkpoint ``path`` to ``step-NNNNNNNN.corrupt`` (``.corrupt-2``, ... when
    taken), out of every listing, kept for inspection. Returns the new path."""
    path = Path(path)
    target, n = path.with_name(path.name + _ASIDE), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{_ASIDE}-{n}")
    path.rename(target)
    return target


def newest_valid_checkpoint(root: str | os.PathLike, *, move_damaged: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` whose manifest is whole and whose files all match their
    sha256, of the directory's run; each newer one that is not is logged (naming what is wrong) and
    skipped, and with ``move_damaged`` a damaged one is moved aside (``set_aside``; only the run
    holding the directory's lock may). None when none is valid."""
    return next(iter(valid_checkpoints(root, move_damaged=move_damaged)), None)


def valid_checkpoints(root: str | os.PathLike, *, below: int | None = None, move_damaged: bool = False,
                      reasons: list[str] | None = None):
    """The valid checkpoints under ``root`` (see ``newest_valid_checkpoint``), newest first, each
    verified as it is reached; ``below``: only those of lower steps. What was wrong with each one
    skipped is appended to ``reasons``."""
    root = Path(root)
    run, skipped = _directory_run(root).get("run"), []
    for step, path in reversed(checkpoint_steps(root)):
        if below is not None and step >= below:
            continue
        try:
            manifest = read_manifest(path, verify=False)
            if run is not None and run not in _lineage(manifest):
                raise UnusableCheckpoint(f"checkpoint {path} is another run's than the directory's (left by a "
                                         "run that --overwrite replaced, or copied here)")
            _verify_files(path, manifest)
        except CheckpointError as e:
            if move_damaged and not isinstance(e, UnusableCheckpoint):
                log.warning("%s; moved it aside as %s", e, set_aside(path).name)
            else:
                log.warning("%s; trying an older checkpoint", e)
            if reasons is not None:
                reasons.append(str(e))
            skipped.append(path.name)
            continue
        if skipped:
            log.warning("falling back to %s (the newest valid checkpoint; skipped %s)", path, ", ".join(skipped))
        yield path
        skipped = []


# ---- ownership

def new_run_id() -> str:
    """A fresh run id for a lineage (12 hex digits)."""
    return uuid.uuid4().hex[:12]


class DirectoryLock:
    """An exclusive ``flock`` on ``root/.lock`` (created with ``root``), which holds the holder's PID
    and host; CheckpointError naming them when another process holds it. ``release()`` removes the
    file; the kernel releases the lock when the process ends, however it ends (the file then stays,
    unlocked, and the next run takes it)."""

    def __init__(self, root: str | os.PathLike) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.path, self._fd = root / LOCK_FILE, None
        # NOTE: a holder removes the file as it releases it; a lock won on a removed file is void,
        # so lock, then check that the file locked is still the one at the path
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 256).decode(errors="replace").split()
                os.close(fd)
                pid, host = (holder + ["unknown", "unknown"])[:2]
                raise CheckpointError(f"--checkpoint-dir {root} is in use by another run (PID {pid} on host "
                                      f"{host}); one run per checkpoint directory: wait for it to end or give "
                                      "another --checkpoint-dir") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                # NOTE: a file system without locks: run unlocked rather than not at all
                log.warning("--checkpoint-dir %s cannot be locked (%s): make sure no other run uses it", root, e)
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise CheckpointError(f"--checkpoint-dir {root}: could not lock {self.path} (other runs keep "
                                  "replacing it)")
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())

    def release(self) -> None:
        """Remove the lock file and give the lock up; safe to call twice."""
        if self._fd is not None:
            try:
                self.path.unlink()  # while still locked: whoever opened it before finds it gone
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def open_run_directory(root: str | os.PathLike, *, resume: bool, overwrite: bool) -> tuple[DirectoryLock, Path | None]:
    """Lock ``root`` for a run and return ``(lock, checkpoint to resume from or None)``.

    A fresh run is refused where checkpoints are, unless ``overwrite`` (then their deletion, after
    this run's first checkpoint, is announced). ``resume`` takes the newest valid checkpoint,
    moving damaged newer ones aside. CheckpointError for a refusal, a held lock, or nothing to resume.
    """
    root = Path(root)
    lock = DirectoryLock(root)
    try:
        found = checkpoint_steps(root)
        if resume:
            if not found:
                raise CheckpointError(f"--resume: no checkpoint in {root}")
            reasons = []
            path = next(iter(valid_checkpoints(root, move_damaged=True, reasons=reasons)), None)
            if path is None:
                more = f" (and {len(reasons) - 1} older: see the warnings above)" if len(reasons) > 1 else ""
                raise CheckpointError(f"--resume: no valid checkpoint in {root}: {reasons[0]}{more}")
            return lock, path
        if found:
            step, newest = found[-1]
            try:
                model = describe_model(_manifest_json(newest).get("model") or {})
            except CheckpointError:
                model = "its manifest unreadable"
            if not overwrite:
                raise CheckpointError(f"--checkpoint-dir {root} already holds checkpoints (newest: step {step}, "
                                      f"{model}); add --resume to continue that run, give another "
                                      "--checkpoint-dir, or add --overwrite to replace them")
            log.warning("--overwrite: the %d checkpoint(s) in %s (newest: step %d, %s) are deleted once this "
                        "run's first checkpoint is written", len(found), root, step, model)
        return lock, None
    except BaseException:
        lock.release()
        raise


def open_run_directory_on_rank_0(root: str | os.PathLike, *, resume: bool, overwrite: bool, rank: int,
                                 shared: bool) -> tuple[DirectoryLock | None, Path | None]:
    """``open_run_directory`` for a run of one or several processes (``shared``: torch.distributed
    is initialized): rank 0 locks, refuses or picks the checkpoint, and the others take its answer,
    so every rank raises, or goes on, together. Returns ``(lock, checkpoint to resume from or
    None)``; the lock is rank 0's (None elsewhere)."""
    lock, answer, error = None, None, None
    if rank == 0:
        try:
            lock, path = open_run_directory(root, resume=resume, overwrite=overwrite)
            answer = ("resume", str(path) if path is not None else None)
        except Exception as e:  # NOTE: whatever it is, the other ranks must hear of it, not wait
            answer, error = ("error", str(e)), e
    if shared:
        import torch.distributed as dist

        box = [answer]
        dist.broadcast_object_list(box, src=0)
        answer = box[0]
    if answer[0] == "error":
        raise error or CheckpointError(answer[1])
    return lock, Path(answer[1]) if answer[1] is not None else None


def prune_checkpoints(root: str | os.PathLike, *, keep: int, lineage: list[str], written: str | os.PathLike,
                      overwrite: bool = False) -> list[Path]:
    """Delete the checkpoints under ``root`` beyond the newest ``keep`` of this run's ``lineage``
    (run ids); never ``written`` (the checkpoint just saved, counted in ``keep``), never another run's
    unless ``overwrite`` or the lineage's first run had it (``mark_run``; then all of those). Returns
    the directories deleted (one that could not be is named in a warning instead)."""
    written, ours, others = Path(written), [], []
    for _, path in checkpoint_steps(root):
        if path == written:
            continue
        (ours if _writer(path) in lineage else others).append(path)
    marker = _directory_run(Path(root))
    overwrite = overwrite or (marker.get("run") == lineage[0] and marker.get("overwrite") is True)
    doomed, deleted = ours[:max(len(ours) - (keep - 1), 0)] + (others if overwrite else []), []
    for path in doomed:
        # NOTE: renamed first (atomic), so a kill mid-delete leaves a .tmp-* that the next save
        # removes, never half a checkpoint that no manifest names any more
        gone = path.with_name(f".tmp-pruned-{path.name}-{os.getpid()}")
        try:
            path.rename(gone)
        except OSError as e:
            log.warning("could not delete old checkpoint %s: %s", path, e)
            continue
        deleted.append(path)
        shutil.rmtree(gone, ignore_errors=True)
    if overwrite and others:
        log.warning("--overwrite: deleted %d earlier checkpoint(s) in %s (%s)", len(others), root,
                    ", ".join(p.name for p in others))
    return deleted
