"""The sequence in the plan: which long-context settings a context length needs, and the longest
context that fits.

Four settings move the sequence's bytes off the device, each at a cost (``Workload``'s fields,
costed in ``planner/cost.py``, ``planner/memory.py`` and ``timeline.with_sequence_costs``):

- the chunked loss (``loss_chunk_tokens``): one chunk's fp32 logits and their gradient instead of
  the full logits; costs nothing in the model (the head's gradients are made in the forward);
- the tiled MLP (``mlp_tile_tokens``): one block's recompute working set stops growing with T in
  its MLP; costs one more MLP forward per block in backward;
- head and tail on the host (``head_tail_on_host``): the device keeps their compute-precision
  weights and gradients; costs their host update, exposed between backward and the next forward;
- block inputs offloaded (``offload_block_inputs``): the device keeps ``INPUTS_IN_FLIGHT`` saved
  inputs instead of N; costs 2·N·B·T·C·s link bytes per step (host, then NVMe), exposed where they
  outlast the compute.

``choose_sequence_settings`` picks the fewest of them that make a context fit (among as few, the
fastest predicted step), those the caller fixed kept as they are; ``longest_context`` searches the
longest T at batch 1.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pystronghold.models.gpt import GPTConfig
from pystronghold.models.hf import HF_DEFAULT_SEQ
from pystronghold.nn.chunked_loss import loss_chunk_tokens
from pystronghold.nn.tiled import mlp_tile_tokens
from pystronghold.planner.cost import Workload, block_activation_bytes
from pystronghold.planner.hardware import Hardware
from pystronghold.planner.plan import Plan, make_plan

__all__ = ["SequenceSettings", "LongestContext", "SETTINGS",
           "settings_words", "loss_chunk_for", "mlp_tile_for", "activation_bytes_per_token", "offload_link_bytes",
           "plan_sequence", "choose_sequence_settings", "longest_context", "default_context"]

SETTINGS = ("loss_chunk", "mlp_tile", "head_tail_host", "offload_inputs")
"""The settings, cheapest first: the order ties are broken in."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSettings:
    """The long-context settings for one context length: what ``train`` applies."""

    seq: int
    """Tokens per sample, T."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the loss (``--loss-chunk``; 0: one chunk, the full logits)."""
    mlp_tile_tokens: int = 0
    """Tokens per tile of the MLP (``--mlp-tile``; 0: untiled)."""
    head_tail_on_host: bool = False
    """Head and tail's masters and moments in host memory (``--head-tail host``)."""
    offload_block_inputs: bool = False
    """Recomputed blocks' saved inputs go to the host (``--offload-activations``)."""
    fits: bool = True
    """The model trains at ``seq`` with these settings; False: not even with all of them."""

    @property
    def chosen(self) -> tuple[str, ...]:
        """The settings turned on, by their ``SETTINGS`` names."""
        on = (self.loss_chunk_tokens > 0, self.mlp_tile_tokens > 0, self.head_tail_on_host,
              self.offload_block_inputs)
        return tuple(name for name, flag in zip(SETTINGS, on) if flag)

    def workload(self, work: Workload) -> Workload:
        """``work`` at ``seq`` with these settings."""
        return dataclasses.replace(work, seq=self.seq, loss_chunk_tokens=self.loss_chunk_tokens,
                                   mlp_tile_tokens=self.mlp_tile_tokens, head_tail_on_host=self.head_tail_on_host,
                                   offload_block_inputs=self.offload_block_inputs)

    def describe(self) -> str:
        """The settings in words, one line ("none" when nothing is needed)."""
        return settings_words(self.workload(Workload())) or "none"


def settings_words(work: Workload) -> str:
    """The long-context settings ``work`` asks for, in words ("" for none; a loss chunk left to the
    runtime's default, None, is not named)."""
    words = [f"loss in chunks of {work.loss_chunk_tokens} tokens" if work.loss_chunk_tokens else "",
             f"MLP tiled by {work.mlp_tile_tokens} tokens" if work.mlp_tile_tokens else "",
             "head/tail on the host" if work.head_tail_on_host else "",
             "block inputs offloaded" if work.offload_block_inputs else ""]
    return ", ".join(w for w in words if w)


