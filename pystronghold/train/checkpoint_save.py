"""Writing a checkpoint: streamed block by block from the store, atomic, checksummed.

``save_checkpoint(state, root, record)`` writes ``state``'s objects (``checkpoint_state.run_state``)
as ``root/step-NNNNNNNN``: one safetensors file per block and ``head_tail.safetensors`` from
``state["model"]``, ``state.pt`` from the others' ``state_dict()``, then ``manifest.json``. Writing
goes into a ``.tmp-step-...`` directory renamed when complete, so a crash leaves the previous
checkpoints intact.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from pystronghold.parallel.data import is_pipeline_copy
from pystronghold.parallel.layers import gather_tp_tensor
from pystronghold.runtime.optimizer.divergence import check_finite_state
from pystronghold.train.checkpoint_dir import FORMAT, VERSION, block_file, checkpoint_name, mark_run
from pystronghold.train.checkpoint_files import BLOCK_STATES, STATE_KEYS, fsync_dir, model_record, tp_split, write_file
from pystronghold.train.checkpoint_state import RunRecord, StreamedModel

__all__ = ["CheckpointWriteError", "SaveInterrupted", "save_checkpoint"]

log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, an I/O error): the message names the
    step, the file, and whether its partial save was removed; ``errno`` is the cause's."""


class SaveInterrupted(KeyboardInterrupt):
    """A save stopped by KeyboardInterrupt (a second Ctrl-C): ``str()`` is one line naming the step
    and what became of its partial save (removed, or the path left)."""


def save_checkpoint(state: dict, root: str | os.PathLike, record: RunRecord, *, _after_file=None) -> Path | None:
    """Write ``state`` (``checkpoint_state.run_state``'s objects) at ``record.step`` as
    ``root/step-NNNNNNNN`` (atomically). Deletes nothing but stale ``.tmp-*`` saves: which older
    checkpoints go is ``checkpoint_dir.prune_checkpoints``'s.

    In a run of several processes every rank calls it: with tensor parallelism the TP ranks of DP
    replica 0 gather each split tensor (a collective, one block at a time); global rank 0 alone
    writes and gets the directory, every other rank gets None. CheckpointWriteError when a write
    fails, SaveInterrupted on a KeyboardInterrupt; either way the partial save is removed first.
    ``_after_file(name)`` is a test hook called after each file is written.
    """
    state["engine"].synchronize()  # every host update (forward-overlap ones too) has landed in the store
    model: StreamedModel = state["model"]
    groups, step = model.groups, record.step
    if groups is not None and groups.dp_rank != 0:
        return None  # NOTE: DP replicas hold identical state; replica 0 (with global rank 0) saves it
    writer = groups is None or groups.rank == 0
    root = Path(root)
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        if writer:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a killed save (one run per directory: not a live one)
                stale.unlink() if stale.is_file() else shutil.rmtree(stale, ignore_errors=True)
            (tmp / "blocks").mkdir(parents=True)
        files = _write_tensors(model, step, tmp if writer else None, _after_file)
        if not writer:
            return None
        final = _write_manifest(state, record, root, tmp, name, files)
    except (FloatingPointError, OSError, KeyboardInterrupt) as e:  # inf/NaN state, a failed write, Ctrl-C
        left = _remove_partial(tmp) if writer else "its partial save is rank 0's"
        if isinstance(e, KeyboardInterrupt):
            raise SaveInterrupted(f"interrupted again while writing the checkpoint of step {step}: "
                                  f"not written, {left}") from e
        if not isinstance(e, OSError):
            raise
        error = CheckpointWriteError(f"checkpoint of step {step} not written: {e.strerror or e} "
                                     f"({e.filename or tmp}); {left}")
        error.errno = e.errno
        raise error from e
    log.info("checkpoint: step %d written to %s", step, final)
    return final


def _remove_partial(tmp: Path) -> str:
    """Remove the partial save ``tmp`` (NOTE: on a full disk it is what fills it); says what became of it."""
    if not tmp.exists():
        return "nothing of it was written"
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():  # a read-only file system, say
        return f"its partial save {tmp} is left (remove it by hand)"
    return "its partial save was removed"


