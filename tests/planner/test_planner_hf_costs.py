"""A Hugging Face model's costs, dense and mixture-of-experts, read from its config: FLOPs held to
torch's FLOP counter on the built block, bytes held to a built engine's."""

from __future__ import annotations

import pytest
import torch

import pystronghold as ph
from pystronghold.planner import Hardware, Workload, gpu_preset
from pystronghold.planner.cost import block_activation_bytes, block_costs, block_forward_flops
from pystronghold.planner.plan import make_plan
from pystronghold.planner.trainable import param_split
from pystronghold.runtime.memory import layout
from pystronghold.runtime.memory.layout import head_tail_bytes
from pystronghold.settings.finetune import FinetuneOptions
from runtime_models import one_torch_thread

transformers = pytest.importorskip("transformers")

_threads = pytest.fixture(autouse=True)(one_torch_thread)

HW = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 << 30, cpu_adam_params_per_s=1e9)


def _config(family: str):
    from hf_models import FAMILIES

    return transformers.AutoConfig.for_model(family, **FAMILIES[family])


def _shape(config, family: str):
    from pystronghold.planner.hf_shape import hf_shape_from_config

    return hf_shape_from_config(config, source="tiny", architecture=family)


def test_moe_shape_counts_every_expert_and_routes_top_k():
    """qwen2_moe: 4 experts of width 24, 2 per token, one shared expert of width 24 with its gate;
    the block's parameters are the built block's, all experts included."""
    config = _config("qwen2_moe")
    shape = _shape(config, "qwen2_moe")
    assert (shape.experts, shape.experts_per_token, shape.active_mlp_width) == (4, 2, 2 * 24 + 24)
    block = transformers.AutoModelForCausalLM.from_config(config).model.layers[0]
    assert [(n, s) for n, s in shape.block_params] == [(n, tuple(p.shape)) for n, p in block.named_parameters()]
    C, T, B = 32, 16, 2
    attention = 2 * C * C + 2 * (2 * 8) * C  # q, o; k, v of 2 key/value heads of width 8
    experts, shared = 4 * 3 * 24 * C, 3 * 24 * C + C  # gate, up, down per expert; shared expert and its gate
    assert block_forward_flops(shape, B, T) == 2 * B * T * (attention + 4 * C + experts * 2 // 4 + shared) \
        + 4 * B * T * T * 4 * 8
    # activations: norms 4C, q and attention output 2·a·d, k and v 2·g·d, the gated MLP at its active
    # width 4·(2·24 + 24), the tokens gathered for and returned from their 2 experts 2·2·C, router 2·4
    per_token = 4 * C + 2 * 32 + 2 * 16 + 4 * 72 + 2 * 2 * C + 2 * 4
    assert block_activation_bytes(shape, Workload(batch=B, seq=T, precision="bf16"), T) == B * T * per_token * 2
    assert param_split(shape, FinetuneOptions(lora_rank=4)).block_adapters == 4 * (32 + 32) + 4 * (32 + 16)  # q, v
    assert param_split(shape, FinetuneOptions(lora_rank=4, lora_targets=("q_proj",))).block_adapters == 4 * 64
    dense = _shape(_config("llama"), "llama")
    assert not dense.experts and dense.active_mlp_width == dense.mlp_width == 48
    config.num_experts_per_tok = 0
    with pytest.raises(ValueError, match="a mixture-of-experts block, but none of num_experts_per_tok"):
        _shape(config, "qwen2_moe")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_block_flops_are_torch_s_count_of_the_built_block(family):
    """The planner's forward FLOPs of one block, from its parameter shapes (top-k of the experts),
    equal ``torch.utils.flop_counter`` on the built block's forward at the inputs the model hands it
    (eager attention and experts, which the counter sees op by op; it does not discount the causal
    mask either)."""
    from torch.utils.flop_counter import FlopCounterMode

    config = _config(family)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    block = model.get_submodule(_shape(config, family).blocks_name)[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda _, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                           with_kwargs=True)
    B, T = 2, 16
    with torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (B, T)))
        hook.remove()
        with FlopCounterMode(display=False) as counter:
            block(*seen["args"], **seen["kwargs"])
    assert block_forward_flops(_shape(config, family), B, T) == counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_bytes_are_a_built_engines(tmp_path, family, precision):
    """Dense (llama) and MoE (mixtral): the planner's block layout, window slot, head/tail, resident
    block and host store are what ``wrap`` allocates for the model. Llama is loaded from its
    directory (``read_hf_shape``, ``from_pretrained``); mixtral is built from its config and
    wrapped, its shape read from the same config."""
    if family == "llama":
        from hf_models import save_tiny

        from pystronghold.planner.hf_shape import read_hf_shape
        from pystronghold.runtime.api import from_pretrained

        directory = save_tiny(tmp_path, family, tokenizer=False)
        shape = read_hf_shape(str(directory))

        def build(**options):
            return from_pretrained(directory, **options)
    else:
        config = _config(family)
        shape = _shape(config, family)

        def build(**options):
            model = transformers.AutoModelForCausalLM.from_config(config)
            return ph.wrap(model, blocks=model.get_submodule(shape.blocks_name), **options)
    work = Workload(batch=1, seq=16, precision=precision, host_reserve_bytes=0)
    costs = block_costs(shape, work, HW)
    plan = make_plan(shape, work, HW, window=2, resident_blocks=1)
    engine = build(window=2, resident_blocks=1, precision=precision)
    try:
        stats = engine.stats()
        assert (stats["trainable_params"], stats["frozen_params"]) == (plan.params, 0)
        assert list(engine.memory_report().streamed_block_elements) == [costs.block_numel] * 2  # the 2 streamed blocks
        assert engine.planned_arena_bytes == 2 * costs.slot_bytes
        assert head_tail_bytes(engine.head_tail_params, engine.dtype) == costs.head_tail_bytes
        assert stats["resident_bytes"] == costs.resident_block_bytes
        arenas = engine.memory_report().host_arenas
        assert plan.host.host_bytes == engine.placement.host_bytes
        assert stats["store_bytes"] == plan.host.host_bytes + arenas * layout.ARENA_ALIGN
    finally:
        engine.close()


def test_mixtral_8x7b_has_its_published_total_and_active_parameters():
    """Mixtral 8x7B (transformers' default ``MixtralConfig``): 46.7 B parameters, 12.9 B active per
    token (Mistral AI's figures), from one block built on meta."""
    from pystronghold.planner.params import active_matmul_numel, model_params

    shape = _shape(transformers.MixtralConfig(), "mixtral")
    active = shape.layers * active_matmul_numel(shape, list(shape.block_params)) + 2 * shape.vocab_size * shape.hidden
    assert round(model_params(shape) / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
