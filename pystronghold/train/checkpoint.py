"""Checkpoints of a training run: streamed block by block, atomic, checksummed, window-independent.

A checkpoint ``<dir>/step-00000100/`` holds one safetensors file per block (fp32 masters and AdamW
moments by full parameter name), ``head_tail.safetensors``, ``state.pt`` (step, schedule, RNG,
data position, ``engine.state_dict()``) and ``manifest.json`` (config, lineage, sha256 of every
file). It does not depend on the window size or the PP x TP x DP layout that wrote it. Writing
goes into a ``.tmp-step-...`` directory renamed when complete, so a crash leaves the previous
checkpoints intact; loading verifies every checksum before changing anything and raises
``CheckpointError`` (one line). Directory naming and locking are ``checkpoint_dir.py``'s, which
checkpoint a resume takes and what it does with the options given again ``resume.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load as st_load, save as st_save

from pystronghold.models.hf import HFModelConfig
from pystronghold.models.lora import GPT_ARCHITECTURE, LoraSpec, merged_state_dict
from pystronghold.parallel.data import is_pipeline_copy, tied_source
from pystronghold.parallel.layers import gather_tp_tensor, tp_slice
from pystronghold.runtime.divergence import check_finite_state, nonfinite_entry
from pystronghold.train.checkpoint_dir import (FORMAT, VERSION, CheckpointError, UnusableCheckpoint, block_file,
                                               checkpoint_name, mark_run, read_manifest)
from pystronghold.train.finetune import check_base, check_checkpoint_record, checkpoint_record

__all__ = ["CheckpointError", "CheckpointWriteError", "SaveInterrupted", "save_checkpoint", "load_checkpoint",
           "read_manifest", "checkpoint_weights", "export_weights", "save_safetensors"]

log = logging.getLogger(__name__)

_BLOCK_STATES = (("master", ""), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq"))


def _write(path: Path, data: bytes) -> dict:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        e.filename = e.filename or str(path)  # a failed write or fsync names no file
        raise
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _split(param: torch.Tensor) -> tuple[int, int, int]:
    """``(dim, rank, size)`` of a tensor-parallel parameter; ``(0, 0, 1)`` for a whole one."""
    return getattr(param, "tp_split", (0, 0, 1))


def _tp_group(trainer):
    """The TP group of a run with tensor parallelism, else None (nothing is split)."""
    groups = trainer.groups
    return groups.tp_group if groups is not None and groups.tp_size > 1 else None


def _pipeline(trainer):
    """(pipeline or None, the global index of each of this rank's blocks in the engine's order,
    local -> model name)."""
    pipe = getattr(trainer, "pipeline", None)
    if pipe is None:
        return None, list(range(len(trainer.engine.states.block_names))), lambda name: name
    return pipe, pipe.block_indices, pipe.global_name


def _model_dict(config) -> dict:
    """The model config as the manifest keeps it: ``tp_size`` 1 (the format holds whole tensors)."""
    return dataclasses.asdict(dataclasses.replace(config, tp_size=1))


# ---- save

class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, an I/O error): the message names the
    step, the file, and whether its partial save was removed; ``errno`` is the cause's."""


class SaveInterrupted(KeyboardInterrupt):
    """A save stopped by KeyboardInterrupt (a second Ctrl-C): ``str()`` is one line naming the step
    and what became of its partial save (removed, or the path left)."""


