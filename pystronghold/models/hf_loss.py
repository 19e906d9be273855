"""The next-token loss of a Hugging Face causal LM, with or without its full logits.

``causal_lm_loss`` is the reference: the (B, T, V) logits the model's own forward returns, in fp32.
``chunked_causal_lm_loss`` computes the same loss from the base model's last hidden states, running
the family's LM head (tied or not) and its logit scaling or soft-capping over chunks of tokens
(``nn.chunked_loss``), so the logits of a long sequence are never all alive. A family is chunked
only when what its ``*ForCausalLM.forward`` does between the base model and the loss is known here
(``HEAD_TRANSFORMS``); any other takes the full-logits path, never a guess.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.nn import functional as PF
from pystronghold.nn.chunked_loss import chunked_head_loss
from pystronghold.parallel.groups import group_size
from pystronghold.data import IGNORE_INDEX

__all__ = ["causal_lm_loss", "chunked_causal_lm_loss", "hidden_states_loss", "lm_head_of", "causal_lm_of",
           "HEAD_TRANSFORMS"]

log = logging.getLogger(__name__)


def _none(config) -> None:
    return None


def _softcap(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return None
    return lambda logits: torch.tanh(logits / cap) * cap


def _times_logit_scale(config) -> Callable[[torch.Tensor], torch.Tensor]:
    scale = config.logit_scale
    return lambda logits: logits * scale


def _over_logits_scaling(config) -> Callable[[torch.Tensor], torch.Tensor]:
    scaling = config.logits_scaling
    return lambda logits: logits / scaling


HEAD_TRANSFORMS = {
    **{family: _none for family in (
        "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "phi3", "gpt_neox", "gptj", "opt",
        "falcon", "bloom", "stablelm", "olmo", "olmo2", "starcoder2", "gpt_bigcode", "glm4", "smollm3",
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")},
    "gemma2": _softcap, "gemma3_text": _softcap, "cohere": _times_logit_scale, "granite": _over_logits_scaling,
}
"""``model_type`` -> what turns its LM head's output into the logits its causal LM returns
(config -> a function of the logits, or None for none): soft-capping (Gemma 2/3:
``tanh(logits / cap) * cap``), Cohere's ``logit_scale`` (times), Granite's ``logits_scaling``
(divided by). Each was read off transformers' ``*ForCausalLM.forward``, and the families test
checks the chunked loss against the model's own logits for every one of them; a family enters this
table only with that test."""


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T), which are
    already shifted (``targets[:, t]`` follows ``inputs[:, t]``), over the targets that are not -100
    (0, with no gradient, when every one is). Computed in fp32."""
    flat = targets.flatten()
    # NOTE: a sum over a count clamped to 1, not reduction="mean": that is 0/0 = NaN (and NaN
    # gradients) for a window of prompt tokens only; no host synchronization either way.
    total = nn.functional.cross_entropy(logits.float().flatten(0, 1), flat, ignore_index=IGNORE_INDEX,
                                        reduction="sum")
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside ``model`` (looked through PEFT's ``get_base_model``)."""
    while callable(getattr(model, "get_base_model", None)) and model.get_base_model() is not model:
        model = model.get_base_model()
    return model


def lm_head_of(model: nn.Module):
    """``(base, head, params)`` of a Hugging Face causal LM (PEFT-wrapped or not) whose family's
    logits are known (``HEAD_TRANSFORMS``): ``base`` returns the final hidden states,
    ``head`` maps (n, C) of them to the (n, V) logits the model's forward returns, ``params`` are
    the parameters ``head`` reads; None for any other model (the caller uses the full logits)."""
    causal = causal_lm_of(model)
    config = getattr(causal, "config", None)
    family = getattr(config, "model_type", None)
    prefix = getattr(causal, "base_model_prefix", None)
    base = getattr(causal, prefix, None) if prefix else None
    get_head = getattr(causal, "get_output_embeddings", None)
    lm_head = get_head() if callable(get_head) else None
    if family not in HEAD_TRANSFORMS or not isinstance(base, nn.Module) or not isinstance(lm_head, nn.Module):
        log.debug("loss: %s (%s) takes the full-logits path: its logits' transform is not known here",
                  type(causal).__name__, family)
        return None
    transform = HEAD_TRANSFORMS[family](config)
    if transform is None:
        head = lm_head
    else:
        def head(hidden: torch.Tensor) -> torch.Tensor:
            return transform(lm_head(hidden))
    return base, head, [p for p in lm_head.parameters()]


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _vocab_parallel_ce_sum(group: dist.ProcessGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def ce_sum(logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return PF.vocab_parallel_cross_entropy(logits_shard, targets, group=group, ignore_index=IGNORE_INDEX,
                                               reduction="sum", loss_dtype=torch.float32)
    return ce_sum


def chunked_causal_lm_loss(run: Callable, model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                           chunk_tokens: int, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``causal_lm_loss`` of ``model`` on ``input_ids`` (B, T) against ``targets`` (B, T), its
    LM head and loss run ``chunk_tokens`` tokens at a time (0: the full logits, as the model's own
    forward makes them). ``run(fn)`` calls the model's code, the loss included (``Engine.call``,
    or a plain call). A model split across ``tp_group`` (``models.hf_tp``) has a vocabulary-parallel
    LM head: its logits shards go to the vocabulary-parallel cross-entropy (all of them in one
    chunk with ``chunk_tokens`` 0)."""
    split = group_size(tp_group) > 1
    parts = lm_head_of(model) if chunk_tokens > 0 or split else None
    if parts is None:
        if split:  # models.hf_tp.check_hf_tp refuses such a family first
            raise ValueError(f"{type(causal_lm_of(model)).__name__}: its logits' transform is not known here, "
                             "so its tensor-parallel loss cannot be computed")
        return run(lambda: causal_lm_loss(model(input_ids=input_ids).logits, targets))
    base, head, params = parts
    chunk = chunk_tokens if chunk_tokens > 0 else input_ids.numel()

    def loss() -> torch.Tensor:
        hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, T, C)
        return hidden_states_loss(hidden, targets, head, params, chunk, tp_group=tp_group)

    return run(loss)


def hidden_states_loss(hidden: torch.Tensor, targets: torch.Tensor, head: Callable, params, chunk_tokens: int,
                       *, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``causal_lm_loss`` from the base model's final hidden states ``hidden`` (B, T, C) against
    ``targets`` (B, T): ``head`` and ``params`` are ``lm_head_of``'s, run ``chunk_tokens`` tokens at
    a time (0: all at once). What a pipeline's last stage computes as well. A model split across
    ``tp_group`` (``models.hf_tp``) has a vocabulary-parallel head: each chunk's logits shards go to
    the vocabulary-parallel cross-entropy."""
    ce_sum = _vocab_parallel_ce_sum(tp_group) if group_size(tp_group) > 1 else _ce_sum
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    chunk = chunk_tokens if chunk_tokens > 0 else max(targets.numel(), 1)
    return chunked_head_loss(hidden, targets, head, ce_sum, params, chunk, divisor=count)
