"""A GPT (pre-LN decoder-only transformer), laid out for the layer-window runtime.

Three parts: ``model.head`` (embeddings, ``idx (B, T) -> x (B, T, C)``), ``model.blocks`` (an
``nn.ModuleList`` of ``Block``, ``(B, T, C) -> (B, T, C)``) and ``model.tail`` (final LayerNorm,
LM head, loss: logits (B, T, V) or the mean loss given targets). Shape names: B batch, T sequence,
C hidden, nh heads, hs head size, F MLP width, V padded vocabulary; shapes are one TP rank's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pystronghold.nn.functional as PF
from pystronghold.nn.tiled import tiled
from pystronghold.nn import LayerNorm as PLayerNorm
from pystronghold.nn.chunked_loss import chunked_head_loss

from pystronghold.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   gather_from_tp_region, group_size, init_normal_)

__all__ = ["GPTConfig", "GPT", "Head", "Block", "Tail", "CausalSelfAttention", "MLP", "attention",
           "layer_norm", "lm_loss", "gather_logits"]


# ---- config

@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape and regularisation of a GPT. Validated on construction (``ValueError`` naming the field)."""

    vocab_size: int
    """Number of token ids the model accepts (0 .. vocab_size - 1)."""
    seq_len: int
    """Longest sequence (context length) in tokens; size of the position embedding."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width C (embedding and residual stream size)."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    mlp_ratio: int = 4
    """MLP width as a multiple of ``hidden`` (F = mlp_ratio * hidden)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches, in [0, 1)."""
    bias: bool = True
    """Whether linear layers and LayerNorms have biases (GPT-2/GPT-3 do)."""
    tie_embeddings: bool = False
    """Share the LM head weight with the token embedding (GPT-2 does). The shared weight lives in
    ``head`` and ``tail``, never in a block."""
    vocab_pad_multiple: int = 1
    """Round the embedding/LM-head rows up to a multiple of this (e.g. 128, as Megatron does) so the
    vocabulary splits evenly across tensor-parallel ranks. Padded logits are dropped before the loss."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weights; residual output projections use
    init_std / sqrt(2 * layers) (GPT-2)."""
    tp_size: int = 1
    """Tensor-parallel ranks the heads, MLP columns and vocabulary are split across."""
    mlp_tile_tokens: int = 0
    """Positions per tile of the MLP (``nn.tiled``): each block's MLP runs over tiles of this many
    positions of every sample, forward and backward, so its (B, T, F) intermediate never exists
    whole; 0, or at least T: untiled. A setting of the run, not of the weights (checkpoints leave it
    out)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "hidden", "heads", "mlp_ratio",
                     "vocab_pad_multiple", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig.heads={self.heads} must divide hidden={self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"GPTConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.init_std > 0:
            raise ValueError(f"GPTConfig.init_std must be > 0, got {self.init_std!r}")
        if isinstance(self.mlp_tile_tokens, bool) or not isinstance(self.mlp_tile_tokens, int) \
                or self.mlp_tile_tokens < 0:
            raise ValueError(f"GPTConfig.mlp_tile_tokens must be an int >= 0, got {self.mlp_tile_tokens!r}")
        if self.heads % self.tp_size:
            raise ValueError(f"GPTConfig.tp_size={self.tp_size} must divide heads={self.heads}")
        if self.padded_vocab_size % self.tp_size:
            raise ValueError(
                f"GPTConfig.tp_size={self.tp_size} must divide the padded vocabulary "
                f"{self.padded_vocab_size} (vocab_size={self.vocab_size}, "
                f"vocab_pad_multiple={self.vocab_pad_multiple}); raise vocab_pad_multiple")

    @property
    def head_dim(self) -> int:
        """Size of one attention head, hidden // heads."""
        return self.hidden // self.heads

    @property
    def ffn_hidden(self) -> int:
        """MLP width F = mlp_ratio * hidden."""
        return self.mlp_ratio * self.hidden

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and LM head: vocab_size rounded up to vocab_pad_multiple."""
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m


# ---- the calls other backends replace (attention, norm, loss)

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal scaled-dot-product attention, (B, nh, T, hs) x3 -> (B, nh, T, hs).

    NOTE: the one place attention is computed. Without attention dropout it is
    pystronghold.nn.functional.attention (FlashAttention-2 in Triton on CUDA, torch on CPU); the
    Triton kernel has no dropout, so attention dropout goes through torch's SDPA.
    """
    if dropout_p == 0.0:
        return PF.attention(q, k, v, causal=True)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def layer_norm(hidden: int, eps: float, bias: bool) -> nn.Module:
    """The LayerNorm module every norm of the model is built with (one place to swap it)."""
    return PLayerNorm(hidden, eps=eps, bias=bias)


def gather_logits(logits_shard: torch.Tensor, vocab_size: int,
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """Full logits from this rank's vocabulary shard: (B, T, V_padded / tp) -> (B, T, V)."""
    logits = gather_from_tp_region(logits_shard, group)  # (B, T, V_padded)
    return logits[..., :vocab_size]  # (B, T, V): padding rows are never predicted


def lm_loss(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_size: int,
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """Mean cross-entropy (fp32) of vocabulary-sharded logits (B, T, V_padded / tp) against targets
    (B, T); targets of -100 are ignored; padded vocabulary columns get no probability.

    NOTE: the one place the loss is computed: the vocab-parallel cross-entropy
    (pystronghold.nn.functional), so no rank builds the full (B, T, V) logits or an fp32 copy of
    them (the Triton kernel reads the shard in its dtype; with one rank the torch path is today's
    F.cross_entropy on the real columns in fp32).
    """
    v_shard = logits_shard.shape[-1]
    return PF.vocab_parallel_cross_entropy(logits_shard.reshape(-1, v_shard), targets.reshape(-1), group=group,
                                           ignore_index=-100, vocab_size=vocab_size, loss_dtype=torch.float32)


# ---- modules

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection.

    NOTE: the QKV weight rows are ordered head-major, (nh, 3, hs), not (3, nh, hs) as in nanoGPT,
    so that a contiguous slice of rows holds whole heads: tensor parallelism can then split the
    fused projection by rows and each rank gets its heads' q, k and v.
    """

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.n_head = config.heads // config.tp_size  # heads on this rank
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        C = config.hidden
        self.qkv = ColumnParallelLinear(C, 3 * C, bias=config.bias, group=tp_group)
        self.proj = RowParallelLinear(C, C, bias=config.bias, group=tp_group)
        self.proj.residual_out = True  # scaled init (GPT-2)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, nh * 3 * hs)
        qkv = qkv.view(B, T, self.n_head, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (3, B, nh, T, hs)
        q, k, v = qkv.unbind(0)  # each (B, nh, T, hs)
        y = attention(q, k, v, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh * hs)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Two-layer GeLU MLP, C -> F -> C (fc1 split by columns, fc2 by rows under TP); over tiles of
    ``GPTConfig.mlp_tile_tokens`` positions when it is > 0."""

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        C, Fw = config.hidden, config.ffn_hidden
        self.fc1 = ColumnParallelLinear(C, Fw, bias=config.bias, group=tp_group)
        self.fc2 = RowParallelLinear(Fw, C, bias=config.bias, group=tp_group)
        self.fc2.residual_out = True  # scaled init (GPT-2)
        self.drop = nn.Dropout(config.dropout)
        self.tile_tokens = config.mlp_tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < self.tile_tokens < x.shape[1]:
            y = tiled(self._widen_and_back, x, list(self.parameters()), self.tile_tokens)  # (B, T, C)
        else:
            y = self._widen_and_back(x)  # (B, T, C)
        # NOTE: dropout outside the tiles: one mask for the whole output, drawn as without tiles
        return self.drop(y)

    def _widen_and_back(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))  # (B, T, F)
        return self.fc2(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). One tensor in, one out."""

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ln1 = layer_norm(config.hidden, config.norm_eps, config.bias)
        self.attn = CausalSelfAttention(config, tp_group)
        self.ln2 = layer_norm(config.hidden, config.norm_eps, config.bias)
        self.mlp = MLP(config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return x


class Head(nn.Module):
    """Token + learned position embedding, then dropout: idx (B, T) -> x (B, T, C)."""

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.tok = VocabParallelEmbedding(config.padded_vocab_size, config.hidden, group=tp_group)
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than GPTConfig.seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)


class Tail(nn.Module):
    """Final LayerNorm, LM head and loss: x (B, T, C) -> logits (B, T, V), or the loss with targets."""

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.tp_group = tp_group
        self.ln_f = layer_norm(config.hidden, config.norm_eps, config.bias)
        # vocabulary-parallel LM head: each rank computes the logits of its vocabulary shard
        self.lm_head = ColumnParallelLinear(config.hidden, config.padded_vocab_size, bias=False,
                                            group=tp_group)
        self.loss_chunk_tokens = 0
        """Tokens per chunk of the loss (``nn.chunked_loss``): 0 computes every token's logits at
        once; n > 0 never holds more than n tokens' logits (a training setting, not the model's
        shape: ``train --loss-chunk`` sets it)."""

    def _logits_shard(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (n, V_padded / tp)

    def _loss_sum(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return PF.vocab_parallel_cross_entropy(logits_shard, targets, group=self.tp_group, ignore_index=-100,
                                               reduction="sum", vocab_size=self.vocab_size,
                                               loss_dtype=torch.float32)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is not None and self.loss_chunk_tokens > 0:
            # NOTE: the mean over the counted targets (count clamped to 1: 0, not NaN, when none counts)
            count = (targets != -100).sum().clamp(min=1)
            return chunked_head_loss(x, targets, self._logits_shard, self._loss_sum, list(self.parameters()),
                                     self.loss_chunk_tokens, divisor=count)
        logits_shard = self._logits_shard(x)  # (B, T, V_padded / tp)
        if targets is None:
            return gather_logits(logits_shard, self.vocab_size, self.tp_group)  # (B, T, V)
        return lm_loss(logits_shard, targets, self.vocab_size, self.tp_group)


class GPT(nn.Module):
    """GPT = head -> blocks -> tail. Weights are a deterministic function of ``seed``.

    Each parameter is drawn from a generator seeded by ``seed`` and its name, so weights do not
    depend on construction order, and a tensor-parallel rank (``config.tp_size > 1`` with
    ``tp_group``) keeps its slice of the single-process tensor. With ``materialize_blocks=False`` the
    blocks stay on ``meta`` until ``materialize_block_(i)`` gives block i the same weights the eager
    constructor would, so a model larger than host memory is built one block at a time.
    """

    materialize_block_thread_safe = True
    """``materialize_block_`` may run for different blocks in parallel threads (``wrap`` does):
    each parameter draws from its own generator seeded by (seed, name), whatever the scheduling."""

    def __init__(self, config: GPTConfig, *, seed: int = 0,
                 tp_group: dist.ProcessGroup | None = None, materialize_blocks: bool = True) -> None:
        super().__init__()
        if group_size(tp_group) != config.tp_size:
            raise ValueError(f"GPTConfig.tp_size={config.tp_size} but the tensor-parallel group "
                             f"has {group_size(tp_group)} ranks (tp_group={tp_group})")
        self.config = config
        self.seed = seed
        """The seed the current weights were drawn from (``materialize_block_`` draws from it)."""
        self.adapters = None
        """Adapters added to the blocks after construction (``models.lora.add_lora``), or None: as
        ``models.hf.LazyHFModel.adapters``, ``stored_name(name)`` maps a block parameter's name to
        the GPT's own (None: an adapter's parameter) and ``initialize(block, i)`` gives block i's
        adapters their initial values once ``materialize_block_`` has drawn its weights."""
        self.head = Head(config, tp_group)
        if materialize_blocks:
            self.blocks = nn.ModuleList(Block(config, tp_group) for _ in range(config.layers))
        else:
            # NOTE: on meta, construction allocates nothing and init_normal_ skips the draws.
            with torch.device("meta"):
                self.blocks = nn.ModuleList(Block(config, tp_group) for _ in range(config.layers))
        self.tail = Tail(config, tp_group)
        if config.tie_embeddings:
            self.tail.lm_head.weight = self.head.tok.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """(Re)initialise every parameter from ``seed`` (GPT-2 scheme, see GPTConfig.init_std).

        Blocks still on ``meta`` stay there; ``materialize_block_`` initialises them from ``seed``.
        """
        self.seed = seed
        seen: set[int] = set()  # a tied weight is drawn once, under its first name (the embedding's)
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(prefix=module_name, recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                self._init_parameter(module, name, param)

    @torch.no_grad()
    def _init_parameter(self, module: nn.Module, name: str, param: torch.Tensor) -> None:
        """Initialise ``param`` of ``module``; ``name`` is its full name in the model
        (``blocks.3.attn.qkv.weight``), which seeds its draw together with ``self.seed``."""
        if param.is_meta:
            return  # nothing to fill; drawn when the block is materialized
        cfg = self.config
        if isinstance(module, (nn.LayerNorm, PLayerNorm)):
            param.fill_(1.0 if name.endswith("weight") else 0.0)
            return
        if name.endswith("bias"):
            param.zero_()
            return
        residual_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        std = residual_std if getattr(module, "residual_out", False) else cfg.init_std
        init_normal_(param, std, self.seed, name)

    @torch.no_grad()
    def materialize_block_(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Give block ``index``'s ``meta`` parameters real storage on ``device`` and initialise
        them exactly as ``GPT(..., materialize_blocks=True)`` with the same seed would have
        (bit for bit), and its adapters as ``adapters`` does. Returns the block. ``ValueError`` if
        the block already has storage."""
        if not -len(self.blocks) <= index < len(self.blocks):
            raise ValueError(f"block index {index} is out of range for {len(self.blocks)} blocks")
        index %= len(self.blocks)
        block = self.blocks[index]
        if not all(t.is_meta for t in (*block.parameters(), *block.buffers())):
            raise ValueError(f"block {index} is already materialized (its parameters are not on meta)")
        # NOTE: to_empty builds new Parameter objects, dropping attributes set on the old ones
        # (tp_split, which init_normal_ needs to draw the full tensor and keep this rank's slice).
        attrs = {name: dict(vars(p)) for name, p in block.named_parameters()}
        block.to_empty(device=device)
        for name, p in block.named_parameters():
            for key, value in attrs[name].items():
                setattr(p, key, value)
        for module_name, module in block.named_modules(prefix=f"blocks.{index}"):
            for name, param in module.named_parameters(prefix=module_name, recurse=False):
                own = name if self.adapters is None else self.adapters.stored_name(name)
                if own is not None:  # NOTE: drawn under the GPT's own name, whatever wraps the layer
                    self._init_parameter(module, own, param)
        if self.adapters is not None:
            self.adapters.initialize(block, index)
        return block

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V), or the mean cross-entropy loss given targets (B, T)."""
        first = next(self.blocks[0].parameters(), None)
        if first is not None and first.is_meta:  # one check, instead of a deep meta-tensor error
            raise RuntimeError("blocks are not materialized; wrap() the model with pystronghold "
                               "(it materializes one block at a time) or call materialize_block_(i)")
        x = self.head(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.tail(x, targets)
