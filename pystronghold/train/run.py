"""``resolve(config) -> Run``: what a ``pystronghold train`` run is, decided once, before anything
is built.

``TrainConfig`` holds the options as given, checked against each other without touching the
machine. ``resolve`` reads what they name (the model's config.json or JSON file, the data files,
the output paths, the devices) once and decides the rest: the model spec, the sequence length, the
learning rate, the device, this process's share of the batch, the loss chunks and MLP tiles, the
long-context settings the planner turns on, and whether the host can hold the run. It raises
ConfigError naming the option (``on_command_line()``: the flag) for a value this machine or this
model refuses, and MemoryError for a run the host cannot hold. The ``Trainer`` builds from the
``Run`` and never decides again; two things stay with it: ``--window auto`` (the planner measures
the built model's blocks) and the checkpoint directory's state (rank 0 locks it for the run's
length and tells the other ranks through the process group the Trainer makes).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from pystronghold.models import GPTConfig
from pystronghold.models.hf import HF_PREFIX, HFModelConfig
from pystronghold.models.hf_tp import check_hf_tp
from pystronghold.models.hf_tp_experts import check_expert_rows
from pystronghold.models.presets import param_count
from pystronghold.nn.tiled import mlp_tile_tokens
from pystronghold.options import ConfigError
from pystronghold.planner.cost import Workload, block_activation_bytes, tail_activation_bytes
from pystronghold.planner.pipeline import even_split, rank_stages, stage_split
from pystronghold.records import is_dataset_dir, require_data
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.memory.layout import host_bytes_per_param
from pystronghold.runtime.memory.placement import available_host_bytes
from pystronghold.settings.precision import compute_dtype
from pystronghold.settings.parallel import check_pipeline
from pystronghold.train.config import TrainConfig
from pystronghold.train.context import hf_default_seq
from pystronghold.train.long_context import choose_long_context_settings
from pystronghold.train.model_spec import model_lr, resolve_model
from pystronghold.train.output_paths import check_creatable_dir, check_creatable_file

__all__ = ["Run", "resolve", "peak_lr"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """A train run with everything decided that can be before the model exists."""

    config: TrainConfig
    """The options as given (never written to)."""
    model: GPTConfig | HFModelConfig
    """The model's config, read once: a GPTConfig (``tp_size`` = --tp) or the HFModelConfig of
    --model hf:DIR."""
    hf_shape: object | None
    """The planner's ``HFShape`` of a Hugging Face model (None for our GPT, or a shape the planner
    cannot read)."""
    seq: int
    """Tokens per sequence."""
    seq_why: str | None
    """Why ``seq`` is what it is, in words, when the run chose it (a Hugging Face model without
    --seq); None when given or the GPT's seq_len."""
    lr: float
    """Peak learning rate: --lr, or the model's (``model_lr``; LoRA's with --lora-rank)."""
    local_batch: int
    """Samples of one micro-batch on this process (its share of --batch under --dp)."""
    loss_chunk_tokens: int
    """Tokens per chunk of the loss (0: the full logits at once), of this rank's vocabulary."""
    mlp_tile_tokens: int
    """Positions per MLP tile (0: untiled)."""
    runtime: RuntimeConfig
    """The runtime's settings as given, with the device this process uses (``cuda``: its
    LOCAL_RANK's under torchrun) and the "auto" long-context settings the planner decided."""
    long_context: dict
    """The RuntimeConfig fields of ``runtime`` the planner decided (``train.long_context``)."""

    @property
    def hf(self) -> bool:
        """--model hf:DIR: a Hugging Face model, its own tokenizer, loaded lazily."""
        return isinstance(self.model, HFModelConfig)


