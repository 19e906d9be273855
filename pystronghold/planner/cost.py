"""The cost model: bytes, FLOPs and seconds of one block, of head + tail, and of one training step.

The model is a ``GPTConfig`` or a Hugging Face model's ``HFShape`` (``planner/hf_shape.py``);
what trains is ``Workload.finetune`` (``planner/trainable.py``). Everything is per tensor-parallel rank (a rank holds 1/tp of the split weights, see
``pystronghold.parallel``). The formulas are explained in ``docs/DESIGN.md`` ("The planner"). Names:
B micro-batch, T tokens per sample, C hidden, F MLP width, V padded vocabulary, a heads, t = tp,
s = bytes per element in the compute precision (4 fp32, 2 bf16/fp16), P_b = parameters of one
block on this rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pystronghold.models.gpt import GPTConfig
from pystronghold.nn.chunked_loss import loss_chunk_tokens
from pystronghold.planner.hardware import GiB, Hardware
from pystronghold.planner.params import active_matmul_numel, block_param_shapes, head_tail_param_shapes, numel
from pystronghold.planner.trainable import param_split
from pystronghold.runtime.memory import layout
from pystronghold.settings.precision import DTYPES, compute_dtype
from pystronghold.settings.finetune import FinetuneOptions

__all__ = ["Workload", "BlockCosts", "block_params_per_rank", "head_tail_params_per_rank",
           "block_forward_flops", "mlp_matmul_numel", "block_activation_bytes", "tail_activation_bytes",
           "host_bytes_per_param", "ring_allreduce_s", "block_costs", "PRECISION_BYTES",
           "OVERLAP_MODES", "INPUTS_IN_FLIGHT", "DEVICE_ADAM_BYTES", "analytic_window", "block_param_numels", "block_buffer_numel",
           "slot_bytes"]

PRECISION_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
"""Bytes per element of each compute precision."""
DEVICE_ADAM_BYTES = {"fp32": 28, "bf16": 40, "fp16": 40}
"""Device memory traffic of the fused AdamW per parameter, bytes: read master, grad, exp_avg,
exp_avg_sq and write master, exp_avg, exp_avg_sq (7 x 4); in bf16/fp16 also the fp32 copy of the
gradient (read 2, write 4) and the compute copy of the master (read 4, write 2)."""
INPUTS_IN_FLIGHT = 2
"""Saved block inputs the device holds with ``offload_block_inputs``: the one being copied out
(forward) or restored ahead of its recompute (backward) and the one in use."""
OVERLAP_MODES = ("backward", "forward")
"""When the host updates run: during backward, or after it, ahead of the next forward's loads."""