@dataclass(frozen=True, slots=True)
class LongestContext:
    """The longest context that fits, its settings and its plan."""

    seq: int
    """Longest T at the workload's batch (0: not even the shortest tried)."""
    settings: SequenceSettings | None
    """The settings chosen at ``seq`` (None when nothing fits)."""
    plan: Plan | None
    """The plan at ``seq`` with those settings."""


def loss_chunk_for(config: GPTConfig, work: Workload, seq: int) -> int:
    """Tokens per loss chunk as ``--loss-chunk auto`` takes them (``nn.chunked_loss``'s rule on
    this rank's V/t), at most the B*T tokens of a micro-batch."""
    return min(work.batch * seq, loss_chunk_tokens(config.padded_vocab_size // config.tp_size))


def mlp_tile_for(config: GPTConfig, work: Workload, seq: int) -> int:
    """Tokens per MLP tile (of each sample) as ``--mlp-tile auto`` takes them: ``nn.tiled``'s rule on
    this rank's MLP width at the compute precision; 0 (untiled) when the whole (B, T, F)
    intermediate is within its budget, so tiling would bound nothing worth a recompute."""
    return mlp_tile_tokens(work.batch, seq, config.ffn_hidden // config.tp_size, work.dtype_bytes)


def activation_bytes_per_token(config: GPTConfig, work: Workload) -> int:
    """Bytes one block keeps per token of one sample in its recompute working set (its
    ``block_activation_bytes`` slope: flash attention makes it linear in T), at ``work``'s
    settings; a tiled MLP's tile is a constant on top, not counted here."""
    untiled = dataclasses.replace(work, batch=1, mlp_tile_tokens=0)
    slope = block_activation_bytes(config, untiled, 2) - block_activation_bytes(config, untiled, 1)
    if work.mlp_tile_tokens:
        slope -= (block_activation_bytes(config, untiled, 2) - block_activation_bytes(
            config, dataclasses.replace(untiled, mlp_tile_tokens=1), 2))
    return slope


def offload_link_bytes(config: GPTConfig, work: Workload, seq: int) -> int:
    """Link bytes of offloaded block inputs per step: each of the N blocks' B*T*C*s input out in
    forward and back in backward (0 without ``offload_block_inputs``). The device keeps
    ``INPUTS_IN_FLIGHT`` of them."""
    if not work.offload_block_inputs or not work.checkpointing:
        return 0
    return 2 * config.layers * work.batch * seq * config.hidden * work.dtype_bytes


def _given(work: Workload, name: str, config: GPTConfig, seq: int) -> int | bool:
    """The value ``work`` holds for setting ``name`` (a loss chunk left to the runtime, None, as
    ``--loss-chunk auto`` takes it)."""
    if name == "loss_chunk":
        chunk = work.loss_chunk_tokens
        return loss_chunk_for(config, work, seq) if chunk is None else chunk
    return {"mlp_tile": work.mlp_tile_tokens, "head_tail_host": work.head_tail_on_host,
            "offload_inputs": work.offload_block_inputs}[name]


def _settings(config: GPTConfig, work: Workload, seq: int, on: tuple[str, ...],
              free: tuple[str, ...] = SETTINGS) -> SequenceSettings:
    """The settings at ``seq`` with those of ``free`` in ``on`` turned on and the rest of ``free``
    off; a setting not in ``free`` keeps its value in ``work``."""
    chosen = {"loss_chunk": loss_chunk_for(config, work, seq), "mlp_tile": mlp_tile_for(config, work, seq),
              "head_tail_host": True, "offload_inputs": True}
    value = {name: (chosen[name] if name in on else type(chosen[name])(0)) if name in free
             else _given(work, name, config, seq) for name in SETTINGS}
    return SequenceSettings(seq=seq, loss_chunk_tokens=value["loss_chunk"], mlp_tile_tokens=value["mlp_tile"],
                            head_tail_on_host=bool(value["head_tail_host"]),
                            offload_block_inputs=bool(value["offload_inputs"]))


def plan_sequence(config: GPTConfig, work: Workload, hw: Hardware, settings: SequenceSettings) -> Plan:
    """The plan of ``config`` at ``settings.seq`` with ``settings`` (the model's positions do not
    bound it: what fits is asked, not what the model was trained for)."""
    if settings.seq > config.seq_len:
        config = dataclasses.replace(config, seq_len=settings.seq)
    return make_plan(config, settings.workload(work), hw)


def choose_sequence_settings(config: GPTConfig, work: Workload, hw: Hardware, seq: int, *,
                             free: tuple[str, ...] = SETTINGS) -> SequenceSettings:
    """The fewest long-context settings with which ``config`` trains at ``seq`` tokens per sample
    (``work.batch`` samples) on ``hw``, each of which costs step time or host memory.

    Every subset of the settings named in ``free`` (of ``SETTINGS``) is planned (``make_plan``, K
    and W chosen); the others keep their values in ``work``. The smallest subsets that fit win,
    among them the fastest predicted step, then the cheapest settings (``SETTINGS`` order). No
    proper subset of the result fits. When nothing fits, every free setting on, ``fits=False``.
    ``train`` applies it to its "auto" --head-tail and --offload-activations (``train/long_context.py``)."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ValueError(f"seq must be a positive int, got {seq!r}")
    unknown = set(free) - set(SETTINGS)
    if unknown:
        raise ValueError(f"choose_sequence_settings: free settings {sorted(unknown)} are not among {SETTINGS}")
    free = tuple(name for name in SETTINGS if name in free)
    for size in range(len(free) + 1):
        fitting = []
        for rank, on in enumerate(itertools.combinations(free, size)):
            settings = _settings(config, work, seq, on, free)
            plan = plan_sequence(config, work, hw, settings)
            if plan.fits:
                fitting.append((plan.step.total_s, rank, settings))
        if fitting:
            return min(fitting, key=lambda f: f[:2])[2]
    return dataclasses.replace(_settings(config, work, seq, free, free), fits=False)


def longest_context(config: GPTConfig, work: Workload, hw: Hardware, *, limit: int = 1 << 24,
                    granule: int = 1024) -> LongestContext:
    """The longest context (a multiple of ``granule`` tokens, at most ``limit``) that fits with
    every setting on, found by doubling then bisection (the bytes grow with T at fixed settings),
    and the fewest settings that fit it (``choose_sequence_settings``)."""
    def fits(seq: int) -> bool:
        return plan_sequence(config, work, hw, _settings(config, work, seq, SETTINGS)).fits

    if not fits(granule):
        return LongestContext(seq=0, settings=None, plan=None)
    lo, hi = 1, 2  # in granules: fits(lo), not fits(hi)
    while hi * granule <= limit and fits(hi * granule):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // granule + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * granule) else (lo, mid)
    seq = lo * granule
    settings = choose_sequence_settings(config, work, hw, seq)
    return LongestContext(seq=seq, settings=settings, plan=plan_sequence(config, work, hw, settings))


def default_context(shape: GPTConfig, work: Workload, hw: Hardware, positions: int | None) -> tuple[int, str]:
    """The context ``train --model hf:DIR`` takes without --seq, and why, in words: the model's
    ``positions`` when they fit ``hw`` (with the fewest settings, ``choose_sequence_settings``),
    else the longest context that fits (``longest_context``, at most ``positions``);
    ``models.hf.HF_DEFAULT_SEQ`` tokens for a model that names none (``positions`` None: ALiBi
    runs any length and implies none), at most what fits."""
    limit = positions or HF_DEFAULT_SEQ
    what = "the model's positions" if positions else (f"{HF_DEFAULT_SEQ}: the model names no "
                                                      "positions")
    if choose_sequence_settings(shape, work, hw, limit).fits:
        return limit, f"{what}; fits"
    got = longest_context(shape, work, hw, limit=limit, granule=min(1024, limit))
    if not got.seq:
        short = min(limit, HF_DEFAULT_SEQ)
        return short, f"{what} ({limit}) do not fit, nor does any context the planner tries; {short} on"
    return got.seq, f"{what} ({limit}) do not fit; the longest context that fits"
