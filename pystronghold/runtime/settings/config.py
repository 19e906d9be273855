"""Options of the layer-window runtime (what ``pystronghold.wrap`` accepts besides model and blocks).

``RuntimeConfig`` is the one declaration of these settings: ``pystronghold train`` composes it into
``TrainConfig`` and ``pystronghold plan`` into ``PlanRequest``, and their options are generated from
its fields (``pystronghold.options``: the metadata gives the flag, help and how the text is read).
"""

from __future__ import annotations

from dataclasses import dataclass

from pystronghold.options import ConfigError, option, parse_bytes
from pystronghold.parallel.groups import ParallelGroups
from pystronghold.optim.hyper import AdamW
from pystronghold.settings.precision import DTYPES

__all__ = ["RuntimeConfig", "ResolvedModes", "OVERLAP_MODES", "CLIP_MODES", "NVME_STATES", "SCHEDULES",
           "OFFLOAD_AUTO_FRACTION", "offload_in_effect"]

OVERLAP_MODES = ("auto", "backward", "forward", "none")
CLIP_MODES = ("after-norm", "speculative", "auto")
NVME_STATES = ("auto", "all")
SCHEDULES = ("default", "relay", "auto")


def _window_from_text(text: str, flag: str) -> int | str:
    """``--window``, ``--resident-blocks``: a number as an int; 'all' and 'auto' (and anything else,
    refused by ``RuntimeConfig``) as they are."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _offload_from_text(text: str, flag: str) -> bool | int | str:
    """``--offload-activations``: 'on' (True), 'off' (False), 'auto' or a size in bytes (``parse_bytes``)."""
    words = {"on": True, "off": False, "auto": "auto"}
    if text.strip().lower() in words:
        return words[text.strip().lower()]
    try:
        return parse_bytes(text, flag)
    except ValueError:
        raise ValueError(f"{flag} must be 'on', 'off', 'auto' or a size in bytes like 12e9, 8G or 8GiB, "
                         f"got {text!r}") from None


OFFLOAD_AUTO_FRACTION = 0.25
"""``offload_block_inputs="auto"`` keeps saved block inputs on a CUDA device up to this fraction of
its memory per pass and offloads the rest (``pystronghold train`` asks the planner instead when it
knows the device budget)."""


def offload_in_effect(config: "RuntimeConfig", device_total_bytes: int | None) -> bool | int:
    """``config.offload_block_inputs`` with "auto" resolved: False where offload does not apply
    (no recompute, the relay schedule, or the CPU backend, ``device_total_bytes`` None: its
    "device" is host memory), else ``OFFLOAD_AUTO_FRACTION`` of ``device_total_bytes``, in bytes."""
    offload = config.offload_block_inputs
    if offload != "auto":
        return offload
    if not config.checkpointing or config.schedule_mode == "relay" or device_total_bytes is None:
        return False
    return int(OFFLOAD_AUTO_FRACTION * device_total_bytes)


def _norm_from_text(text: str, flag: str) -> float | None:
    """``--clip``: a float, 0 meaning no clipping (None)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number, got {text!r}") from None
    return None if value == 0 else value


HEAD_TAIL_PLACES = {"host": True, "device": False, "auto": "auto"}
"""``--head-tail`` values and the ``head_tail_on_host`` value of each."""


def _head_tail_from_text(text: str, flag: str) -> bool | str:
    """``--head-tail host|device|auto`` as ``head_tail_on_host`` True, False or "auto"."""
    try:
        return HEAD_TAIL_PLACES[text.strip()]
    except KeyError:
        raise ValueError(f"{flag} must be one of {', '.join(HEAD_TAIL_PLACES)}, got {text!r}") from None


