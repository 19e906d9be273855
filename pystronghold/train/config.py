"""Options of ``pystronghold train``: one dataclass per component, composed into ``TrainConfig``.

Every field has a docstring (shown by ``--help``) and is validated in ``__post_init__`` (a
``ValueError`` naming the field). ``pystronghold/train/command.py`` generates the argparse options
from these classes. Which model ``--model`` names, and its default learning rate, is
``model_spec.py``'s. With no options at all the run is the embedded demo (``DEMO_MODEL``): a GPT
whose blocks need several times the device budget they are given, trained on the Python standard
library's sources.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from pystronghold.models import GPTConfig
from pystronghold.models.hf import HF_PREFIX, HFModelConfig
from pystronghold.train.model_spec import HF_DEFAULT_SEQ, model_lr, resolve_model

__all__ = ["ModelOptions", "DataOptions", "OptimOptions", "WindowOptions", "MemoryOptions",
           "RunOptions", "parse_bytes", "CheckpointOptions", "ParallelOptions", "TrainConfig"]

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
    """Text files or directories to train on; default: the Python standard library's sources."""
    max_bytes: int = 4 << 20
    """Most bytes of text read (training and validation together), bytes."""
    val_fraction: float = 0.05
    """Share of the text held out for the validation loss, in (0, 1)."""
    batch: int = 8
    """Sequences per micro-batch (B)."""
    seq: int = 0
    """Tokens per sequence (T); 0: the model's seq_len (hf: models: at most 512)."""

    def __post_init__(self) -> None:
        for p in self.data:
            if not os.path.exists(p):
                raise ValueError(f"--data: no such file or directory: {p}")
        if self.max_bytes < 1024:
            raise ValueError(f"--max-bytes must be >= 1024, got {self.max_bytes}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.seq < 0:
            raise ValueError(f"--seq must be >= 0, got {self.seq}")


@dataclass(kw_only=True, slots=True)
class OptimOptions:
    """AdamW, its learning-rate schedule, clipping and accumulation."""

    lr: float | None = None
    """Peak learning rate; default: the model's own. GPT-3 presets: Brown et al. 2020, Table 2.1
    (gpt3-125m 6e-4 ... gpt3-6.7b 1.2e-4, gpt3-175b 6e-5); gpt2-124m: 6e-4 (as nanoGPT and GPT-3
    Small); demo, tiny, mini, small: 2e-3; a JSON model: its "lr" key, else the GPT-3 value of the
    largest GPT-3 size it reaches (2e-3 below 125M parameters); hf:DIR: 5e-5 (Hugging Face
    Trainer's default for fine-tuning)."""
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
    clip: float = 1.0
    """Clip the global gradient norm to this value; 0: no clipping."""
    accumulation: int = 1
    """Micro-batches per optimizer step."""

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"--beta2 must be in [0, 1), got {self.beta2}")
        if self.clip < 0:
            raise ValueError(f"--clip must be >= 0, got {self.clip}")
        if self.accumulation < 1:
            raise ValueError(f"--accumulation must be >= 1, got {self.accumulation}")


@dataclass(kw_only=True, slots=True)
class WindowOptions:
    """The window runtime: where compute runs and how many blocks live there."""

    window: str = "2"
    """Blocks on the device at once (W >= 1), 'all', or 'auto' (the planner's choice from block
    times measured on this machine before the first step)."""
    device: str = "cpu"
    """'cpu' (the device is a budgeted host arena) or 'cuda[:n]'."""
    precision: str = field(default="fp32", metadata={"choices": ("fp32", "bf16", "fp16")})
    """Compute precision (the optimizer keeps fp32 masters)."""
    device_budget_mb: float = 0.0
    """window=auto only: device bytes the window may use, MiB; 0: 4 slots' worth."""
    resident_blocks: int = 0
    """K: the first K blocks stay on the device with a device AdamW (no streaming, no host update);
    the others stream through the window. 0: every block streams."""

    def __post_init__(self) -> None:
        if self.window not in ("auto", "all"):
            try:
                w = int(self.window)
            except ValueError:
                raise ValueError(f"--window must be an int >= 1, 'all' or 'auto', got {self.window!r}") from None
            if w < 1:
                raise ValueError(f"--window must be >= 1, got {w}")
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"--device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            index = int(self.device[5:]) if ":" in self.device else 0
            if not torch.cuda.is_available():
                raise ValueError(f"--device {self.device}: CUDA is not available on this machine")
            if index >= torch.cuda.device_count():
                raise ValueError(f"--device {self.device}: only {torch.cuda.device_count()} CUDA device(s)")
        if self.resident_blocks < 0:
            raise ValueError(f"--resident-blocks must be >= 0, got {self.resident_blocks}")
        if self.device_budget_mb < 0:
            raise ValueError(f"--device-budget-mb must be >= 0, got {self.device_budget_mb}")

    @property
    def window_value(self) -> int | str:
        """The window as RuntimeConfig takes it (an int or 'all'); 'auto' stays 'auto'."""
        return self.window if self.window in ("auto", "all") else int(self.window)


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """Bytes from '12e9', '8G' / '8GB' (powers of 1000) or '8GiB' (powers of 1024); ValueError
    naming ``flag`` otherwise."""
    t = text.strip().lower().removesuffix("b")
    unit = next((u for u in sorted(_BYTE_UNITS, key=len, reverse=True) if u and t.endswith(u)), "")
    try:
        value = float(t[:len(t) - len(unit)] if unit else t) * _BYTE_UNITS[unit]
    except ValueError:
        raise ValueError(f"{flag} must be a size in bytes like 12e9, 8G or 8GiB, got {text!r}") from None
    if not value >= 1:
        raise ValueError(f"{flag} must be at least 1 byte, got {text!r}")
    return int(value)


