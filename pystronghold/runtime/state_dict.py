"""Whole values of a wrapped model: ``model.state_dict()``, ``engine.optimizer.state_dict()``,
``engine.state_dict()`` and their ``load_state_dict``, over the store where the block states live.

``EngineStates`` (``engine.states``) reads and writes block states one block at a time, by full
parameter name; ``model.state_dict()`` holds the fp32 masters in each parameter's pre-``wrap``
dtype (a bf16 run resumes without rounding), the optimizer's is torch AdamW's format, and
``engine_state_dict`` holds step counts, the fp16 loss scale and the layer-drop draws. As in
PyTorch, host-store entries are views, not copies (copy them to keep a snapshot); states on disk
are read into a copy. Loading stages one block at a time.
"""

from __future__ import annotations

import torch

__all__ = ["EngineStates", "install_model_hooks", "optimizer_state_dict", "load_optimizer_state_dict",
           "block_step_counts", "set_block_step_counts", "engine_state_dict", "load_engine_state_dict"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW states kept per parameter besides its value (torch's names)."""
_TORCH_ONLY_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                            differentiable=False, fused=None, decoupled_weight_decay=True)
"""Keys of a ``torch.optim.AdamW`` param group this optimizer does not vary, at the values it implements."""


class EngineStates:
    """Every parameter's fp32 value and AdamW state, by full model name, wherever it lives.

    ``engine.states``. Reads synchronize the engine first (every host update has landed); writes
    are refused while a forward/backward pass is in progress.
    """

    def __init__(self, engine, block_names: list[list[str]], head_tail_names: list[str], *, store, window) -> None:
        """``store``, ``window``: the engine's host store and window, where streamed blocks live."""
        self._engine, self._store, self._window = engine, store, window
        self.block_names = block_names
        """Full model names of each block's parameters, in layout order (every block: the resident
        ones first, then the streamed ones)."""
        self.head_tail_names = head_tail_names
        """Full model names of the head and tail parameters (device-resident), in optimizer order."""

    def _writable(self) -> None:
        if self._engine.in_pass():
            raise RuntimeError("cannot load state during a forward/backward pass; load between steps")
        self._engine.synchronize()

    def block_params(self, block: int) -> list[torch.nn.Parameter]:
        """The ``Parameter`` objects of ``block`` (any block, resident or streamed), layout order."""
        engine = self._engine
        k = engine.resident.count
        return engine.resident.block_params[block] if block < k else self._window.params[block - k]

    def block_trainable(self, block: int) -> list[bool]:
        """Whether each of ``block``'s parameters trains (layout order: the trainable ones first)."""
        return [p.requires_grad for p in self.block_params(block)]

    def block_shapes(self, block: int) -> list[tuple[int, ...]]:
        """Shapes of ``block``'s parameters, layout order."""
        engine = self._engine
        k = engine.resident.count
        if block < k:
            return [tuple(m.shape) for m in engine.resident.read(block, "master")]
        return [tuple(span.shape) for span in self._store.layouts[block - k].spans]

    def read_block(self, block: int, states=("master", *MOMENTS)) -> dict[str, dict[str, torch.Tensor]]:
        """``{state: {name: tensor}}`` of ``block`` for ``states``, layout order. ``master`` is the
        value of every parameter: fp32 for a trainable one, a frozen one's stored value in the
        compute dtype; the moments (fp32) are the trainable parameters' only.

        Views into the store or the resident block's device tensors (valid until the next update)
        or, for a state on disk, into a copy.
        """
        engine = self._engine
        engine.synchronize()
        names, k = self.block_names[block], engine.resident.count
        if block < k:
            return {state: dict(zip(names, engine.resident.read(block, state))) for state in states}
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
        self._writable()
        engine = self._engine
        shapes, k = self.block_shapes(block), engine.resident.count
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
                engine.resident.write(block, state, tensors)
                continue
            if trainable:
                store.write_state(block - k, state, tensors[:trainable])
                if state == "master" and store.has_shadow:
                    store.write_state(block - k, "shadow", tensors[:trainable])
            if state == "master" and trainable < len(tensors):
                store.write_frozen(block - k, tensors[trainable:])

    def _optimizer_index(self, index: int) -> int | None:
        """Head/tail parameter ``index``'s index in the device AdamW (None: frozen, not in it)."""
        engine = self._engine
        p = engine.head_tail_params[index]
        return next((i for i, q in enumerate(engine.device_optimizer.params) if q is p), None)

    def head_tail(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, dict]]:
        """``(name, parameter, fp32 master, AdamW state)`` per head/tail parameter; the state is
        torch's (``step``, ``exp_avg``, ``exp_avg_sq``; empty before the first update). A frozen
        parameter's "master" is the parameter's own value (compute dtype) and its state empty."""
        engine = self._engine
        engine.synchronize()
        dev = engine.device_optimizer
        index = {id(p): i for i, p in enumerate(dev.params)}
        out = []
        for name, p in zip(self.head_tail_names, engine.head_tail_params):
            i = index.get(id(p))
            out.append((name, p, p.detach(), {}) if i is None
                       else (name, p, dev.masters[i].detach(), dev.state_of(i)))
        return out

    @torch.no_grad()
    def write_head_tail(self, index: int, master: torch.Tensor | None = None, state: dict | None = None) -> None:
        """Overwrite head/tail parameter ``index``'s value (and its compute copy) and/or AdamW state
        (``{}`` clears it; a frozen parameter has none)."""
        self._writable()
        dev, i = self._engine.device_optimizer, self._optimizer_index(index)
        p = self._engine.head_tail_params[index]
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