@dataclass(frozen=True, slots=True)
class ResolvedModes:
    """The modes of a ``RuntimeConfig`` with "auto" resolved, taken once when an engine is built."""

    overlap: str
    """When host updates run: "backward", "forward" or "none" (``RuntimeConfig.overlap_mode``)."""
    schedule: str
    """How accumulation runs: "default" or "relay" (``RuntimeConfig.schedule_mode``)."""
    speculative: bool = False
    """Streamed blocks update during backward before the global gradient norm is known
    (``RuntimeConfig.clip_mode``; overlap is then "backward")."""


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the engine trains. Validated on construction (``ConfigError``, a ValueError naming the
    field: ``RuntimeConfig.window`` here, ``--window`` from the command line)."""

    window: int | str = option(2, parse=_window_from_text, metavar="N|all|auto", help=(
        "Blocks on the device at once (W >= 1), 'all', or 'auto' (the planner's choice, the smallest W "
        "that hides the transfers; train measures the block times on this machine before the first step)."))
    """Blocks resident on the device at once (W), "all", or "auto". W > number of blocks is clamped to
    it with a warning; W < 1 is an error. "auto" is chosen before ``wrap`` from measured block times
    (``pystronghold train --window auto``; ``pystronghold plan`` predicts it); ``wrap`` itself takes
    an int or "all"."""
    device: str = option("cpu", help="'cpu' (the device is a budgeted host arena) or 'cuda[:n]'.")
    """Where compute runs: "cpu" (the device is a budgeted host arena) or "cuda[:n]"."""
    precision: str = option("fp32", choices=tuple(DTYPES),
                            help="Compute precision (the optimizer keeps fp32 masters).")
    """Compute precision: "fp32", "bf16" or "fp16" (fp16 uses dynamic loss scaling)."""
    optimizer: AdamW = option(default_factory=AdamW, cli=False)
    """AdamW hyper-parameters; ``engine.optimizer.param_groups`` hold the live values (see AdamW.decay)."""
    clip_grad_norm: float | None = option(None, flag="--clip", parse=_norm_from_text, none_text="0",
                                          help="Clip the global gradient norm to this value; 0: no clipping.")
    """Clip the global L2 norm over head, blocks and tail to this value; None: no clipping."""
    accumulation_steps: int = option(1, flag="--accumulation", help="Micro-batches per optimizer step.")
    """Micro-batches (backward passes) per optimizer step; updates run after the last one only."""
    checkpointing: bool = option(True, help=(
        "Recompute blocks in backward (--no-checkpointing keeps every activation)."))
    """Recompute each streamed block in backward (saving only its inputs); False keeps its activations."""
    resident_blocks: int | str = option(0, parse=_window_from_text, metavar="K|auto", help=(
        "K: the first K blocks stay on the device with a device AdamW (no streaming, no host update); "
        "the others stream through the window. 0: every block streams (with --window auto: the planner "
        "chooses K). 'auto': the planner chooses K (plan; train with --window auto)."))
    """K: the first K blocks stay on the device for good, with their fp32 masters and AdamW moments
    there, updated by a device ``torch.optim.AdamW`` (fused on CUDA) in ``step()``: no load, no
    copy-out, no host update. The other blocks stream through the W slots. 0: every block streams;
    K = number of blocks with ``window="all"`` and no recompute is plain PyTorch, step for step.
    "auto": the planner chooses K, the resident recompute and W together (``planner.plan.choose_split``):
    ``pystronghold plan`` predicts it, ``pystronghold train --window auto`` measures this machine
    first (there 0 also leaves K to the planner); ``wrap`` itself takes an int."""
    resident_recompute: bool = False
    """Recompute the resident blocks in backward too (torch.utils.checkpoint); False (default): they
    keep their activations, as plain PyTorch does."""
    head_tail_on_host: bool | str = option(False, flag="--head-tail", parse=_head_tail_from_text,
                                           metavar="host|device|auto", help=(
        "Where the head and tail (embedding, final norm, LM head) keep their fp32 masters and AdamW moments: "
        "'host' (updated by the host Adam; the device keeps their compute-precision values and gradients), "
        "'device', or 'auto': host only when the run would not fit the device without (`train` asks the planner, "
        "see --device-budget-mb; without a device budget: when they would take over 1/8 of a CUDA device)."))
    """True: the head and tail's fp32 masters and AdamW moments live in host memory (pinned on
    CUDA) and the fused CPU Adam updates them at ``step()``; the device keeps only their values and
    gradients in the compute dtype (``runtime/optimizer/head_tail.py``). False: on the device, updated by a
    device AdamW. "auto": ``head_tail.head_tail_on_host``'s rule (host when they would take more
    than 1/8 of a CUDA device; the CPU backend: device). The same results either way."""
    overlap: str = option("auto", choices=OVERLAP_MODES)
    """When host updates run: "backward" (block i as soon as its gradient is on the host),
    "forward" (after backward, block 0, 1, ... ahead of the next forward's loads), "none" (inside
    ``step()``), or "auto": backward unless clipping or fp16 needs the whole gradient first."""
    clip_mode: str = option("after-norm", choices=CLIP_MODES, help=(
        "With --clip or fp16: 'after-norm' (each streamed block's host AdamW waits for the global gradient norm) "
        "or 'speculative' (it runs during backward assuming no clipping; a step that clips or overflows is undone "
        "from a host copy of the pre-step states and redone exactly; costs 12 B/param plus the compute-dtype copy), "
        "or 'auto' (speculative when that copy fits in host memory beside the store without moving more to disk)."))
    """How a step that needs the global gradient norm (clipping, fp16) updates streamed blocks:
    "after-norm" (after backward, ahead of the next forward) or "speculative" (during backward with
    clip coefficient 1; a step whose coefficient is below 1, or that overflows, restores the saved
    pre-step master, moments and shadow and redoes the update with the true coefficient, the same
    arithmetic as "after-norm", so results are bit-identical), or "auto": speculative when, with
    ``overlap="auto"``, its host copy (``updates.undo_bytes``) fits the host budget beside the store
    without putting more of it on disk (decided at build, ``ResolvedModes.speculative``)."""
    schedule: str = option("default", choices=SCHEDULES, help=(
        "How the --accumulation micro-batches run: 'default' (one after the other: every streamed block is "
        "loaded once per micro-batch), 'relay' (layer-major, L2L's: each block runs every micro-batch while "
        "it is loaded, so it crosses the link once per step; the same results) or 'auto' (relay when "
        "--accumulation > 1)."))
    """How accumulation runs its micro-batches: "default" (micro-batch-major: every streamed block is
    loaded m times in forward and m times in backward per step), "relay" (layer-major, L2L's:
    through ``engine.accumulate``, each block is loaded once per pass and its gradient leaves the
    device once; ``runtime/streaming/relay.py``) or "auto" (relay when ``accumulation_steps`` > 1: the same
    compute, m times fewer link bytes; ``planner/relay.py``). Both give the same results."""
    relay_activation_bytes: int | None = option(None, flag="--relay-activations", metavar="BYTES",
                                                parse=parse_bytes, help=(
        "--schedule relay: device bytes the saved block inputs of a step may use (e.g. 2G); those beyond "
        "are staged through host memory. Default: all on the device."))
    """schedule="relay": device bytes the saved block inputs of a pass (every block's input for
    every micro-batch, m times the default schedule's) may use; those beyond are staged through
    (pinned) host memory and brought back before their block's backward. None: all on the device."""
    offload_block_inputs: bool | int | str = option(False, flag="--offload-activations", metavar="on|off|auto|BYTES",
                                                    parse=_offload_from_text, help=(
        "Copy each recomputed block's saved input to host memory while the next block computes, and back "
        "ahead of its backward (the same results): 'on' for every block, BYTES to keep that many on the "
        "device and offload the rest, 'off', or 'auto': only when the run would not fit the device without "
        "(the planner decides; see --device-budget-mb). Not with --schedule relay (see --relay-activations)."))
    """The default schedule's input offload (``runtime/streaming/saved_inputs.py``): each recomputed block's
    saved input (what this forward made, never a user's tensor, a parameter or a tensor made
    without a graph) is copied to (pinned) host memory by the copy engine after the block's compute
    and its device memory given up once the copy is done; in backward it is brought back one block
    ahead of its recompute. False: all stay on the device; True: all offloaded; an int: device
    bytes they may hold in a pass (the first blocks' stay), the rest offloaded; "auto":
    ``offload_in_effect``'s rule. Bit-identical to False. Needs ``checkpointing``; the relay schedule
    stages by ``relay_activation_bytes`` instead.
    The staged bytes use host memory beyond ``host_memory_bytes``."""
    layer_drop: float = option(0.0, help=(
        "Probability that a streamed block is skipped in a training step (LayerDrop; the block is the "
        "identity, neither loaded nor updated that step). 0: every block runs."))
    """LayerDrop-style stochastic depth (Fan et al. 2019): the probability that a streamed block is
    skipped in a training step (all its micro-batches; identity: the block's first argument is
    passed on). A skipped block is neither loaded nor updated that step (``runtime/streaming/layer_drop.py``).
    0: every block runs."""
    layer_drop_seed: int = 0
    """Seed of the generator that draws the skipped blocks (one draw per step, reproducible)."""
    strict: bool = False
    """Poison released slots with NaN, so a missing wait shows up as wrong numbers; and compare each
    recomputed block output with a checksum of its forward output (raises with the block index)."""
    trace: bool = False
    """Record every action in ``engine.trace`` (a pystronghold.runtime.tracing.trace.Tracer)."""
    host_memory_bytes: int | None = option(None, flag="--host-memory", metavar="BYTES", parse=parse_bytes, help=(
        "Host memory the block states (and, on --device cpu, the window, head and tail) may use, e.g. "
        "8G, 8GiB, 12e9 bytes; default: 85% of what the host has available. With --nvme, states that do "
        "not fit go to disk."))
    """Host memory budget for the store (and, on CPU, the device arena, head and tail), in bytes;
    default: 85% of what the host has available (MemAvailable; the rest is for activations, Python
    and torch). With ``nvme_dir`` the states that do not fit go to disk
    (``pystronghold.runtime.memory.placement``); without it a store larger than this is refused."""
    nvme_dir: str | None = option(None, flag="--nvme", metavar="DIR", help=(
        "Directory for block states the host memory cannot hold (a scratch subdirectory is made there "
        "and removed at the end; it is never needed to resume: checkpoints are separate)."))
    """Directory for the file (NVMe) tier: a scratch subdirectory is made in it for the block states
    the host budget cannot hold, and removed on ``close()``. None: everything in host memory."""
    nvme_states: str = option("auto", choices=NVME_STATES, help=(
        "'auto': only what --host-memory cannot hold goes to disk; 'all': every block state."))
    """"auto": only what the host budget cannot hold goes to disk; "all": every state of every block
    (tests, benchmarks)."""
    nvme_cache_blocks: int = option(4, help="Blocks of disk states staged in host memory at once.")
    """Blocks the host cache of the file tier stages at once (each one block's disk states)."""
    nvme_preallocate: bool = option(True, flag="--nvme-sparse", negated=True, help=(
        "Do not reserve the NVMe tier's disk space at the start (its files grow as states are first "
        "written; a disk that fills up then fails the run at that write, naming the directory)."))
    """Reserve the tier's disk space at start (a full disk then fails before the first step)."""
    copy_threads: int = 2
    """Worker threads of the copy engine."""
    init_threads: int = 0
    """Threads that materialize meta blocks (``materialize``) ahead of the store's fill. 0: one per
    core when the model declares its ``materialize_block_`` thread-safe (``GPT`` does: every
    parameter draws from its own generator, so the values do not depend on scheduling), else 1.
    A ``materialize=`` function runs in parallel only when this asks for it (> 1)."""
    parallel: ParallelGroups | None = option(None, cli=False)
    """Tensor/data-parallel layout (``pystronghold.parallel.init_parallel``). Each block's gradient
    is averaged over ``dp_group`` before its update (head and tail too), the clipping norm sums
    tensor-parallel shards over ``tp_group``, and fp16 overflow skips are agreed by every rank.
    None: one process."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: first loss scale."""
    loss_scale_interval: int = 2000
    """fp16 only: clean steps before the loss scale doubles."""
    max_skipped_steps: int = option(20, help=(
        "fp16: stop (one line, exit status 1) after this many steps in a row skipped for inf/NaN gradients; "
        "the run also stops when they overflow at the loss scale's floor, 1."))
    """fp16 only: ``DivergenceError`` after this many consecutive steps skipped for an overflow (each
    halves the loss scale: 20 of them, a millionth of it). The run also stops at an overflow with
    the scale at its floor, 1, whatever this says. >= 1."""

    def __post_init__(self) -> None:
        if self.window not in ("all", "auto") and (not isinstance(self.window, int) or isinstance(self.window, bool)):
            raise ConfigError(self, "window", f"must be an int >= 1, 'all' or 'auto', got {self.window!r}")
        if isinstance(self.window, int) and self.window < 1:
            raise ConfigError(self, "window", f"must be >= 1, got {self.window}")
        self._check_device()
        if self.precision not in DTYPES:
            raise ConfigError(self, "precision", f"must be one of {sorted(DTYPES)}, got {self.precision!r}")
        if not isinstance(self.optimizer, AdamW):
            raise ConfigError(self, "optimizer", f"must be pystronghold.AdamW(...), got {self.optimizer!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(self, "clip_grad_norm",
                              f"must be > 0 (`clip_grad_norm=None`: no clipping), got {self.clip_grad_norm!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(self, "accumulation_steps", f"must be an int >= 1, got {self.accumulation_steps!r}")
        if self.head_tail_on_host != "auto" and not isinstance(self.head_tail_on_host, bool):
            raise ConfigError(self, "head_tail_on_host", f"must be True, False or 'auto', got {self.head_tail_on_host!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ConfigError(self, "overlap", f"must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if self.clip_mode not in CLIP_MODES:
            raise ConfigError(self, "clip_mode", f"must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.clip_mode == "speculative" and self.overlap not in ("auto", "backward"):
            raise ConfigError(self, "clip_mode=",
                              f"updates during backward; it cannot run with `overlap={self.overlap!r}`")
        if self.overlap == "backward" and self.needs_global_grad and self.clip_mode != "speculative":
            raise ConfigError(self, "overlap=", "cannot be exact with `clip_grad_norm` or fp16 loss scaling "
                              "(they need the whole gradient first); use 'forward' or 'auto', "
                              "or `clip_mode='speculative'`")
        self._check_relay_and_layer_drop()
        if self.parallel is not None and not isinstance(self.parallel, ParallelGroups):
            raise ConfigError(self, "parallel", f"must be a ParallelGroups (from init_parallel) or None, "
                              f"got {self.parallel!r}")
        if self.nvme_states not in NVME_STATES:
            raise ConfigError(self, "nvme_states", f"must be 'auto' or 'all', got {self.nvme_states!r}")
        if self.nvme_states == "all" and self.nvme_dir is None:
            raise ConfigError(self, "nvme_states=", "needs `nvme_dir` (where the states go)")
        if not isinstance(self.nvme_cache_blocks, int) or self.nvme_cache_blocks < 1:
            raise ConfigError(self, "nvme_cache_blocks", f"must be an int >= 1, got {self.nvme_cache_blocks!r}")
        if self.host_memory_bytes is not None and (not isinstance(self.host_memory_bytes, int)
                                                   or self.host_memory_bytes <= 0):
            raise ConfigError(self, "host_memory_bytes", f"must be a positive int (bytes) or None, "
                              f"got {self.host_memory_bytes!r}")
        if self.nvme_dir is not None:
            self.nvme_dir = str(self.nvme_dir)
        if type(self.init_threads) is not int or self.init_threads < 0:
            raise ConfigError(self, "init_threads", f"must be an int >= 0, got {self.init_threads!r}")
        if self.resident_blocks != "auto" and (not isinstance(self.resident_blocks, int)
                                               or isinstance(self.resident_blocks, bool) or self.resident_blocks < 0):
            raise ConfigError(self, "resident_blocks", f"must be an int >= 0 or 'auto', got {self.resident_blocks!r}")
        if not self.initial_loss_scale >= 1:
            raise ConfigError(self, "initial_loss_scale", f"must be >= 1 (the loss scale's floor), "
                              f"got {self.initial_loss_scale!r}")
        if type(self.max_skipped_steps) is not int or self.max_skipped_steps < 1:
            raise ConfigError(self, "max_skipped_steps", f"must be an int >= 1, got {self.max_skipped_steps!r}")
        if self.copy_threads < 1:
            raise ConfigError(self, "copy_threads", f"must be >= 1, got {self.copy_threads}")

    def _check_relay_and_layer_drop(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(self, "schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.relay_activation_bytes is not None and (type(self.relay_activation_bytes) is not int
                                                        or self.relay_activation_bytes < 0):
            raise ConfigError(self, "relay_activation_bytes", f"must be an int >= 0 (bytes) or None, "
                              f"got {self.relay_activation_bytes!r}")
        offload = self.offload_block_inputs
        if offload != "auto" and not isinstance(offload, bool) and (type(offload) is not int or offload < 0):
            raise ConfigError(self, "offload_block_inputs", f"must be True, False, 'auto' or an int >= 0 "
                              f"(device bytes), got {offload!r}")
        # "auto" applies only where it can (offload_in_effect)
        if offload is not False and offload != "auto" and not self.checkpointing:
            raise ConfigError(self, "offload_block_inputs", "needs `checkpointing` (without recompute a block "
                              "keeps all its activations, not just its input)")
        if offload is not False and offload != "auto" and self.schedule_mode == "relay":
            raise ConfigError(self, "offload_block_inputs", "applies to the default schedule; the relay "
                              "schedule stages saved block inputs beyond `relay_activation_bytes` bytes")
        if isinstance(self.layer_drop, bool) or not isinstance(self.layer_drop, (int, float)) \
                or not 0 <= self.layer_drop < 1:
            raise ConfigError(self, "layer_drop", f"must be a probability in [0, 1), got {self.layer_drop!r}")
        if self.layer_drop and self.resident_blocks:
            raise ConfigError(self, "layer_drop", "skips streamed blocks only; it cannot be combined with "
                              f"`resident_blocks={self.resident_blocks}`")
        if type(self.layer_drop_seed) is not int:
            raise ConfigError(self, "layer_drop_seed", f"must be an int, got {self.layer_drop_seed!r}")

    def _check_device(self) -> None:
        d = self.device
        if not isinstance(d, str) or not (d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ConfigError(self, "device", f"must be 'cpu' or 'cuda[:n]', got {d!r}")

    def check_device_present(self) -> None:
        """Raise ConfigError when ``device`` names a CUDA device this machine does not have. Not part
        of validation (the value is fine, the machine lacks it; ``wrap`` then fails in the CUDA
        backend with a RuntimeError): ``pystronghold train`` calls it to fail before any long work."""
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(self, "device=", ": CUDA is not available on this machine")
            if (int(self.device[5:]) if ":" in self.device else 0) >= torch.cuda.device_count():
                raise ConfigError(self, "device=", f": only {torch.cuda.device_count()} CUDA device(s)")

    @property
    def needs_global_grad(self) -> bool:
        """True when the whole gradient must be known before any update (clipping, fp16)."""
        return self.clip_grad_norm is not None or self.precision == "fp16"

    @property
    def overlap_mode(self) -> str:
        """The overlap mode in effect ("backward", "forward" or "none")."""
        if self.overlap != "auto":
            return self.overlap
        return "forward" if self.needs_global_grad and self.clip_mode != "speculative" else "backward"

    @property
    def speculative(self) -> bool:
        """True when streamed blocks update during backward before the global gradient norm is known
        (``clip_mode="speculative"`` with clipping or fp16), undone and redone when the step clips."""
        return self.needs_global_grad and self.clip_mode == "speculative"

    @property
    def schedule_mode(self) -> str:
        """The accumulation schedule in effect ("default" or "relay"; "auto": relay when
        ``accumulation_steps`` > 1)."""
        if self.schedule != "auto":
            return self.schedule
        return "relay" if self.accumulation_steps > 1 else "default"

    def resolved_modes(self) -> ResolvedModes:
        """``overlap_mode`` and ``schedule_mode`` together, as the engine's parts are handed them."""
        return ResolvedModes(overlap=self.overlap_mode, schedule=self.schedule_mode, speculative=self.speculative)