def save_checkpoint(trainer, root: str | os.PathLike, *, _after_file=None) -> Path | None:
    """Write ``trainer``'s state as ``root/step-NNNNNNNN`` (atomically). Deletes nothing but stale
    ``.tmp-*`` saves: which older checkpoints go is ``checkpoint_dir.prune_checkpoints``'s.

    In a run of several processes every rank calls it: with tensor parallelism the TP ranks of DP
    replica 0 gather each split tensor (a collective, one block at a time); global rank 0 alone
    writes and gets the directory, every other rank gets None. CheckpointWriteError when a write
    fails, SaveInterrupted on a KeyboardInterrupt; either way the partial save is removed first.
    ``_after_file(name)`` is a test hook called after each file is written.
    """
    trainer.engine.synchronize()  # every host update (forward-overlap ones too) has landed in the store
    groups = trainer.groups
    if groups is not None and groups.dp_rank != 0:
        return None  # NOTE: DP replicas hold identical state; replica 0 (with global rank 0) saves it
    writer = groups is None or groups.rank == 0
    root = Path(root)
    name = checkpoint_name(trainer.step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        if writer:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a killed save (one run per directory: not a live one)
                stale.unlink() if stale.is_file() else shutil.rmtree(stale, ignore_errors=True)
            (tmp / "blocks").mkdir(parents=True)
        files = _write_tensors(trainer, tmp if writer else None, _after_file)
        if not writer:
            return None
        final = _write_manifest(trainer, root, tmp, name, files)
    except (FloatingPointError, OSError, KeyboardInterrupt) as e:  # inf/NaN state, a failed write, Ctrl-C
        left = _remove_partial(tmp) if writer else "its partial save is rank 0's"
        if isinstance(e, KeyboardInterrupt):
            raise SaveInterrupted(f"interrupted again while writing the checkpoint of step {trainer.step}: "
                                  f"not written, {left}") from e
        if not isinstance(e, OSError):
            raise
        error = CheckpointWriteError(f"checkpoint of step {trainer.step} not written: {e.strerror or e} "
                                     f"({e.filename or tmp}); {left}")
        error.errno = e.errno
        raise error from e
    log.info("checkpoint: step %d written to %s", trainer.step, final)
    return final


def _remove_partial(tmp: Path) -> str:
    """Remove the partial save ``tmp`` (NOTE: on a full disk it is what fills it); says what became of it."""
    if not tmp.exists():
        return "nothing of it was written"
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():  # a read-only file system, say
        return f"its partial save {tmp} is left (remove it by hand)"
    return "its partial save was removed"


def _write_tensors(trainer, tmp: Path | None, after_file) -> dict[str, dict]:
    """Gather and (into ``tmp``, on the writing rank) write every block file and the head/tail
    file; returns ``{file: sha256 and size}`` of what this rank wrote."""
    states = trainer.engine.states
    tp_group = _tp_group(trainer)
    files: dict[str, dict] = {}

    def write(rel: str, tensors: dict[str, torch.Tensor]) -> None:
        if tmp is not None:
            check_finite_state(tensors, step=trainer.step, where=f"checkpoint {checkpoint_name(trainer.step)} ({rel})")
            files[rel] = _write(tmp / rel, st_save(tensors))
            if after_file is not None:
                after_file(rel)

    pipe, indices, rename = _pipeline(trainer)
    local = {g: b for b, g in enumerate(indices)}
    leaves_frozen = _leaves_frozen(trainer)

    def saved(param) -> bool:
        return param.requires_grad or not leaves_frozen
    # NOTE: the format is keyed by full model names. Every TP rank walks the same blocks, states and
    # parameters in the same order, so the gathers match; a gathered block is written and dropped
    # before the next one is read (engine.states reads one block, from disk if it is there). With
    # pipeline stages, the stage holding block g sends it to the others (rank 0 writes it).
    for g in range(_block_count(trainer)):
        b, tensors = local.get(g), None
        if b is not None:
            params = dict(zip(states.block_names[b], states.block_params(b)))
            values = states.read_block(b, [tier for tier, _ in _BLOCK_STATES])
            tensors = {}
            for tier, suffix in _BLOCK_STATES:
                for n, value in values[tier].items():  # a frozen parameter: its value, no moments
                    if saved(params[n]):
                        tensors[rename(n) + suffix] = gather_tp_tensor(value, _split(params[n]), tp_group)
            del values
        if pipe is not None:
            tensors = pipe.share_from(pipe.stage_of_block(g), tensors)
        write(block_file(g), tensors)
    tensors = {}
    for n, p, m, st in states.head_tail():
        if is_pipeline_copy(p) or not saved(p):
            continue  # a pipeline's copy of a tied weight (saved under the original's name), or left to the base
        split = _split(p)  # a fp16/bf16 run's master is a copy: p has the split
        n = rename(n)
        tensors[n] = gather_tp_tensor(m.float(), split, tp_group).cpu()
        if st:
            tensors[n + ".exp_avg"] = gather_tp_tensor(st["exp_avg"].detach(), split, tp_group).cpu()
            tensors[n + ".exp_avg_sq"] = gather_tp_tensor(st["exp_avg_sq"].detach(), split, tp_group).cpu()
            tensors[n + ".step"] = torch.as_tensor(st["step"]).detach().float().cpu().reshape(1)
    if pipe is not None:  # head on the first stage, tail on the last
        tensors = {k: v for stage in range(pipe.groups.pp_size) for k, v in pipe.share_from(stage, tensors).items()}
    write("head_tail.safetensors", tensors)
    return files


def _leaves_frozen(trainer) -> bool:
    """Whether the checkpoint leaves the frozen parameters out: a ``--model hf:DIR`` run, whose
    frozen parameters DIR gives back on resume."""
    return isinstance(trainer.config.gpt, HFModelConfig)


def _finetune_record(trainer) -> dict:
    """The manifest's ``finetune`` and (when frozen parameters are left to the base) ``base``."""
    config = trainer.config
    partial = any(not p.requires_grad for p in trainer.engine.model.parameters())
    base = config.gpt.source if partial and _leaves_frozen(trainer) else None
    return checkpoint_record(config.finetune.freeze, getattr(trainer, "lora", None), base)


def _block_count(trainer) -> int:
    """Blocks of the whole model (a pipeline stage holds only some)."""
    if _pipeline(trainer)[0] is not None:
        return trainer.config.gpt.layers
    return len(trainer.engine.states.block_names)


def _write_manifest(trainer, root: Path, tmp: Path, name: str, files: dict[str, dict]) -> Path:
    """Write ``state.pt`` and the manifest into ``tmp``, fsync, and rename it to ``root/name``."""
    engine, groups = trainer.engine, trainer.groups
    buf = io.BytesIO()
    torch.save({"step": trainer.step, "engine": engine.state_dict(),
                "scheduler": trainer.scheduler.state_dict(), "hyper": engine.optimizer.group_settings(),
                "sampler": trainer.sampler.state_dict(), "rng": _rng_state()}, buf)
    files["state.pt"] = _write(tmp / "state.pt", buf.getvalue())
    manifest = {"format": FORMAT, "version": VERSION, "step": trainer.step,
                "model": _model_dict(trainer.config.gpt), "blocks": _block_count(trainer),
                "precision": trainer.config.runtime.precision, "lineage": list(trainer.lineage),
                "written_by": {"tp": groups.tp_size if groups else 1, "dp": groups.dp_size if groups else 1,
                               "pp": groups.pp_size if groups else 1},
                **_finetune_record(trainer), "files": files}
    _write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp / "blocks")
    _fsync_dir(tmp)
    # NOTE: before the rename that makes it count: from then on a resume takes this lineage only,
    # even where an --overwrite run is killed before it deleted its predecessor's checkpoints
    mark_run(root, trainer.lineage, overwrite=trainer.config.checkpoint.overwrite)
    final = root / name
    if final.exists():  # the same step saved again (e.g. a resumed run's end): replace it
        old = root / f".tmp-old-{name}-{os.getpid()}"
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    _fsync_dir(root)
    return final