def install_model_hooks(engine, model: torch.nn.Module, blocks: torch.nn.ModuleList,
                        saved_dtypes: dict[str, torch.dtype], *, store, window) -> None:
    """Make ``state_dict()`` of ``model`` (or of any module containing blocks) return every
    parameter's fp32 master (the store's for streamed blocks) in its dtype before ``wrap``
    (``saved_dtypes``, by full name), and ``load_state_dict()`` write the masters; ``store`` and
    ``window`` hold the streamed blocks."""
    for b, block in enumerate(blocks):
        _hook_block(engine, b, block, saved_dtypes, store.layouts[b].spans, window)
    block_modules = {id(m) for block in blocks for m in block.modules()}
    names = {id(p): name for name, p in model.named_parameters()}
    head_tail_index = {id(p): j for j, p in enumerate(engine.head_tail_params)}

    def write_head_tail(i: int, value: torch.Tensor) -> None:
        engine.states.write_head_tail(head_tail_index[id(engine.device_optimizer.params[i])], master=value)

    # head/tail and resident blocks: in bf16/fp16 their fp32 masters are copies beside the parameters
    for dev, write in ((engine.device_optimizer, write_head_tail),
                       (engine.resident.optimizer, _resident_master_writer(engine))):
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
    on_device = [*engine.head_tail_params, *(p for ps in engine.resident.block_params for p in ps)]
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


def _resident_master_writer(engine):
    def write(index: int, value: torch.Tensor) -> None:
        engine.states._writable()
        engine.resident.write_master(index, value)

    return write


def _master_loader(dev, own: dict[str, int], write):
    def load_masters(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, index in own.items():
            value = state_dict.get(prefix + name)
            if value is not None and tuple(value.shape) == tuple(dev.masters[index].shape):
                write(index, value)

    return load_masters


def _hook_block(engine, b: int, block: torch.nn.Module, saved_dtypes: dict[str, torch.dtype], spans, window) -> None:
    """Hooks of streamed block ``b`` (its global index is ``resident.count + b``; ``spans``: its
    parameters in the store's layout)."""
    params = window.params[b]
    g = engine.resident.count + b
    dtypes = [saved_dtypes[name] for name in engine.states.block_names[g]]

    def save(module, state_dict, prefix, local_metadata) -> None:
        masters = engine.states.read_block(g, ("master",))["master"].values()
        for span, value, dtype in zip(spans, masters, dtypes):
            key = prefix + span.name
            if key in state_dict:
                state_dict[key] = value.to(dtype)  # fp32: the store's view itself

    def stage(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) is not supported on a wrapped model: its block "
                             "parameters live in the store; load with assign=False")
        engine.states._writable()
        # NOTE: torch copies each value into the parameter; give it one block of fp32 staging
        # tensors holding the current values (so keys missing under strict=False keep them).
        masters = engine.states.read_block(g, ("master",))["master"].values()
        for p, value in zip(params, masters):
            p.data = value.clone()

    def commit(module, incompatible_keys) -> None:
        staged = [p.data for p in params]
        window.unbind(b)
        engine.states.write_block(g, {"master": staged})

    block.register_state_dict_post_hook(save)
    block.register_load_state_dict_pre_hook(stage)
    block.register_load_state_dict_post_hook(commit)


# ---- engine.optimizer.state_dict() / load_state_dict(): torch AdamW's format