@dataclass(kw_only=True, slots=True)
class MemoryOptions:
    """Host memory and the NVMe tier."""

    host_memory: str | None = field(default=None, metadata={"metavar": "BYTES"})
    """Host memory the block states (and, on --device cpu, the window, head and tail) may use, e.g.
    8G, 8GiB, 12e9 bytes; default: 85% of what the host has available. With --nvme, states that do
    not fit go to disk."""
    nvme: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Directory for block states the host memory cannot hold (a scratch subdirectory is made there
    and removed at the end; it is never needed to resume: checkpoints are separate)."""
    nvme_states: str = field(default="auto", metadata={"choices": ("auto", "all")})
    """'auto': only what --host-memory cannot hold goes to disk; 'all': every block state."""
    nvme_cache_blocks: int = 4
    """Blocks of disk states staged in host memory at once."""
    nvme_sparse: bool = False
    """Do not reserve the NVMe tier's disk space at the start (its files grow as states are first
    written; a disk that fills up then fails the run at that write, naming the directory)."""

    def __post_init__(self) -> None:
        if self.host_memory is not None:
            parse_bytes(self.host_memory, "--host-memory")
        if self.nvme_states == "all" and self.nvme is None:
            raise ValueError("--nvme-states all needs --nvme DIR")
        if self.nvme is not None:
            from pystronghold.io.scratch import check_io_directory

            check_io_directory(self.nvme, flag="--nvme")  # exists (or is created) and takes files
        if self.nvme_cache_blocks < 1:
            raise ValueError(f"--nvme-cache-blocks must be >= 1, got {self.nvme_cache_blocks}")

    @property
    def host_memory_bytes(self) -> int | None:
        """--host-memory in bytes (None: not given)."""
        return None if self.host_memory is None else parse_bytes(self.host_memory, "--host-memory")


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
    """Also write every metrics line as one JSON object per line (JSONL) to this file (appended
    to on --resume)."""
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
        if self.metrics_file is not None:
            parent = os.path.dirname(os.path.abspath(self.metrics_file))
            if os.path.isdir(self.metrics_file) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
                raise ValueError(f"--metrics-file {self.metrics_file}: not a file in a writable directory")
        if self.tensorboard is not None:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError("--tensorboard needs the 'tensorboard' package (pip install tensorboard)")


@dataclass(kw_only=True, slots=True)
class CheckpointOptions:
    """Where and how often the run is saved, and whether it continues a saved one."""

    checkpoint_dir: str | None = None
    """Directory of checkpoints (one sub-directory per saved step); none: no checkpoints."""
    checkpoint_every: int = 0
    """Steps between checkpoints (one is always written at the end); 0: only at the end."""
    keep: int = 2
    """Most recent checkpoints kept (older ones are deleted after a new one is complete)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in --checkpoint-dir."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1, got {self.keep}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.checkpoint_dir:
            d = os.path.abspath(self.checkpoint_dir)
            probe = d
            while not os.path.exists(probe):
                probe = os.path.dirname(probe)
            if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
                raise ValueError(f"--checkpoint-dir {self.checkpoint_dir}: {probe} is not a writable directory")


