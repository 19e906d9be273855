import logging

import pytest
from torch import nn

from pystronghold.models import GPT, GPTConfig
from pystronghold.runtime.blocks.discovery import find_blocks


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def stack(n: int = 3) -> nn.ModuleList:
    return nn.ModuleList(Layer() for _ in range(n))


def nest(path: str, leaf: nn.Module) -> nn.Module:
    """A model whose attribute path (dotted) leads to ``leaf``, with an embedding at the top."""
    root = nn.Module()
    root.embed = nn.Embedding(8, 4)
    node = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = nn.Module()
        child.norm = nn.LayerNorm(4)
        setattr(node, part, child)
        node = child
    setattr(node, parts[-1], leaf)
    return root


@pytest.mark.parametrize("path", [
    "blocks", "layers", "h", "layer",
    "transformer.h", "model.layers", "gpt_neox.layers", "encoder.layer", "transformer.blocks",
    "model.decoder.layers",
])
def test_known_layouts_are_found_by_name(path):
    blocks = stack()
    name, found = find_blocks(nest(path, blocks))
    assert name == path and found is blocks


def test_pystronghold_gpt_and_log(caplog):
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, layers=2, hidden=8, heads=2))
    with caplog.at_level(logging.INFO, logger="pystronghold.runtime.blocks.discovery"):
        name, found = find_blocks(model)
    assert name == "blocks" and found is model.blocks
    assert "blocks" in caplog.text and "2 x Block" in caplog.text


def test_lists_inside_a_block_are_not_stacks():
    class SubLayered(nn.Module):  # T5-style: each block has its own `layer` ModuleList
        def __init__(self) -> None:
            super().__init__()
            self.layer = stack(2)

    model = nest("encoder.block", nn.ModuleList(SubLayered() for _ in range(3)))
    name, found = find_blocks(model)
    assert name == "encoder.block" and len(found) == 3


def test_other_lists_and_empty_lists_are_ignored():
    model = nest("transformer.h", stack())
    model.heads = stack(2)  # a ModuleList with another name
    model.layers = nn.ModuleList()  # empty
    assert find_blocks(model)[0] == "transformer.h"


def test_ambiguous_model_is_refused():
    model = nest("encoder.layer", stack())
    model.decoder = nn.Module()
    model.decoder.layer = stack(2)
    with pytest.raises(ValueError, match="ambiguous") as err:
        find_blocks(model)
    assert "encoder.layer" in str(err.value) and "decoder.layer" in str(err.value)
    assert "blocks=" in str(err.value)


def test_model_without_stack_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="blocks=") as err:
        find_blocks(model)
    assert "no block stack" in str(err.value)


def test_too_deep_is_not_found():
    with pytest.raises(ValueError, match="no block stack"):
        find_blocks(nest("a.b.c.layers", stack()))


def test_not_a_module():
    with pytest.raises(TypeError):
        find_blocks([Layer()])


class Wrapper(nn.Module):
    """Holds a model two levels down and hands it out with ``get_base_model()``, as PEFT's PeftModel."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model

    def get_base_model(self) -> nn.Module:
        return self.base_model.model


def test_wrappers_with_get_base_model_are_looked_through():
    blocks = stack()
    name, found = find_blocks(Wrapper(Wrapper(nest("model.decoder.layers", blocks))))
    assert name == "base_model.model.base_model.model.model.decoder.layers" and found is blocks


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_peft_models_are_looked_through(kind):
    peft = pytest.importorskip("peft")
    from hf_small import MODELS

    model = MODELS[kind]()
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, fan_in_fan_out=kind == "gpt2"))
    name, found = find_blocks(wrapped)
    stack = model.model.layers if kind == "llama" else model.transformer.h
    assert found is stack
    assert name == ("base_model.model.model.layers" if kind == "llama" else "base_model.model.transformer.h")
    assert find_blocks(wrapped.base_model) == (name[len("base_model."):], stack)  # PEFT's LoraModel
