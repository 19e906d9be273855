"""A language-model loss that never holds the full logits: the head and the cross-entropy run over
chunks of tokens.

The (tokens, V) logits of a long sequence with a large vocabulary dwarf everything else a step
holds (32K tokens x 128K vocabulary x 4 B = 16 GiB, twice with their gradient). Here each chunk's
logits are made, reduced to a cross-entropy *sum* and, when a gradient is wanted, differentiated at
once (the gradient w.r.t. the chunk's hidden states and the head's parameters), then freed. So the
head's matmul runs once forward and twice backward, as without chunks, and backward only scales
the stored gradients by the incoming one. The head is any function of one chunk of hidden states
(final norm, LM head, logit scaling or soft-capping, a vocabulary-parallel shard), so our GPT and
Hugging Face families share this one home.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["chunked_head_loss", "loss_chunk_tokens", "LOSS_CHUNK_BUDGET_BYTES"]

LOSS_CHUNK_BUDGET_BYTES = 256 * 2**20
"""Default bytes of one chunk's fp32 logits (``loss_chunk_tokens``): 256 MiB, 2,048 tokens of a
32K vocabulary, 512 of a 128K one."""


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = LOSS_CHUNK_BUDGET_BYTES) -> int:
    """Tokens per loss chunk so that one chunk's fp32 logits take at most ``budget_bytes`` bytes
    (at least 1 token; rounded down to a multiple of 64 tokens past 64)."""
    if vocab_size < 1 or budget_bytes < 1:
        raise ValueError(f"loss_chunk_tokens: vocab_size ({vocab_size}) and budget_bytes ({budget_bytes}) "
                         "must be positive")
    tokens = max(1, budget_bytes // (4 * vocab_size))
    return tokens // 64 * 64 if tokens > 64 else tokens


class _ChunkedHeadLoss(torch.autograd.Function):
    """forward(ctx, head, loss_sum, chunk, want_grad, hidden, targets, divisor, *params) -> the
    summed loss over ``divisor`` (a 0-dim tensor in the dtype ``loss_sum`` returns)."""

    @staticmethod
    def forward(ctx, head, loss_sum, chunk, want_grad, hidden, targets, divisor, *params):
        rows = hidden.reshape(-1, hidden.shape[-1])
        labels = targets.reshape(-1)
        wrt = [p for p in params if p.requires_grad] if want_grad else []
        grad_rows = torch.empty_like(rows) if want_grad and hidden.requires_grad else None
        # NOTE: parameter gradients summed over the chunks in fp32 and rounded once at the end, as
        # one full matmul would round them once
        sums: list[torch.Tensor | None] = [None] * len(wrt)
        # NOTE: fp16 gradients of a mean over many tokens underflow before the loss scale reaches
        # them (it comes with grad_output): there the divisor is applied in backward instead
        late = hidden.dtype == torch.float16
        total = None
        for start in range(0, rows.shape[0], chunk):
            part = rows[start:start + chunk]
            with torch.enable_grad():
                x = part.detach().requires_grad_(grad_rows is not None)
                loss = loss_sum(head(x), labels[start:start + chunk])
                loss = loss if late else loss / divisor
                inputs = ([x] if grad_rows is not None else []) + wrt
                grads = torch.autograd.grad(loss, inputs, allow_unused=True) if inputs else ()
            if grad_rows is not None:
                grad_rows[start:start + chunk] = grads[0]
                grads = grads[1:]
            for k, g in enumerate(grads):
                if g is not None:
                    sums[k] = g.float() if sums[k] is None else sums[k].add_(g)
            loss = loss.detach()
            total = loss if total is None else total + loss
        if late:
            total = total / divisor
        if want_grad:
            by_param = {id(p): s for p, s in zip(wrt, sums)}
            ctx.param_grads = [None if id(p) not in by_param or by_param[id(p)] is None
                               else by_param[id(p)].to(p.dtype) for p in params]
            ctx.grad_hidden = None if grad_rows is None else grad_rows.view_as(hidden)
            ctx.late_divisor = divisor if late else None
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.param_grads is None:
            raise RuntimeError("chunked_head_loss: a second backward through the same loss (its stored "
                               "gradients are scaled in place and given away once)")
        scale = grad_total.reshape(()).float()
        if ctx.late_divisor is not None:
            scale = scale / ctx.late_divisor
        grad_hidden = None if ctx.grad_hidden is None else ctx.grad_hidden.mul_(scale.to(ctx.grad_hidden.dtype))
        param_grads = [None if g is None else g.mul_(scale.to(g.dtype)) for g in ctx.param_grads]
        ctx.grad_hidden, ctx.param_grads = None, None
        return (None, None, None, None, grad_hidden, None, None, *param_grads)


def chunked_head_loss(hidden: torch.Tensor, targets: torch.Tensor,
                      head: Callable[[torch.Tensor], torch.Tensor],
                      loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      params: Sequence[torch.Tensor], chunk_tokens: int,
                      divisor: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``sum over chunks of loss_sum(head(hidden chunk), targets chunk) / divisor``: the loss of
    ``hidden`` (..., C) against ``targets`` (...) (the same leading shape), chunk_tokens tokens at
    a time, never more than one chunk's logits alive.

    ``head`` maps (n, C) hidden states to (n, V) logits (or a vocabulary shard) using the
    parameters ``params`` (every parameter it reads that may need a gradient: norm, LM head, tied
    embedding); ``loss_sum`` maps (n, V) logits and (n,) targets to a 0-dim summed loss;
    ``divisor`` (a 0-dim tensor or a number, no gradient) is what a mean divides by, applied in
    each chunk before its gradient is taken, so low-precision gradients are rounded as without
    chunks. Gradients equal autograd's through the same functions up to the order of the chunks'
    sums (fp32: within 1e-6 relative). With ``chunk_tokens`` >= the token count it is one call of
    each, as without chunking.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunked_head_loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"chunked_head_loss: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} "
                         "differ in their leading (token) shape")
    params = list(params)
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.detach()
    if hidden.numel() // max(hidden.shape[-1], 1) <= chunk_tokens:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return loss_sum(head(flat), targets.reshape(-1)) / divisor
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    return _ChunkedHeadLoss.apply(head, loss_sum, chunk_tokens, want_grad, hidden, targets, divisor, *params)
