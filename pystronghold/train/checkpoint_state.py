"""What a checkpoint saves and loads, as objects: the ``torch.distributed.checkpoint.Stateful`` way.

A run hands ``save_checkpoint`` and ``load_checkpoint`` a dict of objects with ``state_dict()`` and
``load_state_dict()`` (``run_state``): the engine (step counts, loss scale, layer drop), the LR
scheduler, the optimizer's group settings, the sampler's data position and the RNGs; and beside
them ``"model"``, the store's masters and Adam moments (``StreamedModel``), which are streamed one
block at a time rather than held as one state dict. ``RunRecord`` is what the manifest says about
the run that wrote it. Nothing here knows the Trainer.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from pystronghold.train.checkpoint_finetune import checkpoint_record

__all__ = ["RNGState", "OptimizerSettings", "StreamedModel", "RunRecord", "run_state", "run_record"]


class RNGState:
    """The process's Python, torch, CUDA (when initialized) and numpy random states."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover
            pass
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])


class OptimizerSettings:
    """The hyper-parameters of each of ``optimizer``'s param groups (its moments are the model's,
    streamed with the blocks)."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> list[dict]:
        return self._optimizer.group_settings()

    def load_state_dict(self, state: list[dict] | dict) -> None:
        """ValueError (before anything changes) when the group counts differ."""
        hyper = [state] if isinstance(state, dict) else state  # one group before 0.1.1
        groups = self._optimizer.param_groups
        if len(hyper) != len(groups):
            raise ValueError(f"it has {len(hyper)} optimizer param group(s), this run {len(groups)} "
                             "(--decay decides them)")
        for group, h in zip(groups, hyper):
            group.update(h)


@dataclasses.dataclass(frozen=True)
class StreamedModel:
    """The model's fp32 masters and AdamW moments in the engine's store (``engine.states``), which a
    checkpoint reads and writes one block at a time by full model name.

    ``groups``: the run's process groups (None in one process); ``pipeline``: this rank's pipeline
    stage (None without one); ``blocks``: blocks of the whole model (a stage holds only some);
    ``leaves_frozen``: frozen parameters are left out (a ``--model hf:DIR`` run: DIR gives them back).
    """

    states: object
    groups: object = None
    pipeline: object = None
    blocks: int = 0
    leaves_frozen: bool = False

    @property
    def tp_group(self):
        """The TP group of a run with tensor parallelism, else None (nothing is split)."""
        groups = self.groups
        return groups.tp_group if groups is not None and groups.tp_size > 1 else None

    @property
    def block_indices(self) -> list[int]:
        """The global index of each of this rank's blocks, in the store's order."""
        if self.pipeline is None:
            return list(range(len(self.states.block_names)))
        return self.pipeline.block_indices

    def model_name(self, name: str) -> str:
        """The whole model's name of this rank's parameter ``name``."""
        return name if self.pipeline is None else self.pipeline.global_name(name)

    def layout(self) -> dict:
        """``{"tp", "dp", "pp"}``: the sizes of the layout that holds the model."""
        g = self.groups
        return {"tp": g.tp_size if g else 1, "dp": g.dp_size if g else 1, "pp": g.pp_size if g else 1}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a checkpoint's manifest says about the run, beside its state objects.

    ``step``: optimizer steps done; ``lineage``: run ids of the runs this one continues, its own
    last; ``model``: the model config (``GPTConfig`` or ``HFModelConfig``); ``overwrite``: the run
    was given --overwrite; ``finetune``: computes the manifest's ``finetune`` (and ``base``) entries,
    called only when needed (it may hash the base model's files)."""

    step: int
    lineage: tuple[str, ...]
    model: object
    precision: str
    overwrite: bool
    finetune: Callable[[], dict]


def run_state(run, *, engine, scheduler, sampler, groups=None, pipeline=None) -> dict:
    """The dict of state objects a checkpoint saves and loads for ``run`` (a ``train.run.Run``)
    training with ``engine`` (keys: model, engine, optimizer, scheduler, sampler,
    rng; see the module docstring); ``pipeline``: this rank's pipeline stage, if any."""
    blocks = run.model.layers if pipeline is not None else len(engine.states.block_names)
    model = StreamedModel(engine.states, groups=groups, pipeline=pipeline, blocks=blocks, leaves_frozen=run.hf)
    return {"model": model, "engine": engine, "optimizer": OptimizerSettings(engine.optimizer),
            "scheduler": scheduler, "sampler": sampler, "rng": RNGState()}


def run_record(run, *, step: int, lineage, model, lora=None) -> RunRecord:
    """The ``RunRecord`` of ``run`` (a ``train.run.Run``) training ``model`` (the module, to see
    which parameters are frozen), with LoRA adapters ``lora`` (``settings.finetune.LoraSpec``) or
    none. NOTE: a ``--model hf:DIR`` run leaves the frozen parameters out of its checkpoints
    (``StreamedModel.leaves_frozen``): DIR gives them back on resume."""
    config = run.config

    def finetune() -> dict:
        partial = any(not p.requires_grad for p in model.parameters())
        base = run.model.source if partial and run.hf else None
        return checkpoint_record(config.finetune.freeze, lora, base)

    return RunRecord(step=step, lineage=tuple(lineage), model=run.model, precision=config.runtime.precision,
                     overwrite=config.checkpoint.overwrite, finetune=finetune)
