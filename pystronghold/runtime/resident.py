"""Device-resident blocks: the first K blocks never leave the device.

Their parameters live on the device in compute precision like the head and tail, their fp32 masters
and AdamW moments beside them, and a device ``torch.optim.AdamW`` (fused on CUDA, torch's
single-tensor loop on CPU: the same kernel plain PyTorch runs there) updates them in ``step()``.
No load, copy-out or host update touches them; autograd fills their ``.grad`` as in plain PyTorch.
They keep their activations unless ``resident_recompute`` (then ``torch.utils.checkpoint``).

Why the first blocks: in backward they finish last, so a host update of theirs would have the
least time to hide before the next forward needs them again.

Why the update runs in ``step()`` rather than right after each block's backward: on one compute
stream a device update costs the same wherever it is issued, and issuing it in ``step()`` keeps
clipping, fp16 overflow skips and accumulation exactly plain PyTorch's (the update needs the whole
gradient's norm first). Resident blocks use the engine's step count (layer drop, whose skipped
streamed blocks keep their own, is refused with them); moments written into a resident block (a checkpoint or optimizer state load) take the engine's count at the next step.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from pystronghold.optim.device_adamw import DeviceAdamW, fused_adamw_for
from pystronghold.optim.hyper import AdamW, AdamWHyper
from pystronghold.runtime.prepare import head_tail_bytes

__all__ = ["ResidentBlocks"]


class ResidentBlocks:
    """K blocks with their parameters, masters and AdamW moments on the device."""

    def __init__(self, modules: list[torch.nn.Module], block_params: list[list[torch.nn.Parameter]],
                 spec: AdamW, device: torch.device, dtype: torch.dtype, *, recompute: bool,
                 group_of: dict[int, int] | None = None) -> None:
        """``block_params[i]``: block i's parameters (still at their initial values, on the host or the
        device); they are moved to ``device`` in ``dtype`` after their fp32 masters are taken.
        ``group_of``: the engine's param group of each parameter by id (default: all in group 0)."""
        self.count = len(modules)
        self.block_params = block_params
        flat = [p for ps in block_params for p in ps]
        masters = [p.detach().to(device, torch.float32) for p in flat]
        groups = [group_of[id(p)] for p in flat] if group_of is not None else None
        with torch.no_grad():
            for p in flat:
                p.data = p.data.to(device=device, dtype=dtype)
        self.optimizer = DeviceAdamW(flat, spec, masters, groups, fused=fused_adamw_for(device))
        self.nbytes = head_tail_bytes(flat, dtype)
        """Device bytes: parameters and gradients in compute precision, fp32 moments (and masters)."""
        self._first = [0]
        for ps in block_params:
            self._first.append(self._first[-1] + len(ps))
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
        """Every resident parameter, block 0 first, in each block's ``named_parameters`` order."""
        return self.optimizer.params

    def _indices(self, block: int) -> range:
        return range(self._first[block], self._first[block + 1])

    def read(self, block: int, state: str) -> list[torch.Tensor]:
        """fp32 ``state`` ("master", "exp_avg", "exp_avg_sq") of ``block``'s parameters: the live
        tensors (zeros for a moment before the first update)."""
        opt = self.optimizer
        out = []
        for i in self._indices(block):
            m = opt.masters[i].detach()
            out.append(m if state == "master" else opt.state_of(i).get(state, torch.zeros_like(m)))
        return out

    @torch.no_grad()
    def write(self, block: int, state: str, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``state`` of ``block``'s parameters (shapes checked by the caller); a master
        refreshes the compute-precision parameter too."""
        opt = self.optimizer
        for i, t in zip(self._indices(block), tensors):
            if state == "master":
                opt.masters[i].copy_(t)
                if opt.masters[i] is not opt.params[i]:
                    opt.params[i].copy_(opt.masters[i])
            else:
                opt.write_moment(i, state, t)
                self._steps_unknown = True

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
