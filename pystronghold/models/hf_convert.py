"""A checkpoint's stored tensors -> the model's parameters, and back, by transformers' own
conversion mapping, one block at a time.

``CheckpointPlan`` groups the stored tensors by the parameter they make (renamed legacy names,
per-expert tensors fused), as transformers' loader does, and dry-runs every group on ``meta``
tensors from the shard headers to check names and shapes and assign it to a block (or head/tail)
without reading data; a group spanning blocks is refused. ``tensors(block)`` reads one block.
``hub_layout`` is the reverse (``revert_weight_conversion``), for saving. Needs
``transformers.core_model_loading`` (transformers >= 5.0).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from pystronghold.models.hf_shards import SafetensorsShards

__all__ = ["CheckpointPlan", "HEAD_TAIL", "block_of", "hub_layout"]

HEAD_TAIL = None
"""The "block" of the parameters outside the block stack (embeddings, final norm, LM head)."""


def block_of(name: str, blocks_name: str) -> int | None:
    """The block index of the model's tensor ``name`` (``blocks_name.i....``), None outside the stack."""
    if not name.startswith(blocks_name + "."):
        return HEAD_TAIL
    return int(name[len(blocks_name) + 1:].split(".", 1)[0])


@dataclass(slots=True)
class _Group:
    """Stored tensors that make one or more parameters together (transformers' unit of loading)."""

    transform: object
    """transformers' ``WeightRenaming`` or ``WeightConverter``, shared and never run itself: each
    run works on a fresh copy (``add_tensor`` fills it)."""
    target: str
    """The first parameter it makes (transformers' key of the group)."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """(source pattern, stored name) of each tensor it reads."""


class CheckpointPlan:
    """Which stored tensors make which parameters of ``model`` (parameters possibly on ``meta``), by
    block. ValueError (one line) when a parameter is made by no stored tensor, with another shape,
    from a non-float tensor, or together with another block's."""

    def __init__(self, model: nn.Module, shards: SafetensorsShards, blocks_name: str) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.model, self.shards, self.blocks_name = model, shards, blocks_name
        model_tensors = model.state_dict()  # parameters and persistent buffers; meta tensors cost nothing
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        converter_of = {pattern: t for t in converters for pattern in t.source_patterns}
        prefix = getattr(model, "base_model_prefix", None) or None
        groups: dict[str, _Group] = {}
        for stored in sorted(shards.weight_map, key=dot_natural_key):  # the loader's order (renamings keep state)
            target, pattern = rename_source_key(stored, renamings, converters, prefix, model_tensors)
            if target not in model_tensors and stored in model_tensors:
                target, pattern = rename_source_key(stored, [], [], prefix, model_tensors)
            if target not in model_tensors:
                continue  # a tensor the model does not have: transformers ignores it too
            if pattern is None:
                group = groups.setdefault(target, _Group(WeightRenaming(stored, target), target))
                pattern = stored
            else:
                group = groups.setdefault(target, _Group(converter_of[pattern], target))
            group.sources.append((pattern, stored))
        self.groups: dict[int | None, list[_Group]] = {}
        self.made: set[str] = set()
        """Every model tensor name some group makes."""
        for group in groups.values():
            self.groups.setdefault(self._check(group, model_tensors), []).append(group)

    def tensors(self, block: int | None) -> Iterator[dict[str, torch.Tensor]]:
        """Block ``block``'s tensors (None: the head and tail's) by model name, fp32, read from the
        shards and converted one group at a time."""
        for group in self.groups.get(block, ()):
            yield self._run(group, self.shards.read)

    def _run(self, group: _Group, read) -> dict[str, torch.Tensor]:
        transform = copy.deepcopy(group.transform)
        for pattern, stored in group.sources:  # a callable: transformers' synchronous loading reads it
            transform.add_tensor(group.target, stored, pattern, functools.partial(read, stored))
        with torch.no_grad():
            made = transform.convert(group.target, model=self.model, config=self.model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}

    def _check(self, group: _Group, model_tensors: dict[str, torch.Tensor]) -> int | None:
        """Run ``group`` on meta tensors: what it makes must be the model's, with its shapes, in one
        block; returns that block."""
        def header(stored: str) -> torch.Tensor:
            return torch.empty(self.shards.float_shape(stored), dtype=torch.float32, device="meta")

        try:
            made = self._run(group, header)
        except ValueError:  # the shards' own (a non-float tensor)
            raise
        except Exception as e:  # an op that cannot make this model's tensors from these
            raise ValueError(f"{self.shards.directory}: transformers' conversion of {self._named(group)} failed "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        blocks = {block_of(name, self.blocks_name) for name in made}
        if len(blocks) > 1:
            raise ValueError(f"{self.shards.directory}: transformers' conversion of {self._named(group)} makes "
                             f"tensors of several blocks ({', '.join(map(str, sorted(blocks, key=str)))}); it cannot "
                             "be loaded one block at a time")
        for name, tensor in made.items():
            if name not in model_tensors:
                raise ValueError(f"{self.shards.directory}: transformers' conversion of {self._named(group)} makes "
                                 f"{name!r}, which the model built from config.json does not have")
            want = tuple(model_tensors[name].shape)
            if tuple(tensor.shape) != want:
                if len(group.sources) == 1 and len(made) == 1:  # a plain (renamed) tensor
                    stored = group.sources[0][1]
                    raise ValueError(f"{self.shards.file_of(stored)}: tensor {stored!r} has shape "
                                     f"{list(tensor.shape)}, config.json makes it {list(want)}")
                raise ValueError(f"{self.shards.directory}: {self._named(group)} convert to {name!r} of shape "
                                 f"{list(tensor.shape)}, config.json makes it {list(want)}")
        self.made.update(made)
        return blocks.pop() if blocks else HEAD_TAIL

    @staticmethod
    def _named(group: _Group) -> str:
        names = [stored for _, stored in group.sources]
        return f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def hub_layout(model: nn.Module, blocks_name: str,
               weight_dicts: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """``weight_dicts`` (dicts of the model's tensors by its names, in any grouping) in the layout
    of the family's checkpoints (``revert_weight_conversion``), one block at a time: a block is
    converted and yielded as soon as all its parameters have arrived, the head and tail last. So
    no more than the head and tail plus the blocks arriving interleaved are held at once."""
    from transformers.core_model_loading import revert_weight_conversion

    expected = Counter(block_of(name, blocks_name) for name, _ in model.named_parameters())
    pending: dict[int | None, dict[str, torch.Tensor]] = {}
    for weights in weight_dicts:
        for name, tensor in weights.items():
            block = block_of(name, blocks_name)
            part = pending.setdefault(block, {})
            part[name] = tensor
            if block is not HEAD_TAIL and len(part) == expected[block]:
                yield revert_weight_conversion(model, pending.pop(block))
    for part in pending.values():
        yield revert_weight_conversion(model, part)
