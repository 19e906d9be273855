"""Options of ``pystronghold train``: one dataclass per component, composed into ``TrainConfig``.

The runtime's settings are ``RuntimeConfig``'s (``TrainConfig.runtime``), the fine-tune's and the
parallel layout's ``settings/``'s; the classes here hold what only training has. Every field's
docstring is its ``--help`` text and ``__post_init__`` raises a ``ConfigError`` naming the field,
checking the values against each other only: what they name (the model, the files, the devices)
is read once by ``train.run.resolve``. With no options the run is the embedded demo
(``DEMO_MODEL``) on the Python standard library's sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pystronghold.nn.chunked_loss import loss_chunk_tokens
from pystronghold.options import ConfigError, component, option
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.settings.finetune import FinetuneOptions
from pystronghold.settings.parallel import ParallelOptions
from pystronghold.token_files import TOKEN_DTYPES

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
        if self.max_bytes < 1024:
            raise ConfigError(self, "max_bytes", f"must be >= 1024, got {self.max_bytes}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(self, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.batch < 1:
            raise ConfigError(self, "batch", f"must be >= 1, got {self.batch}")
        if self.seq < 0:
            raise ConfigError(self, "seq", f"must be >= 0, got {self.seq}")
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
            raise ConfigError(self, "lr", f"must be > 0 and finite, got {self.lr}")
        if self.warmup < 0:
            raise ConfigError(self, "warmup", f"must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(self, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(self, "weight_decay", f"must be >= 0 and finite, got {self.weight_decay}")
        if not 0 <= self.beta2 < 1:
            raise ConfigError(self, "beta2", f"must be in [0, 1), got {self.beta2}")


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
            raise ConfigError(self, "device_budget_mb", f"must be >= 0 and finite, got {self.device_budget_mb}")


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
                raise ConfigError(self, name, f"must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ConfigError(self, "eval_every", f"must be >= 0, got {self.eval_every}")


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
            raise ConfigError(self, "checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        if self.keep < 1:
            raise ConfigError(self, "keep", f"must be >= 1, got {self.keep}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(self, "checkpoint_every", "needs `checkpoint_dir` (there is nowhere to write checkpoints)")
        for name in ("resume", "overwrite"):
            if getattr(self, name) and not self.checkpoint_dir:
                raise ConfigError(self, name, "needs `checkpoint_dir`")
        if self.overwrite and self.resume:
            raise ConfigError(self, "overwrite", "starts a fresh run, `resume` continues one: give one of them")


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
        # NOTE: every rank runs these same checks on the same arguments and environment, so a bad
        # layout fails everywhere before any rank enters torch.distributed (nothing can hang).
        # The checks against the model, the machine and the launch's processes are
        # ``train.run.resolve``'s.
        par, rt, data = self.parallel, self.runtime, self.data
        if rt.resident_blocks == "auto" and rt.window != "auto":
            raise ConfigError(rt, "resident_blocks=", "is chosen together with the window: it needs "
                                                      "`window='auto'` (or give K, a number of blocks)")
        if par.distributed and rt.window == "auto":
            raise ConfigError(rt, "window=", "is not supported with several processes yet; give --window N")
        dp = par.dp_size
        if par.dp_split is not None:
            sizes = ",".join(str(b) for b in par.dp_split)
            if len(par.dp_split) != dp:
                raise ConfigError(par, "dp_split", f"{sizes} gives {len(par.dp_split)} replicas' samples, but "
                                  f"there are `dp={dp}`")
            if sum(par.dp_split) != data.batch:
                raise ConfigError(par, "dp_split", f"{sizes} sums to {sum(par.dp_split)} samples, not "
                                  f"--batch {data.batch}")
        elif data.batch % dp:
            raise ConfigError(data, "batch=", f"must be divisible by --dp {dp} (each replica takes an equal "
                              "slice of every batch)")