def optimizer_state_dict(engine) -> dict:
    """``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [group, ...]}`` as
    ``torch.optim.AdamW(groups).state_dict()`` has it for the engine's param groups (parameters
    numbered group after group); the moments are the live tensors (views into the store, or copies
    of a block on disk), as torch's are."""
    groups = engine.optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    state: dict[int, dict] = {}
    states = engine.states
    steps = block_step_counts(engine)
    for b in range(engine.n_blocks):
        if steps[b] == 0:  # never updated (no step yet, or layer drop skipped it so far): no state, as torch
            continue
        moments = states.read_block(b, MOMENTS)
        for name, p in zip(states.block_names[b], states.block_params(b)):
            if id(p) in index:  # a frozen parameter is in no param group and has no state
                state[index[id(p)]] = {"step": torch.tensor(float(steps[b])),
                                       **{m: moments[m][name] for m in MOMENTS}}
    for _, p, _, st in states.head_tail():
        if st:
            state[index[id(p)]] = dict(st)
    saved_groups, start = [], 0
    for g in groups:
        group = {k: v for k, v in g.items() if k != "params"}
        for key, value in _TORCH_ONLY_DEFAULTS.items():
            group.setdefault(key, value)
        group["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        saved_groups.append(group)
    return {"state": dict(sorted(state.items())), "param_groups": saved_groups}


def block_step_counts(engine) -> list[int]:
    """AdamW step count of every block of the model, resident ones (updated at every step) first."""
    return [engine.steps] * (engine.n_blocks - engine.n_streamed) + list(engine.block_steps)


def set_block_step_counts(engine, counts: list[int], what: str) -> None:
    """Set each block's AdamW step count from ``counts`` (one per model block, ``block_step_counts``'s
    order), after ``engine.steps``; ValueError naming ``what`` when a resident block's count is not
    the engine's (a resident block is updated at every step)."""
    _check_block_step_counts(engine, engine.steps, counts, what)
    engine.block_steps = [int(c) for c in counts[engine.n_blocks - engine.n_streamed:]]


def _check_block_step_counts(engine, steps: int, counts: list[int], what: str) -> None:
    k = engine.n_blocks - engine.n_streamed
    if len(counts) != engine.n_blocks or any(c != steps for c in counts[:k]):
        raise ValueError(f"{what}: step counts per block {list(counts)} do not fit {engine.n_blocks} blocks whose "
                         f"first {k} (resident, updated at every step) are at the engine's {steps}")


# ---- engine.state_dict() / load_state_dict(): what the engine itself holds

ENGINE_STATE_KEYS = ("steps", "skipped_steps", "block_steps", "loss_scaler", "layer_drop")
"""The keys of ``engine_state_dict``."""


def engine_state_dict(engine) -> dict:
    """What a resumed run needs besides the model's and the optimizer's state dicts: ``steps``
    (optimizer steps taken), ``skipped_steps`` (fp16 overflows), ``block_steps`` (each model block's
    AdamW step count, ``block_step_counts``), ``loss_scaler`` (the fp16 scale and its clean-step
    count; None in fp32/bf16) and ``layer_drop`` (its generator's state; None without layer drop).
    Plain Python values and tensors: ``torch.save`` writes it."""
    return {"steps": engine.steps, "skipped_steps": engine.skipped_steps, "block_steps": block_step_counts(engine),
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "layer_drop": engine.layer_drop.state_dict() if engine.layer_drop.enabled else None}


def load_engine_state_dict(engine, state: dict) -> None:
    """Load ``engine_state_dict``'s values, between steps; checked before anything changes. A loss
    scale loads into an fp16 engine only (one that finds none keeps its initial scale), and the
    layer-drop draws into an engine with layer drop (one that finds none starts from its seed)."""
    missing = [k for k in ENGINE_STATE_KEYS if k not in state] if isinstance(state, dict) else ENGINE_STATE_KEYS
    if missing:
        raise ValueError(f"engine.load_state_dict: the state has no {', '.join(missing)}; pass what "
                         "engine.state_dict() returned")
    if engine.micro_batches or engine.in_pass():
        raise RuntimeError("engine.load_state_dict: a step is in progress (forward/backward passes since "
                           "the last step); load between steps")
    steps = int(state["steps"])
    _check_block_step_counts(engine, steps, list(state["block_steps"]), "engine.load_state_dict")
    engine.synchronize()
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])  # checks the state first
    if engine.layer_drop.enabled and state["layer_drop"] is not None:
        engine.layer_drop.load_state_dict(state["layer_drop"])
    engine.steps, engine.skipped_steps = steps, int(state["skipped_steps"])
    set_block_step_counts(engine, list(state["block_steps"]), "engine.load_state_dict")


