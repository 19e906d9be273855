"""What ``--resume`` loads, and what it does with the options given to the resumed run.

``resume(trainer, newest)`` loads the newest checkpoint the run can continue, from ``newest`` (the
newest valid one, ``checkpoint_dir.open_run_directory``'s pick) down: one made for another model or
block count, or holding inf/NaN values or moments, is skipped with one line and the next older
valid one tried; CheckpointError when none fits. Then the options given again are compared with
the checkpoint's values:

- AdamW's hyper-parameters (``--lr``, the peak; ``--beta2``; ``--weight-decay``) and the schedule
  (``--warmup``, ``--min-lr-ratio``) that were given and differ are applied from the next step,
  one line each (``resume: --lr 0.002 -> 0.001 (applied from step 41)``); the schedule's decay
  length stays the checkpoint's (a changed ``--steps`` is said in one line);
- ``--seed`` cannot change (the data order and random state are the checkpoint's): refused in one
  line, as a changed ``--batch``, ``--seq`` or data are (``load_checkpoint``).

Given means on the command line (``TrainConfig.given``); a config built in Python gives every field.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pystronghold.parallel.data import any_rank
from pystronghold.train.checkpoint import load_checkpoint
from pystronghold.train.checkpoint_dir import CheckpointError, UnusableCheckpoint, checkpoint_steps, valid_checkpoints

__all__ = ["resume"]

log = logging.getLogger(__name__)


def resume(trainer, newest: Path) -> Path:
    """Load into ``trainer`` the newest checkpoint it can continue, from ``newest`` down, and apply
    the options given to it (module docstring). Returns the checkpoint loaded."""
    wanted = _settings(trainer)  # what this run's options say, before the checkpoint replaces them
    path = _load_newest_fitting(trainer, newest)
    log.info("resumed from %s at step %d", path, trainer.step)
    _check_seed(trainer, path)
    _apply_changes(trainer, wanted)
    run = trainer.config.run
    decay = getattr(trainer.scheduler.lr_lambdas[0], "decay_steps", None)
    if trainer.step >= run.steps:
        log.warning("resume: checkpoint %s is at step %d, --steps %d: nothing to train (give a larger --steps "
                    "to go on)", path.name, trainer.step, run.steps)
    elif decay is not None and decay != run.steps:
        log.warning("resume: the LR schedule comes from the checkpoint (cosine to step %d); with --steps %d "
                    "the learning rate %s", decay, run.steps,
                    "stays at its floor after that step" if decay < run.steps else "will not reach its floor")
    return path


# ---- which checkpoint

def _load_newest_fitting(trainer, newest: Path) -> Path:
    """Load ``newest`` or, when it does not fit (UnusableCheckpoint), the next older valid one, and so
    on. Every rank of a run of several processes skips a checkpoint that any rank found unusable
    (a pipeline stage reads only its own blocks)."""
    steps = dict((p, s) for s, p in checkpoint_steps(newest.parent))
    candidates = valid_checkpoints(newest.parent, below=steps.get(newest, 0))
    path, errors = newest, []
    while path is not None:
        error = None
        try:
            state, record = trainer.checkpoint_state()
            trainer.step, trainer.lineage = load_checkpoint(state, path, record)
        except UnusableCheckpoint as e:
            error = e
        if not any_rank(error is not None):
            return path
        log.warning("resume: skipped %s: %s", path.name, error or "another rank cannot load it")
        errors.append(error or CheckpointError(f"checkpoint {path}: another rank cannot load it"))
        path = next(candidates, None)
    more = f" (and the {len(errors) - 1} older valid one(s) do not fit either)" if len(errors) > 1 else ""
    raise CheckpointError(f"{errors[0]}{more}")


# ---- the options given again

def _given(trainer, name: str) -> bool:
    """Whether option field ``name`` (``optim.lr``) was given (every field of a config built in Python)."""
    given = trainer.config.given
    return given is None or name in given


def _settings(trainer) -> dict:
    """This run's optimizer settings per param group and its schedule, as its options made them."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.engine.optimizer.param_groups]
    return {"groups": groups, "peaks": list(trainer.scheduler.base_lrs),
            "schedule": dataclasses.replace(trainer.scheduler.lr_lambdas[0])}


def _check_seed(trainer, path: Path) -> None:
    saved, mine = trainer.sampler.seed, trainer.config.run.seed
    if _given(trainer, "run.seed") and saved != mine:
        raise CheckpointError(f"--resume: --seed {mine} differs from checkpoint {path}'s {saved}: a resumed run "
                              "keeps the data order and random state it had; leave --seed out")


def _apply_changes(trainer, wanted: dict) -> None:
    """Apply the optimizer and schedule options given that differ from the checkpoint's, from the
    next step on, one line each; the learning rates of the groups follow the schedule from there."""
    scheduler, groups = trainer.scheduler, trainer.engine.optimizer.param_groups
    schedule = scheduler.lr_lambdas[0]
    changes = []

    def change(option: str, flag: str, old, new) -> bool:
        if not _given(trainer, option) or old == new:
            return False
        changes.append(f"{flag} {old:g} -> {new:g}")
        return True

    relearn = change("optim.lr", "--lr", scheduler.base_lrs[0], wanted["peaks"][0])
    if relearn:
        scheduler.base_lrs = list(wanted["peaks"])
    if change("optim.beta2", "--beta2", groups[0]["betas"][1], wanted["groups"][0]["betas"][1]):
        for g, w in zip(groups, wanted["groups"]):
            g["betas"] = tuple(w["betas"])
    if change("optim.weight_decay", "--weight-decay", groups[0]["weight_decay"], wanted["groups"][0]["weight_decay"]):
        for g, w in zip(groups, wanted["groups"]):
            g["weight_decay"] = w["weight_decay"]
    new = wanted["schedule"]
    warmup = change("optim.warmup", "--warmup", schedule.warmup_steps, new.warmup_steps)
    floor = change("optim.min_lr_ratio", "--min-lr-ratio", schedule.min_ratio, new.min_ratio)
    if warmup or floor:
        try:  # NOTE: validated as a whole (warm-up within the checkpoint's decay), then set in place:
            # every group's lambda is this one object, and the scheduler's state saves its __dict__
            checked = dataclasses.replace(schedule, warmup_steps=schedule.warmup_steps if not warmup else
                                          new.warmup_steps, min_ratio=new.min_ratio if floor else schedule.min_ratio)
        except ValueError as e:
            raise CheckpointError(f"--resume: --warmup {new.warmup_steps} does not fit the checkpoint's "
                                  f"schedule ({e})") from None
        schedule.__dict__.update(dataclasses.asdict(checked))
    if relearn or warmup or floor:
        for g, peak in zip(groups, scheduler.base_lrs):
            g["initial_lr"] = peak
            g["lr"] = peak * schedule(scheduler.last_epoch)  # LambdaLR's own formula, as at its next step
    for text in changes:
        log.warning("resume: %s (applied from step %d)", text, trainer.step + 1)