# ---- load

def _load_file(path: Path, rel: str, meta: dict) -> dict[str, torch.Tensor]:
    data = (path / rel).read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:  # changed since it was verified
        raise CheckpointError(f"checkpoint {path}: {rel} is corrupt (sha256 mismatch)")
    return st_load(data)


def _load_finite(path: Path, rel: str, meta: dict) -> dict[str, torch.Tensor]:
    """``_load_file``, refusing (UnusableCheckpoint) values or moments that hold inf/NaN: whole
    checksums, yet no run can continue from them (they were written so)."""
    tensors = _load_file(path, rel, meta)
    bad = nonfinite_entry(tensors)
    if bad is not None:
        raise UnusableCheckpoint(f"checkpoint {path}: {rel}: {bad}")
    return tensors


def _mine(saved: dict[str, torch.Tensor], key: str, param: torch.Tensor, shape, path: Path) -> torch.Tensor:
    """This rank's part of the whole tensor ``saved[key]`` (the slice ``param.tp_split`` names), checked
    against the ``shape`` it must have. A contiguous copy: the store and Adam want dense tensors."""
    try:
        full = saved[key]
    except KeyError:
        raise CheckpointError(f"checkpoint {path}: {key} is missing") from None
    try:
        part = tp_slice(full, _split(param))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {key}: {e}") from None
    if part.shape != torch.Size(shape):
        raise CheckpointError(f"checkpoint {path}: {key} has shape {tuple(full.shape)}, this run expects "
                              f"{tuple(shape)} per rank (split {_split(param)})")
    return part.contiguous()