def _write_tensors(model: StreamedModel, step: int, tmp: Path | None, after_file) -> dict[str, dict]:
    """Gather and (into ``tmp``, on the writing rank) write every block file and the head/tail
    file; returns ``{file: sha256 and size}`` of what this rank wrote."""
    states, tp_group, pipe = model.states, model.tp_group, model.pipeline
    files: dict[str, dict] = {}

    def write(rel: str, tensors: dict[str, torch.Tensor]) -> None:
        if tmp is not None:
            check_finite_state(tensors, step=step, where=f"checkpoint {checkpoint_name(step)} ({rel})")
            files[rel] = write_file(tmp / rel, st_save(tensors))
            if after_file is not None:
                after_file(rel)

    local = {g: b for b, g in enumerate(model.block_indices)}

    def saved(param) -> bool:
        return param.requires_grad or not model.leaves_frozen
    # NOTE: the format is keyed by full model names. Every TP rank walks the same blocks, states and
    # parameters in the same order, so the gathers match; a gathered block is written and dropped
    # before the next one is read (states reads one block, from disk if it is there). With
    # pipeline stages, the stage holding block g sends it to the others (rank 0 writes it).
    for g in range(model.blocks):
        b, tensors = local.get(g), None
        if b is not None:
            params = dict(zip(states.block_names[b], states.block_params(b)))
            values = states.read_block(b, [tier for tier, _ in BLOCK_STATES])
            tensors = {}
            for tier, suffix in BLOCK_STATES:
                for n, value in values[tier].items():  # a frozen parameter: its value, no moments
                    if saved(params[n]):
                        tensors[model.model_name(n) + suffix] = gather_tp_tensor(value, tp_split(params[n]), tp_group)
            del values
        if pipe is not None:
            tensors = pipe.share_from(pipe.stage_of_block(g), tensors)
        write(block_file(g), tensors)
    tensors = {}
    for n, p, m, st in states.head_tail():
        if is_pipeline_copy(p) or not saved(p):
            continue  # a pipeline's copy of a tied weight (saved under the original's name), or left to the base
        split = tp_split(p)  # a fp16/bf16 run's master is a copy: p has the split
        n = model.model_name(n)
        tensors[n] = gather_tp_tensor(m.float(), split, tp_group).cpu()
        if st:
            tensors[n + ".exp_avg"] = gather_tp_tensor(st["exp_avg"].detach(), split, tp_group).cpu()
            tensors[n + ".exp_avg_sq"] = gather_tp_tensor(st["exp_avg_sq"].detach(), split, tp_group).cpu()
            tensors[n + ".step"] = torch.as_tensor(st["step"]).detach().float().cpu().reshape(1)
    if pipe is not None:  # head on the first stage, tail on the last
        tensors = {k: v for stage in range(pipe.groups.pp_size) for k, v in pipe.share_from(stage, tensors).items()}
    write("head_tail.safetensors", tensors)
    return files


def _write_manifest(state: dict, record: RunRecord, root: Path, tmp: Path, name: str, files: dict[str, dict]) -> Path:
    """Write ``state.pt`` and the manifest into ``tmp``, fsync, and rename it to ``root/name``."""
    buf = io.BytesIO()
    torch.save({"step": record.step, **{key: state[k].state_dict() for k, key in STATE_KEYS.items()}}, buf)
    files["state.pt"] = write_file(tmp / "state.pt", buf.getvalue())
    model: StreamedModel = state["model"]
    manifest = {"format": FORMAT, "version": VERSION, "step": record.step,
                "model": model_record(record.model), "blocks": model.blocks,
                "precision": record.precision, "lineage": list(record.lineage),
                "written_by": model.layout(), **record.finetune(), "files": files}
    write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp / "blocks")
    fsync_dir(tmp)
    # NOTE: before the rename that makes it count: from then on a resume takes this lineage only,
    # even where an --overwrite run is killed before it deleted its predecessor's checkpoints
    mark_run(root, list(record.lineage), overwrite=record.overwrite)
    final = root / name
    if final.exists():  # the same step saved again (e.g. a resumed run's end): replace it
        old = root / f".tmp-old-{name}-{os.getpid()}"
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    fsync_dir(root)
    return final

