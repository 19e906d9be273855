"""Which parts of a Hugging Face base model each pipeline stage holds and runs (``pipelining.hf``),
in one process: the stages chained by hand give the base model's own hidden states, every
parameter that gets a gradient is held by the stage that computed it, and a part whose place is
not known is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pystronghold.models.hf import load_lazy
from pystronghold.options import ConfigError
from pystronghold.parallel.groups import ParallelGroups
from pystronghold.pipelining.hf import hf_chunks

from hf_models import save_tiny

pytest.importorskip("transformers")


def _groups(rank: int, stages: int) -> ParallelGroups:
    """Pipeline rank ``rank`` of ``stages`` (no process group: ``hf_chunks`` runs no collective)."""
    return ParallelGroups(rank=rank, world_size=stages, tp_size=1, dp_size=1, tp_rank=0, dp_rank=0, tp_group=None,
                          dp_group=None, pp_size=stages, pp_rank=rank)


def _loaded(tmp_path, family: str, **overrides):
    lazy = load_lazy(save_tiny(tmp_path, family, tokenizer=False, **overrides))
    for i in range(len(lazy.blocks)):
        lazy.materialize(i)
    return lazy


def test_three_stages_of_an_opt_hold_what_they_run_and_give_its_hidden_states(tmp_path):
    """OPT with a 16-wide embedding and 32-wide blocks: the first stage holds the embedding, the
    position table and the input projection, the middle one a block only (every part a no-op
    there), the last the final norm, the output projection and the LM head."""
    lazy = _loaded(tmp_path, "opt", word_embed_proj_dim=16, dropout=0.0)
    stages = [hf_chunks(lazy, lazy.model, _groups(rank, 3))[0][0] for rank in range(3)]
    outside = [sorted(stage.model_name(n) for n, _ in stage.named_parameters() if not n.startswith("blocks."))
               for stage in stages]
    decoder = "model.decoder."
    assert outside == [
        [decoder + "embed_positions.weight", decoder + "embed_tokens.weight", decoder + "project_in.weight"], [],
        ["lm_head.weight", decoder + "final_layer_norm.bias", decoder + "final_layer_norm.weight",
         decoder + "project_out.weight"]]
    x = torch.randint(0, 300, (2, 16))
    h = x
    for stage in stages:  # each stage's input detached, as a pipeline receives it
        h = stage(h.detach().requires_grad_(h.is_floating_point()))
    want = lazy.model.model(input_ids=x).last_hidden_state  # (B, T, 16) after project_out
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    lazy.model.zero_grad()
    h.sum().backward()  # the last stage alone: only what it holds gets a gradient
    got = {n for n, p in lazy.model.named_parameters() if p.grad is not None}
    assert {n for n in got if not n.startswith(decoder + "layers.")} == set(outside[2]) - {"lm_head.weight"}
    assert {n.split(".")[3] for n in got if n.startswith(decoder + "layers.")} == {"2"}


def test_a_part_of_unknown_place_is_refused_in_one_line(tmp_path):
    """A base-model part named outside ``BASE_PARTS`` may run before the blocks, where a stage that
    does not hold it would not train it (wrong numbers, no error): refused, naming it."""
    lazy = _loaded(tmp_path, "gpt2")
    lazy.model.transformer.extra_norm = nn.LayerNorm(32)
    with pytest.raises(ConfigError) as error:
        hf_chunks(lazy, lazy.model, _groups(0, 2))
    assert error.value.on_command_line().startswith(
        "--pp: GPT2LMHeadModel is not supported with a pipeline yet: its base model holds extra_norm besides the "
        "embedding and the block stack h")