def _model_difference(saved: dict, mine: dict, most: int = 3) -> str:
    """The first ``most`` model settings that differ, one line: ``hidden 32 (this run 64), ...``
    (a Hugging Face config's keys as ``config.KEY``)."""

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    saved, mine = flat(saved), flat(mine)
    keys = [k for k in {**saved, **mine} if saved.get(k) != mine.get(k)]
    text = ", ".join(f"{k} {saved.get(k, '(none)')} (this run {mine.get(k, '(none)')})" for k in keys[:most])
    return text + (f" and {len(keys) - most} more" if len(keys) > most else "")


@torch.no_grad()
def load_checkpoint(trainer, path: str | os.PathLike) -> None:
    """Restore ``trainer`` (model, optimizer states, step, schedule, RNG, data position, scaler).

    Every rank of a run with several processes calls it and reads the files itself; a rank of a
    tensor-parallel run keeps its slice of each split tensor (any TP size may have written them).
    UnusableCheckpoint for one made for another model or block count (before anything changes) or
    holding inf/NaN values or moments (found as each file is read: load another one after it).
    """
    path = Path(path)
    manifest = read_manifest(path)
    mine, saved_model = _model_dict(trainer.config.gpt), dict(manifest["model"], tp_size=1)
    if saved_model != mine:
        raise UnusableCheckpoint(f"checkpoint {path} was made for another model: "
                                 f"{_model_difference(saved_model, mine)}")
    if manifest["blocks"] != _block_count(trainer):
        raise UnusableCheckpoint(f"checkpoint {path} holds {manifest['blocks']} blocks, this run's model "
                                 f"{_block_count(trainer)}")
    # NOTE: the base first: it trusts the manifest's crc32c of unchanged files, so the record
    # computed next for this run hashes nothing again
    check_base(manifest, path, "resume")
    check_checkpoint_record(manifest, _finetune_record(trainer), path)
    engine = trainer.engine
    states = engine.states
    _, indices, rename = _pipeline(trainer)
    # NOTE: a frozen parameter the checkpoint left to the base directory keeps its value, read from
    # there when this run was built
    left = manifest.get("base") is not None
    for b, names in enumerate(states.block_names):
        rel = block_file(indices[b])  # a pipeline stage reads its own blocks
        if rel not in manifest["files"]:
            raise CheckpointError(f"checkpoint {path}: {rel} is missing (it has {manifest.get('blocks')} blocks)")
        saved = _load_finite(path, rel, manifest["files"][rel])
        params, shapes, trains = states.block_params(b), states.block_shapes(b), states.block_trainable(b)
        current = states.read_block(b, ("master",))["master"] if left and not all(trains) else {}
        masters = [current[n] if left and not t else _mine(saved, rename(n), p, shape, path)
                   for n, p, shape, t in zip(names, params, shapes, trains)]
        states.write_block(b, {"master": masters, **{
            tier: [_mine(saved, rename(n) + suffix, p, shape, path)
                   for n, p, shape, t in zip(names, params, shapes, trains) if t]
            for tier, suffix in _BLOCK_STATES if tier != "master"}})
    saved = _load_finite(path, "head_tail.safetensors", manifest["files"]["head_tail.safetensors"])
    for i, (n, p, m, _) in enumerate(states.head_tail()):
        if left and not p.requires_grad:
            continue
        n = tied_source(p) or rename(n)  # a pipeline's copy of a tied weight: the original's values
        state = None
        if n + ".exp_avg" in saved:
            state = {"step": torch.tensor(float(saved[n + ".step"][0])),
                     "exp_avg": _mine(saved, n + ".exp_avg", p, m.shape, path),
                     "exp_avg_sq": _mine(saved, n + ".exp_avg_sq", p, m.shape, path)}
        states.write_head_tail(i, master=_mine(saved, n, p, m.shape, path), state=state)
    data = (path / "state.pt").read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["files"]["state.pt"]["sha256"]:
        raise CheckpointError(f"checkpoint {path}: state.pt is corrupt (sha256 mismatch)")
    state = torch.load(io.BytesIO(data), weights_only=False)
    trainer.step = state["step"]
    # NOTE: this run continues the loaded one's lineage (absent before lineages: it starts here)
    before = manifest.get("lineage")
    trainer.lineage = [*(before if isinstance(before, list) else []), trainer.lineage[-1]]
    try:
        engine.load_state_dict(_engine_state(state, engine.n_blocks))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    trainer.scheduler.load_state_dict(state["scheduler"])
    hyper = [state["hyper"]] if isinstance(state["hyper"], dict) else state["hyper"]  # one group before 0.1.1
    groups = engine.optimizer.param_groups
    if len(hyper) != len(groups):
        raise CheckpointError(f"checkpoint {path}: it has {len(hyper)} optimizer param group(s), this run "
                              f"{len(groups)} (--decay decides them)")
    for group, h in zip(groups, hyper):
        group.update(h)
    try:
        trainer.sampler.load_state_dict(state["sampler"])
    except ValueError as e:
        differs = _data_difference(state["sampler"], trainer.sampler.state_dict())
        raise CheckpointError(f"checkpoint {path} was made with other data settings: {differs}; a resumed run "
                              "keeps its batch, sequence length and data" if differs else
                              f"checkpoint {path}: its data position does not fit this run's data ({e})") from None
    _set_rng_state(state["rng"])