def _check_group(group: dict) -> None:
    for key, value in _TORCH_ONLY_DEFAULTS.items():
        if key in ("foreach", "fused", "decoupled_weight_decay"):
            continue
        if group.get(key, value) != value:
            raise ValueError(f"optimizer.load_state_dict: {key}={group[key]!r} is not supported (only {value!r})")
    if not group.get("decoupled_weight_decay", True) and group.get("weight_decay", 0):
        raise ValueError("optimizer.load_state_dict: a torch.optim.Adam state (L2 weight decay) cannot "
                         "load into AdamW (decoupled weight decay)")
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key not in group:
            raise ValueError(f"optimizer.load_state_dict: the param group has no {key!r}")


@torch.no_grad()
def load_optimizer_state_dict(engine, state_dict: dict) -> None:
    """Load a ``torch.optim.AdamW`` state dict (or one from ``optimizer_state_dict``) made over the
    same parameters in the same param groups as the engine's. Everything is checked before anything
    changes."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    mine = engine.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise ValueError(f"optimizer.load_state_dict: expected {len(mine)} param group(s) (the engine's "
                         f"optimizer has {len(mine)}, see AdamW.decay), got "
                         f"{len(groups) if isinstance(groups, list) else 'no param_groups'}")
    by_saved = {}
    for k, (group, own) in enumerate(zip(groups, mine)):
        _check_group(group)
        if len(group["params"]) != len(own["params"]):
            raise ValueError(f"optimizer.load_state_dict: param group {k} of the state dict has "
                             f"{len(group['params'])} parameters, the engine's {len(own['params'])}")
        by_saved.update(zip(group["params"], own["params"]))
    params = [p for g in mine for p in g["params"]]
    by_id = {id(p): None for p in params}
    for saved, st in state_dict.get("state", {}).items():
        if saved not in by_saved:
            raise ValueError(f"optimizer.load_state_dict: state for parameter index {saved!r}, which is "
                             "not in the param group")
        by_id[id(by_saved[saved])] = st
    states = engine.states
    # ---- blocks: one step count per block (its parameters are updated together; layer drop may skip
    # a block in some steps, so blocks may differ), resident blocks at the engine's count
    block_moments, block_steps = [], []
    for b in range(engine.n_blocks):
        per_block, steps = [], set()
        for name, p, shape in zip(states.block_names[b], states.block_params(b), states.block_shapes(b)):
            if id(p) not in by_id:
                continue  # frozen: no optimizer state
            st = by_id[id(p)]
            if st:
                _check_moments(name, st, shape)
            steps.add(float(st["step"]) if st else 0.0)
            per_block.append(st)
        if len(steps) > 1:
            raise ValueError(f"optimizer.load_state_dict: the parameters of block {b} must all have AdamW state "
                             f"with one step count, or none (the engine updates a block as a whole); got steps "
                             f"{sorted(steps)}")
        block_moments.append(per_block)
        block_steps.append(int(steps.pop()) if steps else None)  # None: a wholly frozen block
    head_tail_steps = [float(by_id[id(p)]["step"]) for _, p, _, _ in states.head_tail() if by_id.get(id(p))]
    engine_steps = int(max([*(s for s in block_steps if s is not None), *head_tail_steps], default=0))
    block_steps = [engine_steps if s is None else s for s in block_steps]
    k_resident = engine.n_blocks - engine.n_streamed
    if any(s != engine_steps for s in block_steps[:k_resident]):
        raise ValueError(f"optimizer.load_state_dict: resident blocks are updated at every step; their step "
                         f"counts {block_steps[:k_resident]} must be the engine's {engine_steps}")
    head_tail = states.head_tail()
    for name, p, m, _ in head_tail:
        if by_id.get(id(p)):
            _check_moments(name, by_id[id(p)], m.shape)
    # ---- apply
    states._writable()
    for b, per_block in enumerate(block_moments):
        shapes = states.block_shapes(b)  # the trainable parameters' come first
        states.write_block(b, {m: [st[m] if st else torch.zeros(shape) for st, shape in zip(per_block, shapes)]
                               for m in MOMENTS})
    for i, (_, p, _, _) in enumerate(head_tail):
        states.write_head_tail(i, state=by_id.get(id(p)) or {})
    engine.steps = engine_steps
    set_block_step_counts(engine, block_steps, "optimizer.load_state_dict")
    for k, group in enumerate(groups):
        mine[k] = {**{key: v for key, v in group.items() if key != "params"}, "params": mine[k]["params"]}


def _check_moments(name: str, st: dict, shape) -> None:
    for key in ("step", *MOMENTS):
        if key not in st:
            raise ValueError(f"optimizer.load_state_dict: the state of {name} has no {key!r}")
    for key in MOMENTS:
        if tuple(st[key].shape) != tuple(shape):
            raise ValueError(f"optimizer.load_state_dict: {key} of {name} has shape {tuple(st[key].shape)}, "
                             f"the parameter {tuple(shape)}")
