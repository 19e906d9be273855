"""Options of ``pystronghold train``: one dataclass per component, composed into ``TrainConfig``.

The runtime's settings are ``RuntimeConfig``'s (``TrainConfig.runtime``); the classes here hold
what only training has. Every field's docstring is its ``--help`` text and ``__post_init__``
raises a ``ValueError`` naming the option. ``model_spec.py`` resolves ``--model``. With no options
the run is the embedded demo (``DEMO_MODEL``) on the Python standard library's sources.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from pystronghold.models import GPTConfig
from pystronghold.models.finetune import FinetuneOptions
from pystronghold.models.hf import HF_PREFIX, HFModelConfig
from pystronghold.models.hf_tp import check_hf_tp
from pystronghold.nn.chunked_loss import loss_chunk_tokens
from pystronghold.nn.tiled import mlp_tile_tokens
from pystronghold.options import ConfigError, component, option
from pystronghold.planner.pipeline import ParallelOptions, check_pipeline, even_split, rank_stages, stage_split
from pystronghold.records import is_dataset_dir, require_data
from pystronghold.runtime.settings.config import RuntimeConfig
from pystronghold.runtime.settings.precision import compute_dtype
from pystronghold.token_files import TOKEN_DTYPES
from pystronghold.train.context import hf_default_seq
from pystronghold.train.model_spec import model_lr, resolve_model
from pystronghold.train.output_paths import check_creatable_dir, check_creatable_file

__all__ = ["ModelOptions", "DataOptions", "OptimOptions", "AutoWindowOptions", "RunOptions",
           "CheckpointOptions", "ParallelOptions", "TrainConfig", "TRAIN_RUNTIME_DEFAULTS"]


def _loss_chunk_from_text(text: str, flag: str) -> int | str:
    """``--loss-chunk``: a number as an int; 'auto' (and anything else, refused) as it is."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _mlp_tile_from_text(text: str, flag: str) -> int | str:
    """``--mlp-tile``: a number as an int, 'off' as 0; 'auto' (and anything else, refused) as it is."""
    return 0 if text.strip() == "off" else _loss_chunk_from_text(text, flag)


@dataclass(kw_only=True, slots=True)
class ModelOptions:
    """Which GPT is trained."""

    model: str = "demo"
    """'demo' (the embedded default), a preset name (see `pystronghold plan --help`), a JSON file
    of GPTConfig fields, or hf:DIR: fine-tune the Hugging Face causal LM saved in local directory DIR
    (config.json, safetensors weights, tokenizer; GPT-2, Llama, Mistral, Qwen2)."""

    def __post_init__(self) -> None:
        resolve_model(self.model)  # raises ValueError naming --model


