import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pystronghold.models import GPT, PRESETS, GPTConfig, block_param_count, param_count


def tiny(**overrides) -> GPTConfig:
    fields = dict(vocab_size=97, seq_len=16, layers=3, hidden=32, heads=4)
    fields.update(overrides)
    return GPTConfig(**fields)


def real_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def test_structure_and_shapes():
    cfg = tiny()
    model = GPT(cfg)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.layers
    idx = torch.randint(0, cfg.vocab_size, (2, 11))
    x = model.head(idx)
    assert x.shape == (2, 11, cfg.hidden)
    for block in model.blocks:
        x = block(x)
        assert x.shape == (2, 11, cfg.hidden)
    logits = model.tail(x)
    assert logits.shape == (2, 11, cfg.vocab_size)
    torch.testing.assert_close(model(idx), logits)
    loss = model.tail(x, idx)
    assert loss.dim() == 0
    torch.testing.assert_close(model(idx, idx), loss)


def test_sequence_longer_than_context_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_embeddings": True},
    {"bias": False},
    {"mlp_ratio": 3, "vocab_pad_multiple": 64},
    {"layers": 1, "hidden": 48, "heads": 6, "tie_embeddings": True, "vocab_pad_multiple": 8},
])
def test_param_count_matches_module(overrides):
    cfg = tiny(**overrides)
    model = GPT(cfg)
    assert param_count(cfg) == real_count(model)
    assert block_param_count(cfg) == real_count(model.blocks[0])
    assert block_param_count(cfg, per_tp_rank=True) == block_param_count(cfg)  # tp_size 1


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_param_count_small_presets(name):
    cfg = PRESETS[name]
    assert param_count(cfg) == real_count(GPT(cfg))


def test_tied_weight_lives_in_head_and_tail_only():
    model = GPT(tiny(tie_embeddings=True))
    assert model.tail.lm_head.weight is model.head.tok.weight
    block_params = {id(p) for p in model.blocks.parameters()}
    assert id(model.head.tok.weight) not in block_params


def test_padded_vocabulary_is_never_predicted():
    cfg = tiny(vocab_pad_multiple=64)
    assert cfg.padded_vocab_size == 128
    model = GPT(cfg)
    assert model.head.tok.weight.shape[0] == 128
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == cfg.vocab_size


