"""Options of the layer-window runtime (what ``pystronghold.wrap`` accepts besides model and blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pystronghold.parallel.groups import ParallelGroups
from pystronghold.runtime.optimizer import AdamW
from pystronghold.runtime.precision import DTYPES

__all__ = ["RuntimeConfig", "OVERLAP_MODES", "SCHEDULES"]

OVERLAP_MODES = ("auto", "backward", "forward", "none")
SCHEDULES = ("default", "relay")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the engine trains. Validated on construction (ValueError naming the field)."""

    window: int | str = 2
    """Blocks resident on the device at once (W), or "all". W > number of blocks is clamped to it
    with a warning; W < 1 is an error."""
    device: str = "cpu"
    """Where compute runs: "cpu" (the device is a budgeted host arena) or "cuda[:n]"."""
    precision: str = "fp32"
    """Compute precision: "fp32", "bf16" or "fp16" (fp16 uses dynamic loss scaling)."""
    optimizer: AdamW = field(default_factory=AdamW)
    """AdamW hyper-parameters; ``engine.optimizer.param_groups`` hold the live values (see AdamW.decay)."""
    clip_grad_norm: float | None = None
    """Clip the global L2 norm over head, blocks and tail to this value; None: no clipping."""
    accumulation_steps: int = 1
    """Micro-batches (backward passes) per optimizer step; updates run after the last one only."""
    checkpointing: bool = True
    """Recompute each streamed block in backward (saving only its inputs); False keeps its activations."""
    resident_blocks: int = 0
    """K: the first K blocks stay on the device for good, with their fp32 masters and AdamW moments
    there, updated by a device ``torch.optim.AdamW`` (fused on CUDA) in ``step()``: no load, no
    copy-out, no host update. The other blocks stream through the W slots. 0: every block streams;
    K = number of blocks with ``window="all"`` and no recompute is plain PyTorch, step for step."""
    resident_recompute: bool = False
    """Recompute the resident blocks in backward too (torch.utils.checkpoint); False (default): they
    keep their activations, as plain PyTorch does."""
    overlap: str = "auto"
    """When host updates run: "backward" (block i as soon as its gradient is on the host),
    "forward" (after backward, block 0, 1, ... ahead of the next forward's loads), "none" (inside
    ``step()``), or "auto": backward unless clipping or fp16 needs the whole gradient first."""
    schedule: str = "default"
    """How accumulation runs its micro-batches: "default" (micro-batch-major: every streamed block is
    loaded m times in forward and m times in backward per step) or "relay" (layer-major, L2L's:
    through ``engine.accumulate``, each block is loaded once per pass and its gradient leaves the
    device once; ``runtime/relay.py``). Both give the same results."""
    relay_activation_bytes: int | None = None
    """schedule="relay": device bytes the saved block inputs of a pass (every block's input for
    every micro-batch, m times the default schedule's) may use; those beyond are staged through
    (pinned) host memory and brought back before their block's backward. None: all on the device."""
    layer_drop: float = 0.0
    """LayerDrop-style stochastic depth (Fan et al. 2019): the probability that a streamed block is
    skipped in a training step (all its micro-batches; identity: the block's first argument is
    passed on). A skipped block is neither loaded nor updated that step. 0: every block runs."""
    layer_drop_seed: int = 0
    """Seed of the generator that draws the skipped blocks (one draw per step, reproducible)."""
    strict: bool = False
    """Poison released slots with NaN, so a missing wait shows up as wrong numbers; and compare each
    recomputed block output with a checksum of its forward output (raises with the block index)."""
    trace: bool = False
    """Record every action in ``engine.trace`` (a pystronghold.trace.Tracer)."""
    host_memory_bytes: int | None = None
    """Host memory budget for the store (and, on CPU, the device arena, head and tail), in bytes;
    default: 85% of what the host has available (MemAvailable; the rest is for activations, Python
    and torch). With ``nvme_dir`` the states that do not fit go to disk
    (``pystronghold.runtime.placement``); without it a store larger than this is refused."""
    nvme_dir: str | None = None
    """Directory for the file (NVMe) tier: a scratch subdirectory is made in it for the block states
    the host budget cannot hold, and removed on ``close()``. None: everything in host memory."""
    nvme_states: str = "auto"
    """"auto": only what the host budget cannot hold goes to disk; "all": every state of every block
    (tests, benchmarks)."""
    nvme_cache_blocks: int = 4
    """Blocks the host cache of the file tier stages at once (each one block's disk states)."""
    nvme_preallocate: bool = True
    """Reserve the tier's disk space at start (a full disk then fails before the first step)."""
    copy_threads: int = 2
    """Worker threads of the copy engine."""
    init_threads: int = 0
    """Threads that materialize meta blocks (``materialize``) ahead of the store's fill. 0: one per
    core when the model declares its ``materialize_block_`` thread-safe (``GPT`` does: every
    parameter draws from its own generator, so the values do not depend on scheduling), else 1.
    A ``materialize=`` function runs in parallel only when this asks for it (> 1)."""
    parallel: ParallelGroups | None = None
    """Tensor/data-parallel layout (``pystronghold.parallel.init_parallel``). Each block's gradient
    is averaged over ``dp_group`` before its update (head and tail too), the clipping norm sums
    tensor-parallel shards over ``tp_group``, and fp16 overflow skips are agreed by every rank.
    None: one process."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: first loss scale."""
    loss_scale_interval: int = 2000
    """fp16 only: clean steps before the loss scale doubles."""

    def __post_init__(self) -> None:
        if self.window != "all" and (not isinstance(self.window, int) or isinstance(self.window, bool)):
            raise ValueError(f"RuntimeConfig.window must be an int >= 1 or 'all', got {self.window!r}")
        if isinstance(self.window, int) and self.window < 1:
            raise ValueError(f"RuntimeConfig.window must be >= 1, got {self.window}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"RuntimeConfig.device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.precision not in DTYPES:
            raise ValueError(f"RuntimeConfig.precision must be one of {sorted(DTYPES)}, got {self.precision!r}")
        if not isinstance(self.optimizer, AdamW):
            raise ValueError(f"RuntimeConfig.optimizer must be pystronghold.AdamW(...), got {self.optimizer!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"RuntimeConfig.clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"RuntimeConfig.accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"RuntimeConfig.overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if self.overlap == "backward" and self.needs_global_grad:
            raise ValueError("RuntimeConfig.overlap='backward' cannot be exact with clip_grad_norm or "
                             "fp16 loss scaling (they need the whole gradient first); use 'forward' or 'auto'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RuntimeConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.relay_activation_bytes is not None and (type(self.relay_activation_bytes) is not int
                                                        or self.relay_activation_bytes < 0):
            raise ValueError(f"RuntimeConfig.relay_activation_bytes must be an int >= 0 (bytes) or None, "
                             f"got {self.relay_activation_bytes!r}")
        if not isinstance(self.layer_drop, (int, float)) or not 0 <= self.layer_drop < 1:
            raise ValueError(f"RuntimeConfig.layer_drop must be a probability in [0, 1), got {self.layer_drop!r}")
        if self.layer_drop and self.resident_blocks:
            raise ValueError("RuntimeConfig.layer_drop skips streamed blocks only; it cannot be combined with "
                             f"resident_blocks={self.resident_blocks}")
        if type(self.layer_drop_seed) is not int:
            raise ValueError(f"RuntimeConfig.layer_drop_seed must be an int, got {self.layer_drop_seed!r}")
        if self.parallel is not None and not isinstance(self.parallel, ParallelGroups):
            raise ValueError(f"RuntimeConfig.parallel must be a ParallelGroups (from init_parallel) or "
                             f"None, got {self.parallel!r}")
        if self.nvme_states not in ("auto", "all"):
            raise ValueError(f"RuntimeConfig.nvme_states must be 'auto' or 'all', got {self.nvme_states!r}")
        if self.nvme_states == "all" and self.nvme_dir is None:
            raise ValueError("RuntimeConfig.nvme_states='all' needs nvme_dir (where the states go)")
        if not isinstance(self.nvme_cache_blocks, int) or self.nvme_cache_blocks < 1:
            raise ValueError(f"RuntimeConfig.nvme_cache_blocks must be an int >= 1, got {self.nvme_cache_blocks!r}")
        if self.host_memory_bytes is not None and (not isinstance(self.host_memory_bytes, int)
                                                   or self.host_memory_bytes <= 0):
            raise ValueError(f"RuntimeConfig.host_memory_bytes must be a positive int (bytes) or None, "
                             f"got {self.host_memory_bytes!r}")
        if self.nvme_dir is not None:
            self.nvme_dir = str(self.nvme_dir)
        if type(self.init_threads) is not int or self.init_threads < 0:
            raise ValueError(f"RuntimeConfig.init_threads must be an int >= 0, got {self.init_threads!r}")
        if not isinstance(self.resident_blocks, int) or isinstance(self.resident_blocks, bool) \
                or self.resident_blocks < 0:
            raise ValueError(f"RuntimeConfig.resident_blocks must be an int >= 0, got {self.resident_blocks!r}")
        if self.copy_threads < 1:
            raise ValueError(f"RuntimeConfig.copy_threads must be >= 1, got {self.copy_threads}")

    @property
    def needs_global_grad(self) -> bool:
        """True when the whole gradient must be known before any update (clipping, fp16)."""
        return self.clip_grad_norm is not None or self.precision == "fp16"

    @property
    def overlap_mode(self) -> str:
        """The overlap mode in effect ("backward", "forward" or "none")."""
        if self.overlap != "auto":
            return self.overlap
        return "forward" if self.needs_global_grad else "backward"
