"""Whole values of a wrapped model: ``model.state_dict()`` and its ``load_state_dict``, over the
store where the block states live (the optimizer's and the engine's own: ``optimizer_state``).

``EngineStates`` (``engine.states``) reads and writes block states one block at a time, by full
parameter name; ``model.state_dict()`` holds the fp32 masters in each parameter's pre-``wrap``
dtype (a bf16 run resumes without rounding). As in PyTorch, host-store entries are views, not
copies (copy them to keep a snapshot); states on disk are read into a copy. Loading stages one
block at a time.
"""

from __future__ import annotations

import torch

__all__ = ["EngineStates", "install_model_hooks", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW states kept per parameter besides its value (torch's names)."""


class EngineStates:
    """Every parameter's fp32 value and AdamW state, by full model name, wherever it lives.

    ``engine.states``. Reads synchronize the engine first (every host update has landed); writes
    are refused while a forward/backward pass is in progress.
    """

    def __init__(self, block_names: list[list[str]], head_tail_names: list[str], *, store, window, resident,
                 device_optimizer, head_tail_params: list[torch.nn.Parameter], executor) -> None:
        """``store``, ``window``: the engine's host store and window, where streamed blocks live;
        ``resident``: its resident blocks (``ResidentBlocks``); ``device_optimizer``: the head and
        tail's AdamW; ``head_tail_params``: the head and tail parameters, in ``head_tail_names``'
        order; ``executor``: the pass executor (is a pass in progress, drain everything in flight)."""
        self._store, self._window, self._resident, self._executor = store, window, resident, executor
        self._device_optimizer, self._head_tail_params = device_optimizer, head_tail_params
        self.block_names = block_names
        """Full model names of each block's parameters, in layout order (every block: the resident
        ones first, then the streamed ones)."""
        self.head_tail_names = head_tail_names
        """Full model names of the head and tail parameters (device-resident), in optimizer order."""

    def writable(self) -> None:
        """Wait for the engine's copies; RuntimeError during a forward/backward pass (load between steps)."""
        if self._executor.in_pass():
            raise RuntimeError("cannot load state during a forward/backward pass; load between steps")
        self._executor.synchronize()

    def block_params(self, block: int) -> list[torch.nn.Parameter]:
        """The ``Parameter`` objects of ``block`` (any block, resident or streamed), layout order."""
        k = self._resident.count
        return self._resident.block_params[block] if block < k else self._window.params[block - k]

    def block_trainable(self, block: int) -> list[bool]:
        """Whether each of ``block``'s parameters trains (layout order: the trainable ones first)."""
        return [p.requires_grad for p in self.block_params(block)]

    def block_shapes(self, block: int) -> list[tuple[int, ...]]:
        """Shapes of ``block``'s parameters, layout order."""
        k = self._resident.count
        if block < k:
            return [tuple(m.shape) for m in self._resident.read(block, "master")]
        return [tuple(span.shape) for span in self._store.layouts[block - k].spans]

    def read_block(self, block: int, states=("master", *MOMENTS)) -> dict[str, dict[str, torch.Tensor]]:
        """``{state: {name: tensor}}`` of ``block`` for ``states``, layout order. ``master`` is the
        value of every parameter: fp32 for a trainable one, a frozen one's stored value in the
        compute dtype; the moments (fp32) are the trainable parameters' only.

        Views into the store or the resident block's device tensors (valid until the next update)
        or, for a state on disk, into a copy.
        """
        self._executor.synchronize()
        names, k = self.block_names[block], self._resident.count
        if block < k:
            return {state: dict(zip(names, self._resident.read(block, state))) for state in states}
        store, b = self._store, block - k
        layout = store.layouts[b]
        out = {}
        for state in states:
            flat = store.read_state(b, state)
            values = layout.train_views(flat)
            if state == "master":  # the frozen parameters live in the upload state (the master in fp32)
                values += layout.frozen_views(flat) if state == store.upload_state else store.frozen_values(b)
            out[state] = dict(zip(names, values))
        return out

    def write_block(self, block: int, values: dict[str, list[torch.Tensor]]) -> None:
        """Overwrite ``states`` of ``block``: ``{state: [tensors, layout order]}``, one per parameter
        for ``master`` (which refreshes the compute-precision shadow too; a frozen parameter's value
        is stored in the compute dtype), one per trainable parameter for a moment. Counts and shapes
        are checked (ValueError)."""
        self.writable()
        shapes, k = self.block_shapes(block), self._resident.count
        trainable = sum(self.block_trainable(block))
        for state, tensors in values.items():
            want, what = (len(shapes), "parameters") if state == "master" else (trainable, "trainable parameters")
            if len(tensors) != want:
                raise ValueError(f"write_block: block {block} has {want} {what}, got {len(tensors)} {state} tensors")
            for name, shape, t in zip(self.block_names[block], shapes, tensors):
                if tuple(t.shape) != shape:
                    raise ValueError(f"write_block: {state} of {name} must have shape {shape}, "
                                     f"got {tuple(t.shape)}")
        store = self._store
        for state, tensors in values.items():
            if block < k:
                self._resident.write(block, state, tensors)
                continue
            if trainable:
                store.write_state(block - k, state, tensors[:trainable])
                if state == "master" and store.has_shadow:
                    store.write_state(block - k, "shadow", tensors[:trainable])
            if state == "master" and trainable < len(tensors):
                store.write_frozen(block - k, tensors[trainable:])

    def _optimizer_index(self, index: int) -> int | None:
        """Head/tail parameter ``index``'s index in the device AdamW (None: frozen, not in it)."""
        p = self._head_tail_params[index]
        return next((i for i, q in enumerate(self._device_optimizer.params) if q is p), None)

    def head_tail(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, dict]]:
        """``(name, parameter, fp32 master, AdamW state)`` per head/tail parameter; the state is
        torch's (``step``, ``exp_avg``, ``exp_avg_sq``; empty before the first update). A frozen
        parameter's "master" is the parameter's own value (compute dtype) and its state empty."""
        self._executor.synchronize()
        dev = self._device_optimizer
        index = {id(p): i for i, p in enumerate(dev.params)}
        out = []
        for name, p in zip(self.head_tail_names, self._head_tail_params):
            i = index.get(id(p))
            out.append((name, p, p.detach(), {}) if i is None
                       else (name, p, dev.masters[i].detach(), dev.state_of(i)))
        return out

    @torch.no_grad()
    def write_head_tail(self, index: int, master: torch.Tensor | None = None, state: dict | None = None) -> None:
        """Overwrite head/tail parameter ``index``'s value (and its compute copy) and/or AdamW state
        (``{}`` clears it; a frozen parameter has none)."""
        self.writable()
        dev, i = self._device_optimizer, self._optimizer_index(index)
        p = self._head_tail_params[index]
        m = p if i is None else dev.masters[i]
        if master is not None:
            if tuple(master.shape) != tuple(m.shape):
                raise ValueError(f"write_head_tail: {self.head_tail_names[index]} must have shape "
                                 f"{tuple(m.shape)}, got {tuple(master.shape)}")
            m.copy_(master)
            if m is not p:
                p.copy_(m)
        if state and i is None:
            raise ValueError(f"write_head_tail: {self.head_tail_names[index]} is frozen (requires_grad=False) "
                             "and has no optimizer state")
        if state is not None and i is not None:
            dev.load_state(i, state)

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 value of every parameter by its model name (host store for blocks; a frozen
        parameter's stored value, in fp32)."""
        out = {}
        for b in range(len(self.block_names)):
            out.update(self.read_block(b, ("master",))["master"])
        for name, _, m, _ in self.head_tail():
            out[name] = m
        return {name: v.float() for name, v in out.items()}


# ---- model.state_dict() / load_state_dict()


def install_model_hooks(states: EngineStates, model: torch.nn.Module, blocks: torch.nn.ModuleList,
                        saved_dtypes: dict[str, torch.dtype], *, store, window, resident, device_optimizer,
                        head_tail_params: list[torch.nn.Parameter]) -> None:
    """Make ``state_dict()`` of ``model`` (or of any module containing blocks) return every
    parameter's fp32 master (the store's for streamed blocks) in its dtype before ``wrap``
    (``saved_dtypes``, by full name), and ``load_state_dict()`` write the masters through
    ``states``; ``store`` and ``window`` hold the streamed blocks, ``resident`` the resident ones,
    ``device_optimizer`` the masters of ``head_tail_params``."""
    for b, block in enumerate(blocks):
        _hook_block(states, resident.count + b, b, block, saved_dtypes, store.layouts[b].spans, window)
    block_modules = {id(m) for block in blocks for m in block.modules()}
    names = {id(p): name for name, p in model.named_parameters()}
    head_tail_index = {id(p): j for j, p in enumerate(head_tail_params)}

    def write_head_tail(i: int, value: torch.Tensor) -> None:
        states.write_head_tail(head_tail_index[id(device_optimizer.params[i])], master=value)

    # head/tail and resident blocks: in bf16/fp16 their fp32 masters are copies beside the parameters
    for dev, write in ((device_optimizer, write_head_tail),
                       (resident.optimizer, _resident_master_writer(states, resident))):
        index = {id(p): i for i, p in enumerate(dev.params)}
        for module in model.modules():
            if id(module) in block_modules:
                continue
            own = {name: index[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in index}
            separate = {name: i for name, i in own.items() if dev.masters[i] is not dev.params[i]}
            if separate:
                module.register_load_state_dict_pre_hook(_master_loader(dev, separate, write))
            dtypes = {name: saved_dtypes[names[id(dev.params[i])]] for name, i in own.items()}
            saved = {name: i for name, i in own.items() if name in separate or dtypes[name] != dev.params[i].dtype}
            if saved:
                module.register_state_dict_post_hook(_master_saver(dev, saved, dtypes))
    # frozen head/tail and resident parameters: their one copy, in the compute dtype, saved in their
    # dtype before wrap (torch's own load copies a value into them)
    on_device = [*head_tail_params, *(p for ps in resident.block_params for p in ps)]
    device_frozen = {id(p) for p in on_device if not p.requires_grad}
    for module in model.modules():
        if id(module) in block_modules:
            continue
        dtypes = {name: saved_dtypes[names[id(p)]] for name, p in module.named_parameters(recurse=False)
                  if id(p) in device_frozen and p.dtype != saved_dtypes[names[id(p)]]}
        if dtypes:
            module.register_state_dict_post_hook(_frozen_saver(dtypes))


def _frozen_saver(dtypes: dict[str, torch.dtype]):
    def save_frozen(module, state_dict, prefix, local_metadata) -> None:
        for name, dtype in dtypes.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = state_dict[prefix + name].to(dtype)

    return save_frozen


def _master_saver(dev, own: dict[str, int], dtypes: dict[str, torch.dtype]):
    def save_masters(module, state_dict, prefix, local_metadata) -> None:
        for name, index in own.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = dev.masters[index].detach().to(dtypes[name])

    return save_masters


def _resident_master_writer(states: EngineStates, resident):
    def write(index: int, value: torch.Tensor) -> None:
        states.writable()
        resident.write_master(index, value)

    return write


def _master_loader(dev, own: dict[str, int], write):
    def load_masters(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, index in own.items():
            value = state_dict.get(prefix + name)
            if value is not None and tuple(value.shape) == tuple(dev.masters[index].shape):
                write(index, value)

    return load_masters


def _hook_block(states: EngineStates, g: int, b: int, block: torch.nn.Module, saved_dtypes: dict[str, torch.dtype],
                spans, window) -> None:
    """Hooks of streamed block ``b``, the model's block ``g`` (after the resident ones; ``spans``:
    its parameters in the store's layout)."""
    params = window.params[b]
    dtypes = [saved_dtypes[name] for name in states.block_names[g]]

    def save(module, state_dict, prefix, local_metadata) -> None:
        masters = states.read_block(g, ("master",))["master"].values()
        for span, value, dtype in zip(spans, masters, dtypes):
            key = prefix + span.name
            if key in state_dict:
                state_dict[key] = value.to(dtype)  # fp32: the store's view itself

    def stage(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) is not supported on a wrapped model: its block "
                             "parameters live in the store; load with assign=False")
        states.writable()
        # NOTE: torch copies each value into the parameter; give it one block of fp32 staging
        # tensors holding the current values (so keys missing under strict=False keep them).
        masters = states.read_block(g, ("master",))["master"].values()
        for p, value in zip(params, masters):
            p.data = value.clone()

    def commit(module, incompatible_keys) -> None:
        staged = [p.data for p in params]
        window.unbind(b)
        states.write_block(g, {"master": staged})

    block.register_state_dict_post_hook(save)
    block.register_load_state_dict_pre_hook(stage)
    block.register_load_state_dict_post_hook(commit)
