"""Loading a checkpoint into a run's state objects (``checkpoint_state.run_state``).

Every checksum is verified (``checkpoint_dir.read_manifest``) and the model and block count
compared before anything changes; ``CheckpointError`` (one line) names what is wrong, and
``UnusableCheckpoint`` a whole checkpoint this run cannot continue from (a resume tries an older one).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pystronghold.parallel.data import tied_source
from pystronghold.parallel.layers import tp_slice
from pystronghold.train.checkpoint_dir import CheckpointError, UnusableCheckpoint, block_file, read_manifest
from pystronghold.train.checkpoint_files import (BLOCK_STATES, STATE_KEYS, model_record, read_finite_tensors,
                                                 read_state, tp_split)
from pystronghold.train.checkpoint_finetune import check_base, check_checkpoint_record
from pystronghold.train.checkpoint_state import RunRecord, StreamedModel

__all__ = ["load_checkpoint"]


@torch.no_grad()
def load_checkpoint(state: dict, path: str | os.PathLike, record: RunRecord) -> tuple[int, list[str]]:
    """Load checkpoint ``path`` into ``state`` (``checkpoint_state.run_state``'s objects: model
    values and optimizer moments, engine counts and loss scale, schedule, data position, RNG) for
    the run ``record`` describes. Returns ``(step, lineage)``: the checkpoint's step, and the run
    ids this run now continues (the checkpoint's, then ``record.lineage[-1]``).

    Every rank of a run with several processes calls it and reads the files itself; a rank of a
    tensor-parallel run keeps its slice of each split tensor (any TP size may have written them).
    UnusableCheckpoint for one made for another model or block count (before anything changes) or
    holding inf/NaN values or moments (found as each file is read: load another one after it).
    """
    path = Path(path)
    model: StreamedModel = state["model"]
    manifest = read_manifest(path)
    mine, saved_model = model_record(record.model), dict(manifest["model"], tp_size=1)
    if saved_model != mine:
        raise UnusableCheckpoint(f"checkpoint {path} was made for another model: "
                                 f"{_model_difference(saved_model, mine)}")
    if manifest["blocks"] != model.blocks:
        raise UnusableCheckpoint(f"checkpoint {path} holds {manifest['blocks']} blocks, this run's model "
                                 f"{model.blocks}")
    # NOTE: the base first: it trusts the manifest's crc32c of unchanged files, so the record
    # computed next for this run hashes nothing again
    check_base(manifest, path, "resume")
    check_checkpoint_record(manifest, record.finetune(), path)
    _load_tensors(model, path, manifest)
    saved = read_state(path, manifest)
    # NOTE: this run continues the loaded one's lineage (absent before lineages: it starts here)
    before = manifest.get("lineage")
    lineage = [*(before if isinstance(before, list) else []), record.lineage[-1]]
    for name, key in STATE_KEYS.items():
        _load_one(state, name, _engine_state(saved, state["engine"].n_blocks) if name == "engine" else saved[key],
                  path)
    return saved["step"], lineage


def _load_one(state: dict, name: str, saved, path: Path) -> None:
    """``state[name].load_state_dict(saved)``, its ValueError said in one CheckpointError."""
    try:
        state[name].load_state_dict(saved)
    except ValueError as e:
        if name != "sampler":
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        differs = _data_difference(saved, state[name].state_dict())
        raise CheckpointError(f"checkpoint {path} was made with other data settings: {differs}; a resumed run "
                              "keeps its batch, sequence length and data" if differs else
                              f"checkpoint {path}: its data position does not fit this run's data ({e})") from None


def _load_tensors(model: StreamedModel, path: Path, manifest: dict) -> None:
    """Write the checkpoint's masters and moments into the store, one block at a time."""
    states = model.states
    indices = model.block_indices
    # NOTE: a frozen parameter the checkpoint left to the base directory keeps its value, read from
    # there when this run was built
    left = manifest.get("base") is not None
    for b, names in enumerate(states.block_names):
        rel = block_file(indices[b])  # a pipeline stage reads its own blocks
        if rel not in manifest["files"]:
            raise CheckpointError(f"checkpoint {path}: {rel} is missing (it has {manifest.get('blocks')} blocks)")
        saved = read_finite_tensors(path, rel, manifest["files"][rel])
        params, shapes, trains = states.block_params(b), states.block_shapes(b), states.block_trainable(b)
        current = states.read_block(b, ("master",))["master"] if left and not all(trains) else {}
        masters = [current[n] if left and not t else _mine(saved, model.model_name(n), p, shape, path)
                   for n, p, shape, t in zip(names, params, shapes, trains)]
        states.write_block(b, {"master": masters, **{
            tier: [_mine(saved, model.model_name(n) + suffix, p, shape, path)
                   for n, p, shape, t in zip(names, params, shapes, trains) if t]
            for tier, suffix in BLOCK_STATES if tier != "master"}})
    saved = read_finite_tensors(path, "head_tail.safetensors", manifest["files"]["head_tail.safetensors"])
    for i, (n, p, m, _) in enumerate(states.head_tail()):
        if left and not p.requires_grad:
            continue
        n = tied_source(p) or model.model_name(n)  # a pipeline's copy of a tied weight: the original's values
        state = None
        if n + ".exp_avg" in saved:
            state = {"step": torch.tensor(float(saved[n + ".step"][0])),
                     "exp_avg": _mine(saved, n + ".exp_avg", p, m.shape, path),
                     "exp_avg_sq": _mine(saved, n + ".exp_avg_sq", p, m.shape, path)}
        states.write_head_tail(i, master=_mine(saved, n, p, m.shape, path), state=state)


def _mine(saved: dict[str, torch.Tensor], key: str, param: torch.Tensor, shape, path: Path) -> torch.Tensor:
    """This rank's part of the whole tensor ``saved[key]`` (the slice ``param.tp_split`` names), checked
    against the ``shape`` it must have. A contiguous copy: the store and Adam want dense tensors."""
    try:
        full = saved[key]
    except KeyError:
        raise CheckpointError(f"checkpoint {path}: {key} is missing") from None
    try:
        part = tp_slice(full, tp_split(param))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {key}: {e}") from None
    if part.shape != torch.Size(shape):
        raise CheckpointError(f"checkpoint {path}: {key} has shape {tuple(full.shape)}, this run expects "
                              f"{tuple(shape)} per rank (split {tp_split(param)})")
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
