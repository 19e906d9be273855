"""Device-resident blocks: the first K blocks never leave the device.

Their parameters live on the device in compute precision, with fp32 masters and AdamW moments of
the trainable ones, updated by a device ``torch.optim.AdamW`` in ``step()`` (so clipping, fp16
skips and accumulation are plain PyTorch's). No load, copy-out or host update touches them; they
keep their activations unless ``resident_recompute``. The first blocks are chosen because they
finish backward last, leaving a host update the least time to hide. Refused with layer drop.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from pystronghold.optim.device_adamw import DeviceAdamW
from pystronghold.optim.hyper import AdamW, AdamWHyper
from pystronghold.runtime.memory.layout import head_tail_bytes

__all__ = ["ResidentBlocks"]


class ResidentBlocks:
    """K blocks with their parameters, masters and AdamW moments on the device."""

    def __init__(self, modules: list[torch.nn.Module], block_params: list[list[torch.nn.Parameter]],
                 spec: AdamW, device: torch.device, dtype: torch.dtype, *, recompute: bool,
                 group_of: dict[int, int] | None = None, fused: bool = False) -> None:
        """``block_params[i]``: block i's parameters, the trainable ones first (still at their initial
        values, on the host or the device); they are moved to ``device`` in ``dtype`` after the fp32
        masters of the trainable ones are taken (a frozen parameter is kept once, in ``dtype``, with
        no optimizer state). ``group_of``: the engine's param group of each trainable parameter by
        id (default: all in group 0); ``fused``: torch's fused AdamW kernel (``fused_adamw_for``
        the device, decided by the builder for every device optimizer)."""
        self.count = len(modules)
        self.block_params = block_params
        flat = [p for ps in block_params for p in ps]
        trainable = [p for p in flat if p.requires_grad]
        masters = [p.detach().to(device, torch.float32) for p in trainable]
        groups = [group_of[id(p)] for p in trainable] if group_of is not None else None
        with torch.no_grad():
            for p in flat:
                p.data = p.data.to(device=device, dtype=dtype)
        per_block = [sum(p.requires_grad for p in ps) for ps in block_params]
        # one block at a time: a block's fp32 gradients exist during its own update only
        self.optimizer = DeviceAdamW(trainable, spec, masters, groups, fused=fused, blocks=per_block)
        self.nbytes = head_tail_bytes(flat, dtype)
        """Device bytes: parameters and gradients in compute precision, fp32 moments (and masters);
        a frozen parameter's value only."""
        self._first = [0]  # index of each block's first trainable parameter in the optimizer
        for n in per_block:
            self._first.append(self._first[-1] + n)
        self._steps_unknown = False  # moments were written: their step count is the engine's
        if recompute:
            for module in modules:
                original = module.forward

                def recomputed(*args, _fn=original, **kwargs):
                    if not torch.is_grad_enabled():
                        return _fn(*args, **kwargs)
                    return checkpoint(_fn, *args, use_reentrant=False, **kwargs)

                module.forward = recomputed

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every trainable resident parameter, block 0 first, in each block's layout order."""
        return self.optimizer.params

    def _indices(self, block: int) -> range:
        return range(self._first[block], self._first[block + 1])

    def read(self, block: int, state: str) -> list[torch.Tensor]:
        """``state`` ("master", "exp_avg", "exp_avg_sq") of ``block``'s parameters: the live tensors,
        fp32 (zeros for a moment before the first update). ``master`` has every parameter, a frozen
        one's value in the compute dtype; the moments the trainable parameters only."""
        opt = self.optimizer
        out = []
        for i in self._indices(block):
            m = opt.masters[i].detach()
            out.append(m if state == "master" else opt.state_of(i).get(state, torch.zeros_like(m)))
        if state == "master":
            out += [p.detach() for p in self.block_params[block][len(out):]]
        return out

    @torch.no_grad()
    def write(self, block: int, state: str, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``state`` of ``block``'s parameters (as ``read`` lists them; shapes checked by
        the caller); a master refreshes the compute-precision parameter too."""
        opt = self.optimizer
        indices = self._indices(block)
        for i, t in zip(indices, tensors):
            if state == "master":
                opt.masters[i].copy_(t)
                if opt.masters[i] is not opt.params[i]:
                    opt.params[i].copy_(opt.masters[i])
            else:
                opt.write_moment(i, state, t)
                self._steps_unknown = True
        if state == "master":
            for p, t in zip(self.block_params[block][len(indices):], tensors[len(indices):]):
                p.copy_(t)  # a frozen parameter: its one copy

    def write_master(self, index: int, value: torch.Tensor) -> None:
        """Overwrite the fp32 master of resident parameter ``index`` (and its compute copy)."""
        block = next(b for b in range(self.count) if index < self._first[b + 1])
        values = self.read(block, "master")
        values[index - self._first[block]] = value
        self.write(block, "master", values)

    def step(self, hyper: list[AdamWHyper], steps_before: int) -> None:
        """One AdamW step of every resident block; ``hyper``: the engine's param groups at this step
        (gradients x their ``grad_scale``); ``steps_before``: the engine's step count so far."""
        if self._steps_unknown:
            self.optimizer.set_steps(steps_before)
            self._steps_unknown = False
        self.optimizer.step(hyper)

    def grad_norms(self, grad_scale: float) -> dict[int, torch.Tensor]:
        """fp32 L2 norm of each resident parameter's gradient x ``grad_scale``, by id(parameter)."""
        return self.optimizer.grad_norms(grad_scale)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
