"""``engine.optimizer.state_dict()`` (torch AdamW's format) and ``engine.state_dict()`` (step
counts, the fp16 loss scale, the layer-drop draws), and their ``load_state_dict``, over the block
states ``state_dict.EngineStates`` reads and writes.
"""

from __future__ import annotations

import torch

from pystronghold.runtime.states.state_dict import MOMENTS

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict", "block_step_counts", "set_block_step_counts",
           "ENGINE_STATE_KEYS", "engine_state_dict", "load_engine_state_dict"]

_TORCH_ONLY_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                            differentiable=False, fused=None, decoupled_weight_decay=True)
"""Keys of a ``torch.optim.AdamW`` param group this optimizer does not vary, at the values it implements."""


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
    states.writable()
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