@dataclass(kw_only=True, slots=True)
class DataOptions:
    """Where batches come from."""

    data: list[str] = field(default_factory=list)
    """Text files or directories (every file under one, sorted; a format not read is refused by
    name) to train on; default: the Python standard library's sources (for hf:DIR --data is
    required). With hf:DIR also .jsonl records ({"text"}, {"messages"}, {"prompt", "completion"})
    and datasets save_to_disk directories; for any model one token file (.bin, .npy), memory-mapped."""
    max_bytes: int = 4 << 20
    """Most bytes of text read (training and validation together), bytes."""
    val_fraction: float = 0.05
    """Share of the text held out for the validation loss, in (0, 1)."""
    batch: int = 8
    """Sequences per micro-batch (B)."""
    seq: int = 0
    """Tokens per sequence (T); 0: the model's seq_len, for --model hf:DIR its positions capped by
    what fits this machine (512 when it names none), said at start-up; given, at most the model's
    seq_len or positions."""
    loss_chunk: int | str = option("auto", parse=_loss_chunk_from_text, metavar="TOKENS|auto")
    """Tokens whose logits the loss holds at once: the LM head and cross-entropy run chunk by chunk,
    so a long sequence never holds its full (T, V) logits; auto: as many as 256 MiB of fp32 logits
    take (``nn.chunked_loss.loss_chunk_tokens``), 0: every token at once."""
    mlp_tile: int | str = option("auto", parse=_mlp_tile_from_text, metavar="TOKENS|auto|off")
    """Positions of every sample whose MLP intermediate a block holds at once: the MLPs run over
    tiles of the sequence, forward and backward (one more MLP forward per block), so a long
    sequence never holds its full (B, T, F) intermediate; auto: tiles when that intermediate would
    take more than 256 MiB at the compute precision, as many positions as fit it
    (``nn.tiled.mlp_tile_tokens``); off (0): untiled."""
    token_dtype: str = field(default="auto", metadata={"choices": TOKEN_DTYPES})
    """Id type of a .bin token file: uint16, uint32, or auto: uint16 when the model's vocabulary has at
    most 65536 entries, else uint32 (a .npy file's header gives its own)."""

    def __post_init__(self) -> None:
        for p in self.data:
            if not os.path.exists(p):
                raise ValueError(f"--data: no such file or directory: {p}")
            if is_dataset_dir(Path(p)):
                require_data(p)
        if self.max_bytes < 1024:
            raise ValueError(f"--max-bytes must be >= 1024, got {self.max_bytes}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.seq < 0:
            raise ValueError(f"--seq must be >= 0, got {self.seq}")
        if self.loss_chunk != "auto" and (not isinstance(self.loss_chunk, int) or self.loss_chunk < 0):
            raise ConfigError(self, "loss_chunk=", "must be a number of tokens >= 0 or 'auto'")
        if self.mlp_tile == "off":
            self.mlp_tile = 0
        if self.mlp_tile != "auto" and (isinstance(self.mlp_tile, bool) or not isinstance(self.mlp_tile, int)
                                        or self.mlp_tile < 0):
            raise ConfigError(self, "mlp_tile=", "must be a number of tokens >= 0, 'auto' or 'off'")

    def loss_chunk_tokens(self, vocab_size: int) -> int:
        """Tokens per loss chunk for a model of ``vocab_size`` (0: one chunk, every token at once)."""
        return loss_chunk_tokens(vocab_size) if self.loss_chunk == "auto" else self.loss_chunk


@dataclass(kw_only=True, slots=True)
class OptimOptions:
    """AdamW and its learning-rate schedule."""

    lr: float | None = None
    """Peak learning rate; default: the model's own. GPT-3 presets: Brown et al. 2020, Table 2.1
    (gpt3-125m 6e-4 ... gpt3-6.7b 1.2e-4, gpt3-175b 6e-5); gpt2-124m: 6e-4 (as nanoGPT and GPT-3
    Small); demo, tiny, mini, small: 2e-3; a JSON model: its "lr" key, else the GPT-3 value of the
    largest GPT-3 size it reaches (2e-3 below 125M parameters); hf:DIR: 5e-5 (Hugging Face
    Trainer's default for fine-tuning); with --lora-rank, any model: 2e-4 (TRL's and PEFT's LoRA
    recipes)."""
    warmup: int = 20
    """Steps of linear warm-up to the peak."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of the peak, reached at the last step."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    decay: str = field(default="matrices", metadata={"choices": ("matrices", "all")})
    """Which parameters --weight-decay applies to: 'matrices' (weights and embeddings, >= 2-D; not
    biases or norm gains, as nanoGPT and GPT-3) or 'all'."""
    beta2: float = 0.99
    """Adam second-moment decay (beta1 is 0.9)."""

    def __post_init__(self) -> None:
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise ValueError(f"--lr must be > 0 and finite, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"--weight-decay must be >= 0 and finite, got {self.weight_decay}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"--beta2 must be in [0, 1), got {self.beta2}")


@dataclass(kw_only=True, slots=True)
class AutoWindowOptions:
    """How --window auto chooses W."""

    device_budget_mb: float = 0.0
    """Device bytes the planner may fill, MiB: the split of --window auto and the "auto" --head-tail
    and --offload-activations (``train/long_context.py``); 0: on CUDA the free memory less a reserve
    (``train.autowindow.device_reserve_bytes``); on the CPU --window auto takes head/tail,
    activations and 4 slots, and the two "auto" settings the runtime's rules."""

    def __post_init__(self) -> None:
        if not 0 <= self.device_budget_mb < math.inf:
            raise ValueError(f"--device-budget-mb must be >= 0 and finite, got {self.device_budget_mb}")


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """Length, seed, logging and outputs of the run."""

    steps: int = 300
    """Optimizer steps to train."""
    seed: int = 0
    """Seed of the weights, the batch order and every RNG."""
    log_every: int = 25
    """Steps between metrics lines."""
    eval_every: int = 100
    """Steps between validation losses (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    trace: str | None = None
    """Directory for trace.json (Perfetto), timeline.png and loss.png."""
    quiet: bool = False
    """No progress bar (metrics lines still go to the log)."""
    metrics_file: str | None = field(default=None, metadata={"metavar": "FILE"})
    """Also write every metrics line as one JSON object per line (JSONL) to this file (on --resume:
    appended to, after dropping its records of the steps trained again)."""
    tensorboard: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Also write the metrics as TensorBoard scalars into this directory (needs `pip install tensorboard`)."""

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.trace is not None:
            from pystronghold.extras import require

            try:
                require("plots", "--trace (timeline.png, loss.png)")
            except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
                raise ValueError(str(e)) from None
            check_creatable_dir("--trace", self.trace)
        if self.metrics_file is not None:
            check_creatable_file("--metrics-file", self.metrics_file)
        if self.tensorboard is not None:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError("--tensorboard needs the 'tensorboard' package (pip install tensorboard)")
            check_creatable_dir("--tensorboard", self.tensorboard)


@dataclass(kw_only=True, slots=True)
class CheckpointOptions:
    """Where and how often the run is saved, and whether it continues a saved one."""

    checkpoint_dir: str | None = None
    """Directory of checkpoints (one sub-directory per saved step); none: no checkpoints."""
    checkpoint_every: int = 0
    """Steps between checkpoints (one is always written at the end); 0: only at the end."""
    keep: int = 2
    """Most recent checkpoints kept (older ones this run, or the runs it resumed, wrote are deleted
    after a new one is complete; other runs' checkpoints never are)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in --checkpoint-dir."""
    overwrite: bool = False
    """Start a fresh run in a --checkpoint-dir that holds checkpoints (refused without it): they
    are deleted once this run's first checkpoint is complete."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1, got {self.keep}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir (there is nowhere to write checkpoints)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.overwrite and not self.checkpoint_dir:
            raise ValueError("--overwrite needs --checkpoint-dir")
        if self.overwrite and self.resume:
            raise ValueError("--overwrite starts a fresh run, --resume continues one: give one of them")
        if self.checkpoint_dir:
            check_creatable_dir("--checkpoint-dir", self.checkpoint_dir)


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ",".join(str(b) for b in sizes)


TRAIN_RUNTIME_DEFAULTS = {"clip_grad_norm": 1.0, "head_tail_on_host": "auto", "offload_block_inputs": "auto"}
"""Where ``pystronghold train``'s defaults differ from ``RuntimeConfig``'s: it clips at 1.0 (GPT-3,
nanoGPT), and places head and tail and the saved block inputs by the planner (off the device only
when the run would not fit without: ``train/long_context.py``)."""

TRAIN_RUNTIME_HIDDEN = ("checkpointing", "resident_recompute", "overlap", "strict", "trace", "copy_threads",
                        "init_threads", "initial_loss_scale", "loss_scale_interval")
"""RuntimeConfig fields that are no ``pystronghold train`` option: ``trace`` is always on (the
metrics lines need it; ``--trace DIR`` is RunOptions'), the others keep their defaults. The
optimizer comes from OptimOptions, ``parallel`` from ParallelOptions."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``pystronghold train`` needs; its fields are the components, in --help order."""

    model: ModelOptions = component(ModelOptions)
    finetune: FinetuneOptions = component(FinetuneOptions)
    data: DataOptions = component(DataOptions)
    optim: OptimOptions = component(OptimOptions)
    runtime: RuntimeConfig = component(lambda: RuntimeConfig(**TRAIN_RUNTIME_DEFAULTS), hide=TRAIN_RUNTIME_HIDDEN)
    """The window runtime: where compute runs, how many blocks live there, clipping, accumulation,
    host memory and the NVMe tier"""
    auto_window: AutoWindowOptions = component(AutoWindowOptions)
    run: RunOptions = component(RunOptions)
    checkpoint: CheckpointOptions = component(CheckpointOptions)
    parallel: ParallelOptions = component(ParallelOptions)
    given: frozenset[str] | None = option(default=None, cli=False)
    """The options given on the command line, as ``component.field`` names (``optim.lr``); None (a
    config built in Python): every field counts as given. What ``--resume`` applies, or refuses,
    where it differs from the checkpoint (``train.resume``)."""

    def __post_init__(self) -> None:
        # NOTE: the machine's side of the runtime settings, before the data is read or anything built
        # (wrap() checks both again when it uses them)
        self.runtime.check_device_present()
        if self.runtime.nvme_dir is not None:
            from pystronghold.io.scratch import check_io_directory

            check_io_directory(self.runtime.nvme_dir, flag="--nvme")  # exists (or is created), takes files
        cfg = resolve_model(self.model.model)
        if self.data.seq > cfg.seq_len:
            what = f"{cfg.seq_len} positions" if isinstance(cfg, HFModelConfig) else f"seq_len {cfg.seq_len}"
            raise ValueError(f"--seq {self.data.seq} is longer than the model's {what}")
        # NOTE: every rank runs these same checks on the same arguments and environment, so a bad
        # layout fails everywhere before any rank enters torch.distributed (nothing can hang).
        par = self.parallel
        tp, dp, world = par.tp, par.dp_size, par.world_size
        if isinstance(cfg, HFModelConfig):
            check_hf_tp(cfg, tp)
        if isinstance(cfg, HFModelConfig) and not self.data.data:
            # NOTE: the embedded default corpus (the standard library) is for the demo; a fine-tune
            # on it by a forgotten option would look like success
            raise ValueError(f"--model {HF_PREFIX}DIR needs --data (the text, .jsonl records or token file to "
                             "fine-tune on)")
        self._check_finetune(cfg)
        if self.runtime.resident_blocks == "auto" and self.runtime.window != "auto":
            raise ConfigError(self.runtime, "resident_blocks=", "is chosen together with the window: it needs "
                                                                 "`window='auto'` (or give K, a number of blocks)")
        if par.distributed and self.runtime.window == "auto":
            raise ValueError("--window auto is not supported with several processes yet; give --window N")
        if par.pp > 1:
            self._check_pipeline(cfg)
        if world == 1 and tp * dp > 1:
            raise ValueError(f"--tp {tp} x --dp {dp} needs {tp * dp} processes; launch with "
                             f"torchrun --nproc-per-node {tp * dp} -m pystronghold train ...")
        if world % tp:
            raise ValueError(f"--tp {tp} must divide the number of processes {world}")
        if tp * dp * par.pp != world:
            raise ValueError(f"--tp {tp} x --dp {dp} = {tp * dp} processes, but there are {world}")
        if cfg.heads % tp:
            raise ValueError(f"--tp {tp} must divide the model's {cfg.heads} attention heads")
        if cfg.padded_vocab_size % tp:
            raise ValueError(f"--tp {tp} must divide the model's padded vocabulary {cfg.padded_vocab_size}")
        if par.dp_split is not None:
            if len(par.dp_split) != dp:
                raise ValueError(f"--dp-split {_sizes_text(par.dp_split)} gives {len(par.dp_split)} replicas' "
                                 f"samples, but there are --dp {dp}")
            if sum(par.dp_split) != self.data.batch:
                raise ValueError(f"--dp-split {_sizes_text(par.dp_split)} sums to {sum(par.dp_split)} samples, "
                                 f"not --batch {self.data.batch}")
        elif self.data.batch % dp:
            raise ValueError(f"--batch {self.data.batch} must be divisible by --dp {dp} "
                             "(each replica takes an equal slice of every batch)")

    def check_batch_memory(self) -> None:
        """MemoryError unless this process's batches fit the host's available memory (and on the
        CPU device its activations: the loss's logits and one block's working set, as the planner
        counts them): refused in one line before anything is allocated, not a MemoryError
        traceback (or the OOM killer) at step 1. A lower bound: the store is checked apart (first:
        ``Trainer``), as is the device's memory."""
        from pystronghold.planner.cost import Workload, block_activation_bytes, tail_activation_bytes
        from pystronghold.runtime.memory.placement import available_host_bytes

        cfg, seq, batch = self.gpt, self.seq, self.local_batch
        # (x, y) int64 (B, T) each: the validation batches are held for the run, one step's made at a time
        need = 16 * batch * seq * (self.run.eval_batches + self.runtime.accumulation_steps)
        if self.runtime.device == "cpu" and isinstance(cfg, GPTConfig):
            work = Workload(batch=batch, seq=seq, precision=self.runtime.precision,
                            loss_chunk_tokens=None if self.data.loss_chunk == "auto" else self.data.loss_chunk,
                            mlp_tile_tokens=self.mlp_tile_tokens)
            need += tail_activation_bytes(cfg, work, seq) + block_activation_bytes(cfg, work, seq)
        avail = available_host_bytes()
        if need > avail:
            raise MemoryError(f"--batch {self.data.batch} x --seq {seq} (with --eval-batches {self.run.eval_batches}): "
                              f"the batches and activations need at "
                              f"least {need:,} bytes ({need / 2**30:,.1f} GiB) of host memory, {avail:,} bytes "
                              f"({avail / 2**30:,.1f} GiB) available")

    def _check_finetune(self, cfg) -> None:
        """--lora-rank and --freeze on this model and layout (the options themselves are checked by
        ``FinetuneOptions``); a GPT's LoRA targets as ``pystronghold plan`` checks them."""
        ft, par = self.finetune, self.parallel
        if ft.full:
            return
        # NOTE: --freeze --tp on hf:DIR: the frozen shards are read from DIR like the others; LoRA at
        # --tp: its adapters split with their base layers (models.lora_tp); LoRA and --freeze at --pp
        # on hf:DIR: each stage wraps its own blocks
        if (par.tp > 1 or par.pp > 1) and not isinstance(cfg, HFModelConfig):
            raise ValueError(f"{'--lora-rank' if ft.lora_rank is not None else '--freeze'} is not supported "
                             "with --tp or --pp yet")
        if par.tp > 1 and ft.lora_rank is not None and ft.lora_dropout:
            # NOTE: a whole A reads its input on every rank: ranks dropping different inputs would move it apart
            raise ValueError(f"--lora-dropout {ft.lora_dropout:g} is not supported with --tp yet (give 0)")
        if ft.lora_rank is not None:
            from pystronghold.extras import require

            try:
                require("peft", "--lora-rank")
            except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
                raise ValueError(str(e)) from None
            if isinstance(cfg, GPTConfig):
                from pystronghold.planner.finetune import check_lora_targets, lora_targets

                check_lora_targets(cfg, lora_targets(cfg, ft))

    def _check_pipeline(self, cfg) -> None:
        """--pp layouts (local arithmetic: the same on every rank, before any collective)."""
        par = self.parallel
        pp, tp, dp, world, m = par.pp, par.tp, par.dp_size, par.world_size, par.micro_batch_count
        if pp * tp * dp != world:
            launch = (f"; launch with torchrun --nproc-per-node {pp * tp * dp} -m pystronghold train ..."
                      if world == 1 else "")
            raise ConfigError(par, "pp=", f"x `tp=` x {dp} data-parallel replicas = {pp * tp * dp} processes, but there are "
                              f"{world}{launch}")
        v = par.pp_chunks
        check_pipeline(par, cfg.layers)
        if self.data.batch % (dp * m):
            raise ConfigError(par, "micro_batches=", f": --batch {self.data.batch} must be divisible by {dp} data-parallel "
                              f"replicas x {m} micro-batches (each replica cuts its slice into equal micro-batches)")
        # NOTE: each stage wraps its own blocks; one whose resident blocks do not fit would fail alone,
        # after the others entered a collective. The split is local arithmetic (gpt_stage's, hf_chunks').
        split = (even_split(cfg.layers, pp * v) if isinstance(cfg, HFModelConfig)
                 else stage_split(self.gpt, self.seq, pp * v)[0])
        per_rank = [sum(len(split[s]) for s in rank_stages(r, pp, v)) for r in range(pp)]
        smallest = min(range(pp), key=lambda s: per_rank[s])
        if self.runtime.resident_blocks > per_rank[smallest]:
            raise ConfigError(self.runtime, "resident_blocks=", f"is more than the {per_rank[smallest]} blocks of "
                              f"pipeline stage {smallest} (--pp {pp} splits the blocks {per_rank}); each "
                              "stage keeps that many of its own blocks resident")
        if self.runtime.accumulation_steps > 1:
            raise ConfigError(self.runtime, "accumulation_steps=", "with a pipeline: it accumulates over "
                              "--micro-batches; use that instead")

    @property
    def gpt(self) -> GPTConfig | HFModelConfig:
        """The model's GPTConfig (``tp_size`` = --tp), or the HFModelConfig of --model hf:DIR."""
        cfg = resolve_model(self.model.model)
        return dataclasses.replace(cfg, tp_size=self.parallel.tp) if self.parallel.tp > 1 else cfg

    @property
    def lr(self) -> float:
        """Peak learning rate in effect: --lr, or the model's (``model_lr``; LoRA's with --lora-rank)."""
        if self.optim.lr is not None:
            return self.optim.lr
        return model_lr(self.model.model, lora=self.finetune.lora_rank is not None)

    @property
    def seq(self) -> int:
        """Tokens per sequence in effect."""
        cfg = self.gpt
        if isinstance(cfg, HFModelConfig):
            return self.data.seq or self.seq_default[0]
        return self.data.seq or cfg.seq_len

    @property
    def local_batch(self) -> int:
        """Samples of one micro-batch on this process (its share of --batch under --dp)."""
        par = self.parallel
        return max(par.dp_split) if par.dp_split is not None else self.data.batch // par.dp_size

    @property
    def mlp_tile_tokens(self) -> int:
        """Positions per MLP tile in effect (0: untiled): --mlp-tile, or for auto
        ``nn.tiled.mlp_tile_tokens`` of this process's micro-batch, the model's MLP width (this
        rank's columns) and the compute precision (untiled for a model whose shape the planner
        cannot read)."""
        if self.data.mlp_tile != "auto":
            return self.data.mlp_tile
        cfg = self.gpt
        if isinstance(cfg, HFModelConfig):
            from pystronghold.planner.hf_shape import read_hf_shape

            try:
                width = read_hf_shape(cfg.source).mlp_width
            except (ValueError, KeyError, ImportError):
                return 0
        else:
            width = cfg.ffn_hidden // cfg.tp_size
        return mlp_tile_tokens(self.local_batch, self.seq, width, compute_dtype(self.runtime.precision).itemsize)

    @property
    def seq_default(self) -> tuple[int, str]:
        """(tokens, why in words) of a Hugging Face model's default context: its positions, capped by
        what fits this machine (``train.context.hf_default_seq``)."""
        return hf_default_seq(self.gpt, self.data.batch, self.runtime.precision, self.finetune)