@dataclass(kw_only=True, slots=True)
class Workload:
    """How the model is trained: everything the planner needs besides the model shape and hardware."""

    batch: int = 1
    """Micro-batch per data-parallel rank, samples."""
    seq: int | None = None
    """Tokens per sample; None: the model's ``seq_len``."""
    precision: str = "bf16"
    """Compute precision: "fp32", "bf16" or "fp16"."""
    checkpointing: bool = True
    """Recompute each block in backward, keeping only its input (the runtime's default)."""
    flash_attention: bool = True
    """Attention saves no (T, T) score matrix (``scaled_dot_product_attention`` with a fused
    kernel, as the GPT model uses); False counts scores and softmax (Korthikanti et al. 2022)."""
    dropout: bool = False
    """Dropout is active (its 1-byte masks are kept); the GPT presets train without dropout."""
    dp_size: int = 1
    """Data-parallel ranks; with tp, all ``tp * dp`` ranks share one machine's host and CPUs."""
    overlap: str = "backward"
    """Host updates during backward (block i after its gradient copy-out) or "forward" (after
    backward, block 0, 1, ... ahead of the next forward; needed by clipping and fp16)."""
    compute_efficiency: float = 0.5
    """Fraction of the dense peak FLOP/s a block reaches (Megatron-LM reports 40-55% on A100)."""
    device_reserve_bytes: int = 1 * GiB
    """Device bytes the planner keeps free: CUDA context, cuBLAS workspaces, allocator slack."""
    host_reserve_bytes: int = 8 * GiB
    """Host bytes kept for the OS, Python, torch and the data loader."""
    nvme_staging_blocks: int = 4
    """Blocks whose NVMe-resident states are staged in host memory at once (read-ahead and
    write-behind of the updates)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the loss (``nn.chunked_loss``); None: the runtime's default for the
    vocabulary (``loss_chunk_tokens``, 256 MiB of fp32 logits), 0: the full logits at once."""
    finetune: FinetuneOptions = FinetuneOptions()
    """Which parameters train: all (the default), LoRA adapters on a frozen base, or all but the
    ``--freeze`` ones."""
    offload_block_inputs: bool = False
    """Recomputed blocks' saved inputs go to the host (the NVMe tier when the host is short); the
    device keeps ``sequence.INPUTS_IN_FLIGHT`` of them."""
    mlp_tile_tokens: int = 0
    """The position-wise MLP runs over tiles of this many tokens, its working set bounded by one
    tile (0: untiled)."""
    head_tail_on_host: bool = False
    """Head and tail keep fp32 masters and AdamW moments in host memory, updated by the CPU Adam;
    the device holds their compute-precision weights and gradients only."""

    def __post_init__(self) -> None:
        for name in ("batch", "dp_size", "nvme_staging_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        if self.seq is not None and (not isinstance(self.seq, int) or self.seq < 1):
            raise ValueError(f"Workload.seq must be a positive int or None, got {self.seq!r}")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"Workload.precision must be one of {sorted(PRECISION_BYTES)}, "
                             f"got {self.precision!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"Workload.overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"Workload.compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        chunk, tile = self.loss_chunk_tokens, self.mlp_tile_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
            raise ValueError(f"Workload.loss_chunk_tokens must be an int >= 0 or None, got {chunk!r}")
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
            raise ValueError(f"Workload.mlp_tile_tokens must be an int >= 0, got {tile!r}")
        for name in ("device_reserve_bytes", "host_reserve_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Workload.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element in the compute precision (s)."""
        return PRECISION_BYTES[self.precision]


# ---- parameters

def block_params_per_rank(config: GPTConfig) -> int:
    """Parameters of one block on one tensor-parallel rank: norms and row-parallel biases are
    replicated, the QKV/fc1 columns and proj/fc2 rows are split (equals ``block_param_count``
    at tp = 1)."""
    return sum(block_param_numels(config))


def block_param_numels(config: GPTConfig) -> list[int]:
    """Elements of each parameter of one block on one rank, in ``Block.named_parameters()`` order
    (ln1, attn.qkv, attn.proj, ln2, mlp.fc1, mlp.fc2; weight then bias; ``params.block_param_shapes``)."""
    return [numel(shape) for _, shape in block_param_shapes(config)]


def block_buffer_numel(config: GPTConfig) -> int:
    """Elements of one block's flat buffer on one rank as the runtime lays it out
    (``runtime.memory.layout.param_offsets``): the parameters at ``ALIGN_ELEMS`` offsets, padded; what one
    load or one gradient copy-out moves, and what the window slots and every host store state of a
    block are sized from."""
    return layout.param_offsets(block_param_numels(config))[1]


def slot_bytes(config: GPTConfig, precision: str) -> int:
    """Device bytes of one window slot as the runtime lays it out (``runtime.memory.layout``): a parameter
    buffer and a gradient buffer in ``precision``, each the block's parameters at aligned offsets,
    rounded up to the arena alignment."""
    return layout.slot_bytes(block_buffer_numel(config), compute_dtype(precision))


def head_tail_params_per_rank(config: GPTConfig) -> int:
    """Parameters of head (token + position embedding) and tail (final norm, LM head) on one rank;
    a tied LM head is counted once."""
    return sum(numel(shape) for _, shape in head_tail_param_shapes(config))


# ---- FLOPs and activations

def block_forward_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """Forward FLOPs of one block on one rank: matmuls 2*B*T*(the elements of the matrices a token
    multiplies by: a MoE block's top-k experts, router and shared experts, ``active_matmul_numel``)
    plus attention 4*B*T^2*a*d / t (scores and weighted sum over a heads of width d, causal mask not
    discounted). For the GPT: 2*B*T*(4*C^2 + 2*C*F)/t (= 24*B*T*C^2 at F = 4C) + 4*B*T^2*C/t."""
    matrices = active_matmul_numel(config, block_param_shapes(config))
    attention = config.heads * (config.hidden // config.heads if isinstance(config, GPTConfig) else config.head_dim)
    return 2.0 * batch * seq * matrices + 4.0 * batch * seq * seq * attention / config.tp_size


def mlp_matmul_numel(config: GPTConfig) -> int:
    """Elements of the MLP matrices one token multiplies by on one rank: 2*C*F/t for the GPT,
    (3 gated, else 2)*C*F/t at the active width for a Hugging Face block (``HFShape``)."""
    if isinstance(config, GPTConfig):
        return 2 * config.hidden * config.ffn_hidden // config.tp_size
    width = config.active_mlp_width or config.mlp_width
    return (3 if config.gated_mlp else 2) * config.hidden * width // config.tp_size


def block_activation_bytes(config: GPTConfig, work: Workload, seq: int) -> int:
    """Bytes one block keeps for its backward (Korthikanti et al. 2022, generalised); the one home of
    the per-block activation bytes.

    GPT, in elements of s bytes: 4*B*T*C replicated plus (4 + 2*F/C)*B*T*C / t; without a fused
    attention kernel also 2*a*T^2*B / t; with dropout, 1-byte masks. A Hugging Face block
    (``HFShape``): 4*B*T*C replicated plus, split over t, B*T*(2*a*d + 2*g*d) and the MLP's 4*B*T*F
    (gated) or 2*B*T*F, at its active width for a MoE (plus router and gathered-token terms). With
    ``work.mlp_tile_tokens`` the MLP's terms count min(T, tile) tokens of one sample: the tiled MLP
    keeps only its input. LoRA intermediates are not counted.
    """
    B, T, C, t, s = work.batch, seq, config.hidden, config.tp_size, work.dtype_bytes
    btc = B * T * C
    tile = B * min(T, work.mlp_tile_tokens) if work.mlp_tile_tokens else B * T  # MLP tokens held at once
    if isinstance(config, GPTConfig):
        mlp = 2 * tile * config.ffn_hidden if work.mlp_tile_tokens else 2 * (config.ffn_hidden // C) * btc
        elems = 4 * btc + (4 * btc + mlp) // t
    else:
        attention, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim
        mlp = (4 if config.gated_mlp else 2) * (config.active_mlp_width or config.mlp_width)
        routing = 2 * config.experts_per_token * C + 2 * config.experts
        elems = 4 * btc + (B * T * (2 * attention + 2 * kv) + tile * (mlp + routing)) // t
    scores = config.heads * T * T * B // t
    if not work.flash_attention:
        elems += 2 * scores
    masks = (2 * btc + (0 if work.flash_attention else scores)) if work.dropout else 0
    return elems * s + masks


def tail_activation_bytes(config: GPTConfig, work: Workload, seq: int) -> int:
    """Peak bytes of the loss on one rank, V the padded vocabulary (/t: its shard), n = B*T tokens.

    Full logits (``loss_chunk_tokens`` 0, or n tokens at most): our GPT's vocab-parallel
    cross-entropy holds three n*V/t*s logits-sized shards, a Hugging Face model's
    (``models.hf_loss.causal_lm_loss``) n*V/t*(s + 12) (its logits, their fp32 copy and softmax and
    the gradient). Over chunks of c tokens (``nn.chunked_loss``): c*V/t*(s + 12) for one chunk,
    plus the stored gradients: the hidden states' n*C*s and the head's fp32 V/t*C. Both add the final
    norm's input and output (2*n*C*s). NOTE: the torch path of the GPT's cross-entropy (no triton,
    or pinned by ``PYSTRONGHOLD_KERNELS``) holds up to n*V/t*(s + 12) and is not budgeted here.
    """
    B, V, C, s, t = work.batch, config.padded_vocab_size, config.hidden, work.dtype_bytes, config.tp_size
    tokens, shard = B * seq, V // t
    chunk = loss_chunk_tokens(shard) if work.loss_chunk_tokens is None else work.loss_chunk_tokens
    if 0 < chunk < tokens:
        logits = chunk * shard * (s + 12) + tokens * C * s + 4 * shard * C
    else:
        logits = 3 * tokens * shard * s if isinstance(config, GPTConfig) else tokens * shard * (s + 12)
    return logits + 2 * tokens * C * s


def host_bytes_per_param(precision: str) -> int:
    """Host store bytes per block parameter as the runtime lays it out (``runtime.memory.layout``): fp32
    master, exp_avg, exp_avg_sq (12) plus the gradient in compute precision (s) plus, in bf16/fp16,
    the compute-precision shadow (s): 16 bytes in every precision."""
    return layout.host_bytes_per_param(compute_dtype(precision))


def ring_allreduce_s(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks: 2*(n-1)/n * bytes / bandwidth."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes / bytes_per_s


# ---- one block, one step

@dataclass(frozen=True, slots=True)
class BlockCosts:
    """Bytes and seconds of one block (and of head + tail) on one rank for a given model/workload/hardware."""

    block_params: int
    """Parameters of one block on this rank (P_b), frozen ones and LoRA adapters included."""
    block_numel: int
    """Elements of one block's flat buffer as the runtime lays it out: P_b plus the alignment
    padding between parameters (``block_buffer_numel``); sizes the host store's buffers."""
    slot_bytes: int
    """Device bytes of one window slot: parameters and the trainable ones' gradients in compute
    precision, (P_b + P_t)*s (plus the runtime's alignment padding, see ``slot_bytes``)."""
    head_tail_bytes: int
    """Device bytes of head + tail: trainable parameters with their gradients, fp32 masters
    (bf16/fp16), Adam moments and the fp32 gradient copy the device AdamW makes in bf16/fp16;
    frozen ones in compute precision only."""
    block_input_bytes: int
    """Bytes of one block's saved input (B*T*C*s)."""
    block_activation_bytes: int
    """Bytes of one block's full activations (see ``block_activation_bytes``)."""
    tail_activation_bytes: int
    """Peak bytes of the loss computation."""
    fwd_s: float
    """Forward compute of one block, seconds (FLOPs / (peak * efficiency) + TP all-reduces)."""
    bwd_s: float
    """Backward of one block, seconds: 2x forward, +1x forward when recomputing."""
    head_tail_s: float
    """Forward + backward of the LM head, seconds (3 * 2*B*T*C*V / tp FLOPs; 2x when its weight
    is frozen)."""
    load_s: float
    """Host-to-device copy of one block's parameters, seconds (P_b*s / H2D bandwidth)."""
    grad_s: float
    """Device-to-host copy of one block's gradient, seconds (P_t*s / D2H bandwidth)."""
    allreduce_s: float
    """Data-parallel all-reduce of one block's gradient before its copy-out, seconds."""
    adam_s: float
    """Host update of one block, seconds: P_t / (CPU Adam rate / ranks), or the NVMe tier's
    share of the disk traffic when that is slower."""
    recompute_s: float = 0.0
    """The part of ``bwd_s`` that recomputes the forward (``fwd_s`` with checkpointing, else 0):
    what a device-resident block that keeps its activations does not spend."""
    resident_block_bytes: int = 0
    """Device bytes of one device-resident block: parameters and gradients in compute precision,
    fp32 AdamW moments and (bf16/fp16) fp32 masters and their fp32 gradients, as for head + tail;
    frozen parameters in compute precision only."""
    device_adam_s: float = 0.0
    """Device AdamW of one resident block, seconds: P_t * DEVICE_ADAM_BYTES / device memory bandwidth."""
    block_frozen_params: int = 0
    """Frozen parameters of one block (P_f; P_t = P_b - P_f train): stored once in compute
    precision, loaded like the others, with no gradient, moments, copy-out or update."""
    block_frozen_numel: int = 0
    """Elements of the frozen part of a block's flat buffer (laid out after the trainable part):
    the store's upload state holds them, its other states only the first
    ``block_numel - block_frozen_numel`` elements."""
    head_tail_fp32_grad_bytes: int = 0
    """Of ``head_tail_bytes``, the fp32 gradient copies the device AdamW makes in bf16/fp16 (4 bytes
    per trainable parameter; 0 in fp32): they exist in the optimizer step only."""
    resident_fp32_grad_bytes: int = 0
    """Of ``resident_block_bytes``, the fp32 gradient copies (as ``head_tail_fp32_grad_bytes``)."""
    input_copy_s: float = 0.0
    """One block's saved input over the link, one direction, seconds (B*T*C*s / D2H bandwidth): what
    ``work.offload_block_inputs`` moves out in forward and back in backward."""
    head_tail_host_bytes: int = 0
    """Host bytes of head and tail with ``work.head_tail_on_host``: the trainable parameters' store
    (``host_bytes_per_param`` each); 0 when they stay on the device."""
    head_tail_update_s: float = 0.0
    """With ``work.head_tail_on_host``: head and tail's gradients out, their CPU Adam and new
    weights in, between backward and the next forward, seconds (counted exposed); else 0."""


def block_costs(config: GPTConfig, work: Workload, hw: Hardware, *, nvme_bytes_per_param: float = 0.0
                ) -> BlockCosts:
    """The ``BlockCosts`` of ``config`` trained as ``work`` on ``hw``. ``nvme_bytes_per_param``:
    bytes read plus written on the NVMe tier per parameter and step (0: no disk tier).

    Frozen parameters (``work.finetune``) are loaded but have no gradient copy-out, all-reduce or
    update, and the backward skips their matrices' weight gradients (2*B*T FLOPs per element);
    LoRA adds its adapters' 2*B*T FLOPs per parameter to the forward."""
    s = work.dtype_bytes
    seq = work.seq or config.seq_len
    if seq > config.seq_len:
        raise ValueError(f"Workload.seq={seq} is longer than the model's seq_len={config.seq_len}")
    ranks = config.tp_size * work.dp_size
    split = param_split(config, work.finetune)
    p_b = split.block_params
    p_t = sum(split.block_trainable)
    offsets, numel = layout.param_offsets([*split.block_trainable, *split.block_frozen])
    train_numel = offsets[len(split.block_trainable)] if split.block_frozen else numel
    flops = hw.gpu.flops(work.precision) * work.compute_efficiency
    btc_bytes = work.batch * seq * config.hidden * s
    tp_ar = ring_allreduce_s(btc_bytes, config.tp_size, hw.gpu.interconnect_bytes_per_s)
    fwd = (block_forward_flops(config, work.batch, seq) + 2.0 * work.batch * seq * split.block_adapters
           ) / flops + 2 * tp_ar
    recompute = fwd if work.checkpointing else 0.0
    frozen_weight_grads = 2.0 * work.batch * seq * split.block_frozen_matmul / flops
    bwd = 2 * (fwd - 2 * tp_ar) - frozen_weight_grads + 2 * tp_ar + recompute
    if work.mlp_tile_tokens and work.mlp_tile_tokens < work.batch * seq:  # tiles run forward again in backward
        bwd += 2.0 * work.batch * seq * mlp_matmul_numel(config) / flops
    lm_flops = 2.0 * work.batch * seq * config.hidden * config.padded_vocab_size / config.tp_size
    adam = p_t / (hw.cpu_adam_params_per_s / ranks)
    if nvme_bytes_per_param:
        adam = max(adam, nvme_bytes_per_param * p_b / (hw.nvme_bytes_per_s / ranks))
    # params, grads, fp32 moments (+ fp32 masters and their grads): head, tail and resident blocks alike
    dtype = compute_dtype(work.precision)
    per_param = layout.device_bytes_per_param(dtype)
    fp32_grad = per_param - layout.device_bytes_per_param(dtype, master_grads=False)  # 4 in bf16/fp16, else 0
    ht_train = split.head_tail_trainable
    if work.head_tail_on_host:  # the device keeps weights and gradients in compute precision only
        ht_device, ht_fp32_grad = ht_train * 2 * s + split.head_tail_frozen * s, 0
        ht_update = (ht_train / (hw.cpu_adam_params_per_s / ranks)
                     + ht_train * s * (1 / hw.gpu.d2h_bytes_per_s + 1 / hw.gpu.h2d_bytes_per_s))
    else:
        ht_device, ht_fp32_grad, ht_update = ht_train * per_param + split.head_tail_frozen * s, ht_train * fp32_grad, 0.0
    return BlockCosts(
        block_params=p_b,
        block_numel=numel,
        slot_bytes=layout.slot_bytes(numel, dtype, grad_numel=train_numel),
        head_tail_bytes=ht_device,
        block_input_bytes=btc_bytes,
        block_activation_bytes=block_activation_bytes(config, work, seq),
        tail_activation_bytes=tail_activation_bytes(config, work, seq),
        fwd_s=fwd,
        bwd_s=bwd,
        head_tail_s=(2 if split.lm_head_frozen else 3) * lm_flops / flops,
        load_s=p_b * s / hw.gpu.h2d_bytes_per_s,
        grad_s=p_t * s / hw.gpu.d2h_bytes_per_s,
        allreduce_s=ring_allreduce_s(p_t * s, work.dp_size, hw.gpu.interconnect_bytes_per_s),
        adam_s=adam,
        recompute_s=recompute,
        resident_block_bytes=p_t * per_param + (p_b - p_t) * s,
        device_adam_s=p_t * DEVICE_ADAM_BYTES[work.precision] / hw.gpu.memory_bytes_per_s,
        block_frozen_params=p_b - p_t,
        block_frozen_numel=numel - train_numel,
        head_tail_fp32_grad_bytes=ht_fp32_grad,
        resident_fp32_grad_bytes=p_t * fp32_grad,
        input_copy_s=btc_bytes / hw.gpu.d2h_bytes_per_s,
        head_tail_host_bytes=ht_train * host_bytes_per_param(work.precision) if work.head_tail_on_host else 0,
        head_tail_update_s=ht_update,
    )


def analytic_window(costs: BlockCosts) -> int:
    """The STRONGHOLD-style bound: the smallest W >= 2 whose W - 1 blocks of compute cover one
    block's transfer in both passes, max(2, 1 + ceil(max(load / fwd, max(load, grad) / bwd)))
    (loads and gradient copies use the two directions of the link at once). It ignores that one
    link serialises the loads; ``pystronghold.planner.timeline`` simulates that."""
    ratio = max(costs.load_s / costs.fwd_s, max(costs.load_s, costs.grad_s) / costs.bwd_s)
    return max(2, 1 + math.ceil(ratio - 1e-12))