def resolve(config: TrainConfig) -> Run:
    """The ``Run`` of ``config``: reads the model's config, checks the machine, the files and the
    layout against it, and decides the run's settings (see the module doc). Every rank of a
    torchrun launch decides alike, so a refusal is every rank's before any collective."""
    cfg = resolve_model(config.model.model)
    _check_paths_and_machine(config)
    _check_model(config, cfg)  # NOTE: before the GPTConfig takes --tp, which it would refuse less clearly
    if config.parallel.tp > 1:
        cfg = dataclasses.replace(cfg, tp_size=config.parallel.tp)
    hf = isinstance(cfg, HFModelConfig)
    hf_shape = _hf_shape(cfg) if hf else None
    seq, seq_why = config.data.seq, None
    if not seq and hf:
        seq, seq_why = hf_default_seq(cfg, hf_shape, config.data.batch, config.runtime.precision, config.finetune)
    seq = seq or cfg.seq_len
    par = config.parallel
    local_batch = max(par.dp_split) if par.dp_split is not None else config.data.batch // par.dp_size
    vocab = (cfg.vocab_size if hf else cfg.padded_vocab_size) // cfg.tp_size
    runtime = config.runtime
    if par.distributed and runtime.device == "cuda":  # NOTE: torchrun's processes take a GPU each
        runtime = dataclasses.replace(runtime, device=f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    run = Run(config=config, model=cfg, hf_shape=hf_shape, seq=seq, seq_why=seq_why,
              lr=peak_lr(config),
              local_batch=local_batch, loss_chunk_tokens=config.data.loss_chunk_tokens(vocab),
              mlp_tile_tokens=_mlp_tile(config, cfg, hf_shape, local_batch, seq), runtime=runtime,
              long_context={})
    if par.pp > 1:
        _check_stages(run)
    _check_host_memory(run)
    long_context = choose_long_context_settings(run)  # --head-tail, --offload-activations auto
    return dataclasses.replace(run, runtime=dataclasses.replace(runtime, **long_context), long_context=long_context)


# ---- the machine, the files and the model against the options

def _check_paths_and_machine(config: TrainConfig) -> None:
    """The data and the output paths, the devices and --nvme exist (or can be made) on this machine."""
    for p in config.data.data:
        if not os.path.exists(p):
            raise ConfigError(config.data, "data", f": no such file or directory: {p}")
        if is_dataset_dir(Path(p)):
            require_data(p)
    run = config.run
    if run.trace is not None:
        _require("plots", "--trace (timeline.png, loss.png)")
        check_creatable_dir("--trace", run.trace)
    if run.metrics_file is not None:
        check_creatable_file("--metrics-file", run.metrics_file)
    if run.tensorboard is not None:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(run, "tensorboard", "needs the 'tensorboard' package (pip install tensorboard)")
        check_creatable_dir("--tensorboard", run.tensorboard)
    if config.checkpoint.checkpoint_dir:
        check_creatable_dir("--checkpoint-dir", config.checkpoint.checkpoint_dir)
    rt = config.runtime
    rt.check_device_present()
    if rt.nvme_dir is not None:
        from pystronghold.io.scratch import check_io_directory

        check_io_directory(rt.nvme_dir, flag="--nvme")  # exists (or is created), takes files


def _require(extra: str, what: str) -> None:
    from pystronghold.extras import require

    try:
        require(extra, what)
    except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
        raise ValueError(str(e)) from None


def _check_model(config: TrainConfig, cfg) -> None:
    """--seq, the data, the fine-tune and the layout against the model and the launch's processes
    (local arithmetic: the same on every rank, before any collective)."""
    data, par, ft = config.data, config.parallel, config.finetune
    hf = isinstance(cfg, HFModelConfig)
    if data.seq > cfg.seq_len:
        what = f"{cfg.seq_len} positions" if hf else f"seq_len {cfg.seq_len}"
        raise ConfigError(data, "seq=", f"is longer than the model's {what}")
    tp = par.tp
    if hf:
        check_hf_tp(cfg, tp)
        check_expert_rows(cfg, tp, compute_dtype(config.runtime.precision).itemsize)
        if not data.data:
            # NOTE: the embedded default corpus (the standard library) is for the demo; a fine-tune
            # on it by a forgotten option would look like success
            raise ConfigError(config.model, "model", f"{HF_PREFIX}DIR needs --data (the text, .jsonl records "
                              "or token file to fine-tune on)")
    if not ft.full:
        # NOTE: --freeze --tp on hf:DIR: the frozen shards are read from DIR like the others; LoRA at
        # --tp: its adapters split with their base layers (models.lora_tp); LoRA and --freeze at --pp
        # on hf:DIR: each stage wraps its own blocks
        name = "lora_rank" if ft.lora_rank is not None else "freeze"
        if (tp > 1 or par.pp > 1) and not hf:
            raise ConfigError(ft, name, "is not supported with --tp or --pp yet")
        if tp > 1 and ft.lora_rank is not None and ft.lora_dropout:
            # NOTE: a whole A reads its input on every rank: ranks dropping different inputs would move it apart
            raise ConfigError(ft, "lora_dropout=", "is not supported with --tp yet (give 0)")
        if ft.lora_rank is not None:
            _require("peft", "--lora-rank")
            if not hf:
                from pystronghold.planner.trainable import check_lora_targets, lora_targets

                check_lora_targets(cfg, lora_targets(cfg, ft))
    par.check_world()
    if par.pp > 1:
        _check_pipeline(config, cfg.layers)
    if cfg.heads % tp:
        raise ConfigError(par, "tp=", f"must divide the model's {cfg.heads} attention heads")
    if cfg.padded_vocab_size % tp:
        raise ConfigError(par, "tp=", f"must divide the model's padded vocabulary {cfg.padded_vocab_size}")


def _check_pipeline(config: TrainConfig, blocks: int) -> None:
    """--pp against the model's ``blocks``, --batch and --accumulation."""
    par, rt, batch = config.parallel, config.runtime, config.data.batch
    dp, m = par.dp_size, par.micro_batch_count
    check_pipeline(par, blocks)
    if batch % (dp * m):
        raise ConfigError(par, "micro_batches=", f": --batch {batch} must be divisible by {dp} data-parallel "
                          f"replicas x {m} micro-batches (each replica cuts its slice into equal micro-batches)")
    if rt.accumulation_steps > 1:
        raise ConfigError(rt, "accumulation_steps=", "with a pipeline: it accumulates over --micro-batches; "
                          "use that instead")


def _check_stages(run: Run) -> None:
    """Each pipeline stage holds its resident blocks. NOTE: each stage wraps its own blocks; one
    whose resident blocks do not fit would fail alone, after the others entered a collective. The
    split is local arithmetic (gpt_stage's, hf_chunks')."""
    par, rt = run.config.parallel, run.config.runtime
    pp, v, layers = par.pp, par.pp_chunks, run.model.layers
    split = even_split(layers, pp * v) if run.hf else stage_split(run.model, run.seq, pp * v)[0]
    per_rank = [sum(len(split[s]) for s in rank_stages(r, pp, v)) for r in range(pp)]
    smallest = min(range(pp), key=lambda s: per_rank[s])
    if rt.resident_blocks > per_rank[smallest]:
        raise ConfigError(rt, "resident_blocks=", f"is more than the {per_rank[smallest]} blocks of "
                          f"pipeline stage {smallest} (--pp {pp} splits the blocks {per_rank}); each "
                          "stage keeps that many of its own blocks resident")


# ---- what the run decides

def peak_lr(config: TrainConfig) -> float:
    """The peak learning rate of ``config``: --lr, or the model's (``model_lr``; LoRA's with --lora-rank)."""
    if config.optim.lr is not None:
        return config.optim.lr
    return model_lr(config.model.model, lora=config.finetune.lora_rank is not None)


def _hf_shape(cfg: HFModelConfig):
    """The planner's shape of a Hugging Face model; None when it cannot read it."""
    from pystronghold.planner.hf_shape import read_hf_shape

    try:
        return read_hf_shape(cfg.source)
    except (ValueError, KeyError, ImportError):
        return None


def _mlp_tile(config: TrainConfig, cfg, hf_shape, local_batch: int, seq: int) -> int:
    """Positions per MLP tile: --mlp-tile, or for auto ``nn.tiled.mlp_tile_tokens`` of this
    process's micro-batch, the model's MLP width (this rank's columns) and the compute precision
    (untiled for a model whose shape the planner cannot read)."""
    if config.data.mlp_tile != "auto":
        return config.data.mlp_tile
    if isinstance(cfg, HFModelConfig):
        if hf_shape is None:
            return 0
        width = hf_shape.mlp_width
    else:
        width = cfg.ffn_hidden // cfg.tp_size
    return mlp_tile_tokens(local_batch, seq, width, compute_dtype(config.runtime.precision).itemsize)


def _check_host_memory(run: Run) -> None:
    """MemoryError unless this process's store and batches fit the host's available memory, refused in
    one line before anything is allocated rather than by the OOM killer at step 1.

    NOTE: the blocks are built by wrap() (in parallel threads, each block dropped once the store
    holds it), so the fp32 model never exists whole; the store does (a Hugging Face model's blocks
    are read from its shards the same way). Without --nvme it must fit in host memory (with --nvme
    the store's placement checks the budget itself). The batches are a lower bound: the loss's
    logits and one block's working set, as the planner counts them, on the CPU device."""
    config, cfg = run.config, run.model
    avail = available_host_bytes()
    if not run.hf:
        params = param_count(cfg)
        need = params * host_bytes_per_param(compute_dtype(config.runtime.precision))
        if need > avail and config.runtime.nvme_dir is None:
            raise MemoryError(f"--model: {params / 1e6:,.0f}M parameters need about "
                              f"{need / 2**30:.1f} GiB of host memory (the host store: fp32 weights and "
                              f"Adam moments, gradients), {avail / 2**30:.1f} GiB available; give --nvme "
                              "DIR to keep states on disk")
    seq, batch = run.seq, run.local_batch
    # (x, y) int64 (B, T) each: the validation batches are held for the run, one step's made at a time
    need = 16 * batch * seq * (config.run.eval_batches + config.runtime.accumulation_steps)
    if config.runtime.device == "cpu" and not run.hf:
        work = Workload(batch=batch, seq=seq, precision=config.runtime.precision,
                        loss_chunk_tokens=None if config.data.loss_chunk == "auto" else config.data.loss_chunk,
                        mlp_tile_tokens=run.mlp_tile_tokens)
        need += tail_activation_bytes(cfg, work, seq) + block_activation_bytes(cfg, work, seq)
    avail = available_host_bytes()
    if need > avail:
        raise MemoryError(f"--batch {config.data.batch} x --seq {seq} (with --eval-batches "
                          f"{config.run.eval_batches}): the batches and activations need at "
                          f"least {need:,} bytes ({need / 2**30:,.1f} GiB) of host memory, {avail:,} bytes "
                          f"({avail / 2**30:,.1f} GiB) available")
