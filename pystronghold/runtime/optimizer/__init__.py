"""The optimizer step: host updates of streamed blocks, device AdamW of resident blocks, the
head and tail's host Adam, gradient norms, clipping, the fp16 loss scale and what stops a diverged run."""
