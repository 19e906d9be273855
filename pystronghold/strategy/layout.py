"""From the scopes' annotations on a model to a ``Layout``: DP size, stages, TP degree per stage.

The unit is a module with parameters of its own; its strategy is its own annotation, else its
nearest annotated ancestor's, else the default. A module no stage annotates joins the stage of
the next one in registration order that has one, or the last stage. Ranks: stage outermost, then
replica, TP rank innermost (the pipeline runtime's order); stage s owns dp * tp_s consecutive
ranks after those of earlier stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from pystronghold.strategy.scopes import Scope, default_strategy, strategy_of

__all__ = ["StageLayout", "Layout", "layout_of"]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One pipeline stage of every replica."""

    index: int
    """Position in the pipeline, 0 first."""
    modules: tuple[str, ...]
    """Qualified names (``model.named_modules()``) of the parameter-owning modules it runs."""
    tp_size: int
    """Tensor-parallel degree of the stage (its ``split``; 1 without one)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model is laid out over devices, as its scopes say."""

    dp_size: int | None
    """Model replicas (data parallelism); None: whatever devices are left (see ``resolve``)."""
    stages: tuple[StageLayout, ...]
    """Pipeline stages in order (one stage holding every module when no stage scope is used)."""
    num_micro_batch: int
    """Micro-batches per step through the pipeline (1 without a pipeline scope)."""

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return len(self.stages)

    @property
    def devices_per_replica(self) -> int:
        """Devices one replica uses: the sum of the stages' TP degrees."""
        return sum(s.tp_size for s in self.stages)

    @property
    def world_size(self) -> int:
        """Processes the layout needs (dp_size must be known)."""
        if self.dp_size is None:
            raise ValueError("layout: replicate(None) needs a world size; call resolve(world_size)")
        return self.dp_size * self.devices_per_replica

    def resolve(self, world_size: int) -> "Layout":
        """This layout with ``dp_size`` fixed for ``world_size`` processes; ValueError when the
        world does not fit it."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        per = self.devices_per_replica
        if self.dp_size is None:
            if world_size % per:
                raise ValueError(f"replicate(None): the world size {world_size} is not a multiple of "
                                 f"the {per} devices one replica uses (stages' TP degrees)")
            return replace(self, dp_size=world_size // per)
        if self.dp_size * per != world_size:
            raise ValueError(f"replicate({self.dp_size}) x {per} devices per replica = "
                             f"{self.dp_size * per} processes, but the world size is {world_size}")
        return self

    def stage_ranks(self, replica: int, stage: int) -> list[int]:
        """Global ranks of ``stage`` in ``replica`` (its TP group)."""
        dp = self.world_size // self.devices_per_replica
        tp = self.stages[stage].tp_size
        offset = dp * sum(s.tp_size for s in self.stages[:stage]) + replica * tp
        return list(range(offset, offset + tp))

    def dp_groups(self) -> list[list[int]]:
        """Every DP group (same stage and TP rank in each replica), in a fixed order."""
        dp = self.world_size // self.devices_per_replica
        return [[self.stage_ranks(d, s)[t] for d in range(dp)]
                for s in range(self.pp_size) for t in range(self.stages[s].tp_size)]

    def block_ranges(self, model: nn.Module, blocks: nn.ModuleList) -> list[range]:
        """The blocks (indices into ``blocks``, a ModuleList of ``model``) of each stage, as the
        pipeline runtime takes them (``gpt_stage(..., split=...)``). ValueError when the stages do
        not cut the model into a pipeline: a block spread over two stages, stages out of block
        order, a stage without a block, or a module before the first block (the head) off the
        first stage, or after the last (the tail) off the last stage."""
        names = {id(m): n for n, m in model.named_modules()}
        if id(blocks) not in names:
            raise ValueError("block_ranges: blocks is not a submodule of model")
        prefix = names[id(blocks)]
        owner = {name: s.index for s in self.stages for name in s.modules}
        order = [n for n, _ in model.named_modules() if n in owner]  # registration order
        per_block = []
        for i, block in enumerate(blocks):
            inside = {owner[n] for n in owner if n == f"{prefix}.{i}" or n.startswith(f"{prefix}.{i}.")}
            if len(inside) != 1:
                raise ValueError(f"block {prefix}.{i} is spread over stages {sorted(inside)}" if inside
                                 else f"block {prefix}.{i} has no parameters")
            per_block.append(inside.pop())
        if per_block != sorted(per_block) or sorted(set(per_block)) != list(range(self.pp_size)):
            raise ValueError(f"the stages of the blocks {per_block} do not run 0..{self.pp_size - 1} in "
                             "block order, each with at least one block")
        in_blocks = [n.startswith(prefix + ".") for n in order]
        first, last = in_blocks.index(True), len(in_blocks) - 1 - in_blocks[::-1].index(True)
        for k, name in enumerate(order):
            if k < first and owner[name] != 0 or k > last and owner[name] != self.pp_size - 1:
                where = "before the first block: the first" if k < first else "after the last block: the last"
                raise ValueError(f"module {name!r} comes {where} stage must run it, not stage {owner[name]}")
        return [range(per_block.index(s), len(per_block) - per_block[::-1].index(s)) for s in range(self.pp_size)]

    def stage_of(self, module_name: str) -> int:
        """The stage that runs the parameter-owning module ``module_name``; KeyError if none."""
        for s in self.stages:
            if module_name in s.modules:
                return s.index
        raise KeyError(f"no stage runs module {module_name!r}")


def _effective(model: nn.Module) -> list[tuple[str, tuple[Scope, ...]]]:
    """(name, scopes) of every parameter-owning module, in registration order."""
    own = {name: strategy_of(m) for name, m in model.named_modules()}
    rows = []
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        scopes, prefix = own[name], name
        while not scopes and prefix:  # nearest annotated ancestor
            prefix = prefix.rpartition(".")[0]
            scopes = own[prefix]
        rows.append((name, scopes))
    if not rows:
        raise ValueError("layout_of: the model has no parameters")
    return rows


def _find(scopes: tuple[Scope, ...], kind: str) -> Scope | None:
    return next((s for s in scopes if s.kind == kind), None)


def _dp_size(rows) -> int | None:
    sizes = {}
    for name, scopes in rows:
        rep = _find(scopes, "replicate") or _find(default_strategy(), "replicate")
        if rep is not None and rep.device_count is not None:
            sizes.setdefault(rep.device_count, name)
    if len(sizes) > 1:
        (a, na), (b, nb) = list(sizes.items())[:2]
        raise ValueError(f"replicate({a}) on {na!r} and replicate({b}) on {nb!r}: a model has one "
                         "data-parallel size")
    return next(iter(sizes), None)


def layout_of(model: nn.Module, world_size: int | None = None) -> Layout:
    """The ``Layout`` the scopes' annotations on ``model`` describe (resolved for ``world_size``
    when given). ValueError naming the scope for a combination pystronghold cannot run."""
    rows = _effective(model)
    dp = _dp_size(rows)
    stage_of_row = [_find(scopes, "stage") for _, scopes in rows]
    pipes = {}
    for (name, scopes), st in zip(rows, stage_of_row):
        pipe = _find(scopes, "pipeline")
        if pipe is not None and st is None:
            raise ValueError(f"module {name!r} is inside {pipe} but in no stage(): every module of "
                             "a pipeline belongs to one of its stages")
        if st is not None:
            pipes.setdefault(pipe, name)
    if len(pipes) > 1:
        names = [f"{p or 'the default pipeline'} ({n!r})" for p, n in pipes.items()]
        raise ValueError(f"stages of two pipelines, {names[0]} and {names[1]}: a model has one pipeline")
    pipe = next(iter(pipes), None)
    stages = sorted({st.uid: st for st in stage_of_row if st is not None}.values(), key=lambda s: s.uid)
    index = {st.uid: i for i, st in enumerate(stages)}
    assigned: list[int] = []
    for i, st in enumerate(stage_of_row):
        if st is not None:
            assigned.append(index[st.uid])
            continue
        following = next((s for s in stage_of_row[i:] if s is not None), None)
        assigned.append(index[following.uid] if following is not None else max(len(stages) - 1, 0))
    n_stages = max(len(stages), 1)
    members: list[list[str]] = [[] for _ in range(n_stages)]
    splits: list[dict[int, str]] = [{} for _ in range(n_stages)]
    for (name, scopes), s in zip(rows, assigned):
        members[s].append(name)
        sp = _find(scopes, "split")
        if sp is not None:
            splits[s].setdefault(sp.device_count, name)
    for s, found in enumerate(splits):
        if len(found) > 1:
            (a, na), (b, nb) = list(found.items())[:2]
            raise ValueError(f"stage {s} has split({a}) on {na!r} and split({b}) on {nb!r}: one TP "
                             "degree per stage")
    layout = Layout(dp_size=dp, num_micro_batch=pipe.num_micro_batch if pipe is not None else 1,
                    stages=tuple(StageLayout(index=s, modules=tuple(members[s]),
                                             tp_size=next(iter(splits[s]), 1)) for s in range(n_stages)))
    return layout if world_size is None else layout.resolve(world_size)