def test_loss_at_init_is_near_uniform():
    cfg = tiny(vocab_size=512)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, 16))
    loss = model(idx, torch.randint(0, cfg.vocab_size, (4, 16)))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_adamw_lowers_loss_on_a_repeated_batch():
    cfg = tiny()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, cfg.vocab_size, (4, 16))
    targets = torch.roll(idx, -1, dims=1)
    losses = []
    for _ in range(8):
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_init_is_deterministic_and_seeded():
    a, b, c = GPT(tiny(), seed=3), GPT(tiny(), seed=3), GPT(tiny(), seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
        if pa.std() > 0:  # weights, not the constant biases/norms
            assert not torch.equal(pa, pc), name


def test_block_init_does_not_depend_on_other_blocks():
    few, many = GPT(tiny(layers=2)), GPT(tiny(layers=5))
    # same names -> same draws; only the residual scale 1/sqrt(2*layers) differs
    torch.testing.assert_close(few.blocks[1].attn.qkv.weight, many.blocks[1].attn.qkv.weight, rtol=0, atol=0)
    torch.testing.assert_close(few.blocks[1].mlp.fc2.weight * math.sqrt(4),
                               many.blocks[1].mlp.fc2.weight * math.sqrt(10))


def test_init_std_is_gpt2s_with_scaled_residual_projections():
    cfg = tiny(hidden=64, layers=8)
    model = GPT(cfg)
    assert abs(model.blocks[0].mlp.fc1.weight.std().item() - cfg.init_std) < 0.002
    expected = cfg.init_std / math.sqrt(2 * cfg.layers)
    assert abs(model.blocks[0].mlp.fc2.weight.std().item() - expected) < 0.0005
    assert torch.all(model.blocks[0].ln1.weight == 1) and torch.all(model.blocks[0].attn.qkv.bias == 0)


@pytest.mark.parametrize("field, value", [
    ("vocab_size", 0), ("seq_len", -1), ("layers", 0), ("hidden", 2.5), ("heads", 0),
    ("heads", 5), ("mlp_ratio", 0), ("dropout", 1.0), ("dropout", -0.1), ("norm_eps", 0.0),
    ("init_std", -1.0), ("tp_size", 0), ("tp_size", 3), ("vocab_pad_multiple", 0), ("layers", True),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_vocab_must_split_across_tp_ranks():
    with pytest.raises(ValueError, match="vocab_pad_multiple"):
        tiny(tp_size=2)  # 97 rows do not split in two
    assert tiny(tp_size=2, vocab_pad_multiple=2).padded_vocab_size == 98


def test_config_is_keyword_only_with_slots():
    with pytest.raises(TypeError):
        GPTConfig(97, 16, 3, 32, 4)  # noqa: positional arguments are refused
    assert not hasattr(tiny(), "__dict__")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_and_count_blocks_consistently(name):
    cfg = PRESETS[name]
    again = GPTConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    assert again == cfg
    assert cfg.hidden % cfg.heads == 0
    # blocks are all but the embeddings and the final norm (+ an untied LM head)
    outside = param_count(dataclasses.replace(cfg, layers=1)) - block_param_count(cfg)
    assert param_count(cfg) == outside + cfg.layers * block_param_count(cfg)


# Brown et al. 2020, Table 2.1 (nominal sizes, in millions); the analytic count must land near them.
@pytest.mark.parametrize("name, nominal_m, layers, hidden, heads", [
    ("gpt3-125m", 125, 12, 768, 12), ("gpt3-350m", 350, 24, 1024, 16),
    ("gpt3-760m", 760, 24, 1536, 16), ("gpt3-1.3b", 1300, 24, 2048, 16),
    ("gpt3-2.7b", 2700, 32, 2560, 32), ("gpt3-6.7b", 6700, 32, 4096, 32),
    ("gpt3-13b", 13000, 40, 5120, 40), ("gpt3-175b", 175000, 96, 12288, 96),
])
def test_gpt3_shapes_and_sizes(name, nominal_m, layers, hidden, heads):
    cfg = PRESETS[name]
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len) == (layers, hidden, heads, 2048)
    assert abs(param_count(cfg) / 1e6 - nominal_m) / nominal_m < 0.04


def test_gpt2_124m_count():
    # GPT-2 small: 124,439,808 parameters with its 50257-token vocabulary; ours pads it to 50304.
    cfg = PRESETS["gpt2-124m"]
    assert param_count(cfg) == 124_439_808 + (50304 - 50257) * 768


# ---- building without materializing the blocks (meta device)

def _block_bytes(model: GPT) -> int:
    """Host/device bytes the blocks' parameters occupy (meta tensors occupy none)."""
    return sum(p.numel() * p.element_size() for p in model.blocks.parameters() if not p.is_meta)


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "bias": False}])
def test_lazy_blocks_materialize_to_the_eager_weights(overrides):
    cfg = dataclasses.replace(PRESETS["tiny"], **overrides)
    eager = GPT(cfg, seed=5)
    lazy = GPT(cfg, seed=5, materialize_blocks=False)
    assert all(p.is_meta for p in lazy.blocks.parameters())
    assert _block_bytes(lazy) == 0
    assert not any(p.is_meta for p in (*lazy.head.parameters(), *lazy.tail.parameters()))
    if cfg.tie_embeddings:
        assert lazy.tail.lm_head.weight is lazy.head.tok.weight
    # materialize out of order: the values must not depend on it
    for i in reversed(range(cfg.layers)):
        block = lazy.materialize_block_(i)
        assert block is lazy.blocks[i] and not any(p.is_meta for p in block.parameters())
    eager_state, lazy_state = eager.state_dict(), lazy.state_dict()
    assert list(lazy_state) == list(eager_state)
    for name, value in eager_state.items():
        assert lazy_state[name].device.type == "cpu", name
        torch.testing.assert_close(lazy_state[name], value, rtol=0, atol=0, msg=name)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(lazy(idx, idx), eager(idx, idx), rtol=0, atol=0)


def test_materialize_block_uses_the_seed_of_the_latest_reset():
    lazy = GPT(tiny(), seed=1, materialize_blocks=False)
    lazy.reset_parameters(9)
    lazy.materialize_block_(0)
    torch.testing.assert_close(lazy.blocks[0].attn.qkv.weight, GPT(tiny(), seed=9).blocks[0].attn.qkv.weight,
                               rtol=0, atol=0)


def test_materialize_block_twice_or_out_of_range_is_refused():
    lazy = GPT(tiny(), materialize_blocks=False)
    lazy.materialize_block_(1)
    with pytest.raises(ValueError, match="block 1 is already materialized"):
        lazy.materialize_block_(1)
    with pytest.raises(ValueError, match="already materialized"):
        GPT(tiny()).materialize_block_(0)
    with pytest.raises(ValueError, match="out of range"):
        lazy.materialize_block_(3)


def test_forward_with_meta_blocks_fails_clearly():
    lazy = GPT(tiny(), materialize_blocks=False)
    with pytest.raises(RuntimeError, match="blocks are not materialized"):
        lazy(torch.zeros(1, 4, dtype=torch.long))


class _RealTensorSizes(TorchFunctionMode):
    """Records the element count of every non-meta tensor that a torch function returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.numels.append(t.numel())
        return out


def test_large_model_blocks_stay_on_meta():
    """No block parameter is ever allocated or drawn: every real tensor made while building the
    model is one of the head/tail's (a block moved to meta after its init would show here)."""
    cfg = GPTConfig(vocab_size=256, seq_len=64, layers=24, hidden=2048, heads=16)
    with _RealTensorSizes() as seen:
        lazy = GPT(cfg, materialize_blocks=False)
    assert all(p.device.type == "meta" for p in lazy.blocks.parameters())
    assert _block_bytes(lazy) == 0
    assert sum(p.numel() for p in lazy.blocks.parameters()) == cfg.layers * block_param_count(cfg)
    head_tail = [p.numel() for n, p in lazy.named_parameters() if not n.startswith("blocks.")]
    assert seen.numels, "the head and tail are real tensors: the mode must have seen them"
    assert max(seen.numels) <= max(head_tail) < cfg.hidden * cfg.hidden  # a block weight is >= C*C