@dataclass(kw_only=True, slots=True)
class ParallelOptions:
    """Tensor, data and pipeline parallelism (launch with torchrun --nproc-per-node PP*TP*DP)."""

    tp: int = 1
    """Tensor-parallel ranks per model replica (attention heads, MLP columns and vocabulary split)."""
    dp: int = 0
    """Data-parallel replicas, each fed its slice of every batch; 0: the world size / (--tp x --pp)."""
    pp: int = 1
    """Pipeline stages the blocks are split across (balanced by compute, each with its own window)."""
    micro_batches: int = 0
    """Micro-batches each replica's batch is cut into for the pipeline; 0: --pp."""
    pp_schedule: str = field(default="1f1b", metadata={"choices": ("1f1b", "gpipe")})
    """Pipeline schedule (torch.distributed.pipelining's Schedule1F1B or ScheduleGPipe)."""
    dist_timeout: float = 300.0
    """Seconds a collective waits for the other ranks before the run fails."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dp < 0:
            raise ValueError(f"--dp must be >= 1 (or 0: world size / --tp), got {self.dp}")
        if self.pp < 1:
            raise ValueError(f"--pp must be >= 1, got {self.pp}")
        if self.micro_batches < 0:
            raise ValueError(f"--micro-batches must be >= 1 (or 0: --pp), got {self.micro_batches}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0, got {self.dist_timeout}")

    @property
    def world_size(self) -> int:
        """Processes of the launch (torchrun's WORLD_SIZE; 1 without a launcher)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def dp_size(self) -> int:
        """--dp in effect (0 resolved against the world size)."""
        return self.dp or max(self.world_size // (self.tp * self.pp), 1)

    @property
    def micro_batch_count(self) -> int:
        """--micro-batches in effect (0 resolved to --pp)."""
        return self.micro_batches or self.pp

    @property
    def distributed(self) -> bool:
        """Whether this run needs torch.distributed (several processes or sizes above 1)."""
        return self.world_size > 1 or self.pp * self.tp * self.dp_size > 1


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``pystronghold train`` needs."""

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    window: WindowOptions = field(default_factory=WindowOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    run: RunOptions = field(default_factory=RunOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)

    def __post_init__(self) -> None:
        cfg = resolve_model(self.model.model)
        if self.data.seq > cfg.seq_len:
            raise ValueError(f"--seq {self.data.seq} is longer than the model's seq_len {cfg.seq_len}")
        # NOTE: every rank runs these same checks on the same arguments and environment, so a bad
        # layout fails everywhere before any rank enters torch.distributed (nothing can hang).
        par = self.parallel
        tp, dp, world = par.tp, par.dp_size, par.world_size
        if isinstance(cfg, HFModelConfig) and tp > 1:
            raise ValueError(f"--tp {tp}: --model {HF_PREFIX}DIR trains with --tp 1 only")
        if isinstance(cfg, HFModelConfig) and self.window.window == "auto":
            raise ValueError(f"--window auto measures pystronghold's GPT blocks; with --model {HF_PREFIX}DIR give --window N")
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
        if self.data.batch % dp:
            raise ValueError(f"--batch {self.data.batch} must be divisible by --dp {dp} "
                             "(each replica takes an equal slice of every batch)")
        if par.distributed and self.window.window == "auto":
            raise ValueError("--window auto is not supported with several processes yet; give --window N")

    def _check_pipeline(self, cfg) -> None:
        """--pp layouts (local arithmetic: the same on every rank, before any collective)."""
        from pystronghold.parallel.pipeline import validate_pipeline

        par = self.parallel
        pp, tp, dp, world, m = par.pp, par.tp, par.dp_size, par.world_size, par.micro_batch_count
        if isinstance(cfg, HFModelConfig):
            raise ValueError(f"--pp {pp}: --model {HF_PREFIX}DIR trains with --pp 1 only")
        if pp * tp * dp != world:
            launch = (f"; launch with torchrun --nproc-per-node {pp * tp * dp} -m pystronghold train ..."
                      if world == 1 else "")
            raise ValueError(f"--pp {pp} x --tp {tp} x --dp {dp} = {pp * tp * dp} processes, but there are "
                             f"{world}{launch}")
        try:
            validate_pipeline(pp, cfg.layers, m, par.pp_schedule)
        except ValueError as err:
            raise ValueError(f"--pp {pp}: {err}".replace("micro_batches=", "--micro-batches ")) from None
        if self.data.batch % (dp * m):
            raise ValueError(f"--batch {self.data.batch} must be divisible by --dp {dp} x --micro-batches {m} "
                             "(each replica cuts its slice into equal micro-batches)")
        if self.optim.accumulation > 1:
            raise ValueError("--accumulation with --pp: the pipeline accumulates over --micro-batches; "
                             "use that instead")

    @property
    def gpt(self) -> GPTConfig | HFModelConfig:
        """The model's GPTConfig (``tp_size`` = --tp), or the HFModelConfig of --model hf:DIR."""
        cfg = resolve_model(self.model.model)
        return dataclasses.replace(cfg, tp_size=self.parallel.tp) if self.parallel.tp > 1 else cfg

    @property
    def lr(self) -> float:
        """Peak learning rate in effect: --lr, or the model's (``model_lr``)."""
        return self.optim.lr if self.optim.lr is not None else model_lr(self.model.model)

    @property
    def seq(self) -> int:
        """Tokens per sequence in effect."""
        cfg = self.gpt
        if isinstance(cfg, HFModelConfig):
            return self.data.seq or min(cfg.seq_len, HF_DEFAULT_SEQ)
        return self.data.seq or cfg.seq_len


COMPONENTS = {"model": ModelOptions, "data": DataOptions, "optim": OptimOptions, "window": WindowOptions,
              "memory": MemoryOptions, "run": RunOptions, "checkpoint": CheckpointOptions, "parallel": ParallelOptions}
"""TrainConfig's fields and their dataclasses, in --help order."""