def _data_difference(saved: dict, mine: dict) -> str:
    """The data settings of a saved data position (``BatchSampler.state_dict``) that differ from this
    run's, named as options: ``--batch 4 (this run 8)``."""
    flags = {"batch": "--batch", "seq": "--seq", "data_bytes": "training bytes (--data, --max-bytes)"}
    return ", ".join(f"{flag} {saved.get(k)} (this run {mine[k]})" for k, flag in flags.items()
                     if saved.get(k) != mine[k])


def _engine_state(state: dict, n_blocks: int) -> dict:
    """The ``engine.state_dict()`` saved in ``state`` (``state.pt``) for an engine of ``n_blocks``
    blocks. A checkpoint written before the engine had a state dict keeps its values under keys of
    their own, without ``block_steps`` before layer drop (every block at the engine's count) and
    ``layer_drop`` before that too (this run's seed then starts the draws)."""
    engine = state.get("engine")
    if engine is None:
        engine = {"steps": state["engine_steps"], "skipped_steps": state["skipped_steps"],
                  "block_steps": state.get("block_steps", ()), "loss_scaler": state["scaler"],
                  "layer_drop": state.get("layer_drop")}
    # NOTE: rank 0 writes the counts of its own blocks; a pipeline stage of another size takes the
    # engine's count for each of its blocks when every block was at it (no layer drop)
    if all(c == engine["steps"] for c in engine["block_steps"]):
        engine = dict(engine, block_steps=[engine["steps"]] * n_blocks)
    return engine


# ---- export

def checkpoint_weights(path: str | os.PathLike, manifest: dict):
    """The fp32 weights of checkpoint ``path`` (its ``manifest``, from ``read_manifest``), one file at
    a time: yields ``{model parameter name: tensor}`` per block file, then the head/tail file
    (optimizer moments left out; a frozen parameter, kept in the compute dtype, cast to fp32), so a
    caller holds one block's weights at a time."""
    path = Path(path)
    for rel, meta in manifest["files"].items():
        if rel.endswith(".safetensors"):
            yield {k: v.float() for k, v in _load_file(path, rel, meta).items()
                   if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))}


def export_weights(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write checkpoint ``path``'s fp32 weights as one plain safetensors state dict (``GPT.state_dict()``
    keys; tied weights under both names; a GPT's LoRA adapters merged into their weights) with the
    model config as JSON metadata; or a ``torch.save`` state dict when ``out`` ends in ``.pt``.
    Loadable with ``GPT(GPTConfig(**config))`` and ``load_state_dict`` without pystronghold's
    runtime. Returns ``out``."""
    path, out = Path(path), Path(out)
    manifest = read_manifest(path)
    weights: dict[str, torch.Tensor] = {}
    for part in checkpoint_weights(path, manifest):
        weights.update(part)
    lora = (manifest.get("finetune") or {}).get("lora")
    if lora and manifest.get("base") is None:  # the checkpoint holds the frozen base too: a GPT's
        weights = merged_state_dict(weights, LoraSpec.from_record(lora), GPT_ARCHITECTURE)
    if manifest["model"].get("tie_embeddings") and "tail.lm_head.weight" not in weights:
        weights["tail.lm_head.weight"] = weights["head.tok.weight"].clone()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".pt":
        torch.save({"config": manifest["model"], "state_dict": weights}, out)
    else:
        save_safetensors(weights, out, metadata={"config": json.dumps(manifest["model"]),
                                                 "step": str(manifest["step"])})
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, leaving ``path`` with the permissions of any new file (the
    umask's: 0644 under 022) rather than save_file's 0600 (it writes a private temporary file)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0o077)  # NOTE: read by setting it; the strictest meanwhile, for other threads' files
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
