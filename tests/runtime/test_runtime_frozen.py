"""Frozen parameters (``requires_grad=False``) train through the window as in plain PyTorch with the
same parameters frozen (torch.optim.AdamW and clip_grad_norm_ over the trainable ones): blocks that
mix frozen and trainable parameters, wholly frozen blocks, a frozen head, resident blocks, clipping,
accumulation, bf16/fp16 and the NVMe tier. A frozen parameter stays bit-identical, costs its
compute-dtype bytes in the host store, and has no optimizer state; state dicts carry its value.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.memory import layout
from pystronghold.runtime.memory.placement import plan_placement
from pystronghold.runtime.memory.store import BlockLayout
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import (HYPER, assert_same_mixed_training, assert_same_training, engine_steps, gpt_batches,
                            one_torch_thread, run_both, tiny_gpt, train_engine, train_mixed_reference,
                            train_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 8
LAYERS = 6


def frozen(name: str, pattern: str) -> bool:
    """Whether the tiny GPT's parameter ``name`` is frozen in ``pattern``:

    - ``mixed``: in every block the first LayerNorm, the qkv matrix and fc2's bias (every block mixes);
    - ``partial``: the head and the first half of the blocks (partial fine-tuning of the top half);
    - ``middle``: the token embedding, blocks 1 and 4 wholly, block 3's MLP;
    - ``blocks``: every block (only head and tail train).
    """
    block = int(name.split(".")[1]) if name.startswith("blocks.") else None
    if pattern == "mixed":
        return block is not None and any(k in name for k in ("ln1.", "attn.qkv.weight", "fc2.bias"))
    if pattern == "partial":
        return name.startswith("head.") or (block is not None and block < LAYERS // 2)
    if pattern == "middle":
        return name == "head.tok.weight" or block in (1, 4) or (block == 3 and ".mlp." in name)
    if pattern == "blocks":
        return block is not None
    raise ValueError(pattern)


def frozen_gpt(pattern: str, seed: int = 0):
    """A tiny GPT whose parameters ``frozen(name, pattern)`` have requires_grad=False."""
    torch.manual_seed(seed)
    model = tiny_gpt(LAYERS)
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen(name, pattern))
    return model


def assert_frozen_unchanged(initial: dict, params: dict, pattern: str, dtype=torch.float32) -> None:
    """Every frozen parameter in ``params`` (fp32 values) is its initial value, rounded to ``dtype``."""
    names = [n for n in initial if frozen(n, pattern)]
    assert names
    for name in names:
        assert torch.equal(params[name], initial[name].to(dtype).float()), name


@pytest.mark.parametrize("window", [1, 2, "all"])
@pytest.mark.parametrize("pattern", ["mixed", "partial", "middle", "blocks"])
def test_frozen_parameters_train_to_plain_pytorch(pattern, window):
    initial = {n: p.detach().clone() for n, p in frozen_gpt(pattern).named_parameters()}
    ref, got = run_both(lambda: frozen_gpt(pattern), gpt_batches(STEPS), window=window, strict=True)
    assert_same_training(ref, got)
    assert_frozen_unchanged(initial, got[1], pattern)


@pytest.mark.parametrize("pattern", ["mixed", "partial", "blocks"])
def test_resident_blocks_with_frozen_parameters(pattern):
    """K=2 resident blocks: wholly frozen ones (``partial``, ``blocks``: their device AdamW is empty)
    or mixed ones; with every block resident (``blocks``) only head and tail count the backward."""
    resident = LAYERS if pattern == "blocks" else 2
    initial = {n: p.detach().clone() for n, p in frozen_gpt(pattern).named_parameters()}
    ref, got = run_both(lambda: frozen_gpt(pattern), gpt_batches(STEPS), window=2, resident_blocks=resident)
    assert_same_training(ref, got)
    assert_frozen_unchanged(initial, got[1], pattern)


@pytest.mark.parametrize("on_device", [False, True])
def test_clipping_over_the_trainable_parameters_with_accumulation(on_device):
    """clip_grad_norm_ over the trainable parameters only, 2 micro-batches a step; the streamed
    blocks' norms from the host copy or (``on_device``, CUDA's path) from the slot."""

    def norms_on_device(engine):
        engine.grad_norms.on_device = on_device

    ref, got = run_both(lambda: frozen_gpt("middle"), gpt_batches(2 * STEPS), clip=0.05, accumulation=2,
                        window=2, engine_hook=norms_on_device)
    assert_same_training(ref, got)
    assert got[2].grad_norm is not None and got[2].grad_norm > 0.05  # clipping did act


@pytest.mark.parametrize("precision,pattern,clip", [("bf16", "mixed", None), ("bf16", "partial", 1.0),
                                                    ("fp16", "middle", None)])
def test_half_precision_with_frozen_parameters(precision, pattern, clip):
    """Against PyTorch's mixed-precision recipe with fp32 masters of the trainable parameters only;
    a frozen parameter is its initial value rounded to the compute dtype, bit for bit."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model, batches = frozen_gpt(pattern), gpt_batches(STEPS)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = train_mixed_reference(copy.deepcopy(model), batches, dtype, clip=clip)
    got = train_engine(model, batches, window=2, precision=precision, clip_grad_norm=clip, strict=True)
    assert_same_mixed_training(ref, got)
    assert_frozen_unchanged(initial, got[1], pattern, dtype)


@pytest.mark.parametrize("precision,pattern,accumulation", [("fp32", "mixed", 1), ("fp32", "partial", 2),
                                                            ("bf16", "mixed", 2)])
def test_frozen_parameters_on_the_nvme_tier(tmp_path, precision, pattern, accumulation):
    """Every state on disk behind a cache of 2 blocks (evictions every pass): the upload state holds
    the frozen parameters there, a frozen block has no moment or gradient record, and an update
    keeps the frozen part of a block's shadow."""
    model, batches = frozen_gpt(pattern), gpt_batches(2 * STEPS)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = dict(window=2, precision=precision, accumulation=accumulation)
    torch.manual_seed(1234)
    ram = train_engine(copy.deepcopy(model), batches, **options)
    torch.manual_seed(1234)
    disk = train_engine(model, batches, nvme_dir=str(tmp_path / "nvme"), nvme_states="all", nvme_cache_blocks=2,
                        **options)
    assert disk[0] == ram[0]
    for name, p in ram[1].items():
        assert torch.equal(disk[1][name], p), name
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    assert_frozen_unchanged(initial, disk[1], pattern, dtype)
    placement = disk[2].placement
    frozen_blocks = [b for b in range(LAYERS) if not any(disk[2].states.block_trainable(b))]
    assert set(frozen_blocks).isdisjoint(placement.disk_blocks.get("exp_avg", ()))
    assert len(placement.disk_blocks[layout.upload_state(dtype)]) == LAYERS
    if precision == "fp32":
        torch.manual_seed(1234)
        ref = train_reference(frozen_gpt(pattern), batches, accumulation=accumulation)
        assert_same_training(ref, disk)


def test_hugging_face_llama_with_frozen_layers_trains_to_plain_pytorch():
    """A Llama from a small config, its embedding and first two layers frozen, the third's q_proj
    too: trained through wrap (blocks found by discovery) as in plain PyTorch."""
    hf_small = pytest.importorskip("hf_small")
    model = hf_small.hf_llama()
    frozen_prefixes = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.", "model.layers.2.self_attn.q_proj")
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen_prefixes))

    def lm_loss(m, x):
        return m(input_ids=x, labels=x).loss

    batches = hf_small.token_batches(STEPS)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref = train_reference(copy.deepcopy(model), batches, clip=1.0, loss_of=lm_loss)
    got = train_engine(model, batches, loss_of=lm_loss, blocks=None, clip_grad_norm=1.0, window=2, strict=True)
    assert_same_training(ref, got)
    for name, value in initial.items():
        assert torch.equal(got[1][name], value), name


@pytest.mark.parametrize("schedule", ["default", "relay"])
def test_only_trainable_gradients_leave_the_device(schedule):
    """From the trace: each step copies out the trainable part of every block that has one, once
    (the relay: once for both micro-batches), and nothing of the wholly frozen blocks 1 and 4;
    loads move whole blocks, frozen parameters included. The relay trains as the default does."""
    from relay_training import train

    model, batches, m = frozen_gpt("middle"), gpt_batches(6), 2
    default = train(copy.deepcopy(model), batches, m, schedule="default", window=2)
    got = default if schedule == "default" else train(model, batches, m, schedule=schedule, window=2, strict=True)
    torch.testing.assert_close(got[0], default[0], rtol=1e-6, atol=0)
    engine, steps = got[4], 3
    layouts = engine_parts_for_tests(engine)["store"].layouts  # padded sizes of the copies
    assert [lay.train_numel == 0 for lay in layouts] == [False, True, False, False, True, False]
    copied = {}
    for e in got[3]:
        copied[e.block] = copied.get(e.block, 0) + e.nbytes
    per_step = 1 if schedule == "relay" else m  # the default schedule copies out every micro-batch
    assert copied == {b: steps * per_step * lay.train_numel * 4 for b, lay in enumerate(layouts) if lay.train_numel}
    assert {e.nbytes for e in got[2] if e.block == 1} == {layouts[1].numel * 4}


# ---- memory: a frozen parameter costs its compute-dtype bytes


class WideBlocks(torch.nn.Module):
    """4 MLP blocks of 0.2M parameters each (padding and page rounding small beside them)."""

    def __init__(self, d: int = 128, h: int = 768) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d)) for _ in range(4))

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.mse_loss(x, y)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_frozen_parameter_costs_its_compute_dtype_bytes_in_the_host_store(precision):
    """Half the block parameters frozen (blocks 0-1 wholly, and block 2's first Linear): the store
    holds 16 bytes per trainable parameter and 2 (bf16) or 4 (fp32) per frozen one, padding aside;
    ``engine.stats()`` counts both kinds."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    sizes = {}
    for half_frozen in (False, True):
        model = WideBlocks()
        if half_frozen:
            for name, p in model.named_parameters():
                p.requires_grad_(not name.startswith(("blocks.0.", "blocks.1.", "blocks.2.0.")))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen_count = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        engine = ph.wrap(model, window=1, precision=precision)
        stats = engine.stats()
        engine.close()
        assert (stats["trainable_params"], stats["frozen_params"]) == (trainable, frozen_count)
        want = trainable * layout.host_bytes_per_param(dtype) + frozen_count * layout.frozen_bytes_per_param(dtype)
        # padding: <= 16 elements per parameter, a page per buffer (4 blocks x 5 states) and per arena
        slack = 4 * 4 * 16 * 4 + (4 * 5 + 5) * layout.ARENA_ALIGN
        assert want <= stats["store_bytes"] <= want + slack, (half_frozen, stats["store_bytes"], want)
        assert want - trainable * layout.host_bytes_per_param(dtype) <= stats["store_frozen_bytes"] \
            <= frozen_count * dtype.itemsize + 4 * 16 * dtype.itemsize
        sizes[half_frozen] = stats["store_bytes"]
    limit = 0.6 if precision == "bf16" else 0.65  # 16 B -> 2 (4) B for 5/8 of the parameters
    assert sizes[True] < limit * sizes[False]


# ---- state dicts, param groups, resume


def test_state_dicts_and_param_groups_hold_the_frozen_parameters():
    """model.state_dict() and master_parameters() give every frozen parameter's value (the model's
    dtype before wrap); the optimizer's param groups and state leave frozen parameters out, as a
    torch AdamW over the trainable parameters has them."""
    model = frozen_gpt("middle")
    ref_model = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = ph.wrap(model, blocks=model.blocks, window=2, resident_blocks=1, precision="bf16",
                     optimizer=ph.AdamW(**HYPER))
    engine_steps(engine, gpt_batches(2))
    sd = model.state_dict()
    masters = engine.master_parameters()
    assert sd.keys() == ref_model.state_dict().keys() and masters.keys() == initial.keys()
    for name, value in initial.items():
        assert sd[name].dtype == torch.float32, name  # the dtype before wrap
        if frozen(name, "middle"):
            assert torch.equal(sd[name], value.bfloat16().float()), name
            assert torch.equal(masters[name], value.bfloat16().float()), name
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == len(trainable) and {id(p) for p in params} == {id(p) for p in trainable}
    # no device AdamW (nor fp32 master) for the frozen head and resident parameters either
    assert all(p.requires_grad for p in [*engine.device_optimizer.params, *engine.resident.params])
    assert model.head.tok.weight.dtype == torch.bfloat16  # stored once, in the compute dtype
    torch_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], **HYPER)
    assert len(engine.optimizer.state_dict()["state"]) == len(trainable)
    torch_opt.load_state_dict(engine.optimizer.state_dict())  # torch's layout for the trainable ones
    engine.close()


@pytest.mark.parametrize("precision,nvme", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_resume_from_state_dicts_continues_bit_for_bit(tmp_path, precision, nvme):
    """3 steps, the three state dicts taken, 3 more; a new engine over a differently initialised
    model (frozen values included) loads them and its 3 steps are the same, bit for bit (``nvme``:
    every state on disk, where the fp32 master holds the frozen parameters beside the others)."""
    batches = gpt_batches(6)
    options = dict(window=2, resident_blocks=1, precision=precision, optimizer=ph.AdamW(**HYPER), clip_grad_norm=1.0)
    if nvme:
        options.update(nvme_dir=str(tmp_path), nvme_states="all", nvme_cache_blocks=2)
    model = frozen_gpt("middle")
    engine = ph.wrap(model, blocks=model.blocks, **options)
    engine_steps(engine, batches[:3])
    saved = copy.deepcopy((model.state_dict(), engine.optimizer.state_dict(), engine.state_dict()))
    straight = engine_steps(engine, batches[3:])
    straight_values = {n: v.clone() for n, v in engine.master_parameters().items()}
    engine.close()

    other = frozen_gpt("middle", seed=7)
    resumed_engine = ph.wrap(other, blocks=other.blocks, **options)
    other.load_state_dict(saved[0])
    resumed_engine.optimizer.load_state_dict(saved[1])
    resumed_engine.load_state_dict(saved[2])
    assert engine_steps(resumed_engine, batches[3:]) == straight
    for name, value in resumed_engine.master_parameters().items():
        assert torch.equal(value, straight_values[name]), name
    resumed_engine.close()


# ---- which parameters train is fixed at wrap


@pytest.mark.parametrize("name,now", [("blocks.5.mlp.fc1.weight", False), ("blocks.1.ln2.bias", True),
                                      ("head.tok.weight", True), ("blocks.0.attn.proj.weight", False)])
def test_requires_grad_changed_after_wrap_is_refused(name, now):
    """A streamed, head or resident (block 0) parameter flipped after wrap: the next training forward
    and the next step refuse, naming it, before anything is computed or updated."""
    model = frozen_gpt("middle")
    engine = ph.wrap(model, blocks=model.blocks, window=2, resident_blocks=1)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()
    dict(model.named_parameters())[name].requires_grad_(now)
    with pytest.raises(ValueError, match=rf"'{name}' has requires_grad={now}, but it was {not now} when the model "
                                         "was wrapped"):
        engine(x, y)
    with pytest.raises(ValueError, match=rf"'{name}' has requires_grad={now}"):
        engine.step()
    with torch.no_grad():  # inference is not training: allowed
        engine(x, y)
    engine.close()


def test_a_model_with_nothing_to_train_is_refused():
    model = tiny_gpt(2).requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter has requires_grad=False, so there is nothing to train"):
        ph.wrap(model, blocks=model.blocks, window=1)


# ---- the layout


def test_block_layout_puts_the_frozen_parameters_after_the_trainable_ones():
    trainable = torch.nn.Parameter(torch.zeros(5))
    frozen_param = torch.nn.Parameter(torch.zeros(3, 7), requires_grad=False)
    lay = BlockLayout([("a", trainable), ("b", torch.nn.Parameter(torch.zeros(17))), ("c", frozen_param)])
    assert (lay.trainable, lay.frozen, lay.train_numel, lay.numel) == (2, 1, 48, 80)
    assert [s.offset for s in lay.spans] == [0, 16, 48]
    flat = torch.arange(80.0)
    assert [v.shape for v in lay.train_views(flat[:48])] == [(5,), (17,)]
    assert torch.equal(lay.frozen_views(flat)[0], flat[48:69].view(3, 7))
    all_frozen = BlockLayout([("c", frozen_param)])
    assert (all_frozen.trainable, all_frozen.train_numel, all_frozen.numel) == (0, 0, 32)
    with pytest.raises(ValueError, match="trainable parameters before the frozen ones"):
        BlockLayout([("c", frozen_param), ("a", trainable)])
    # the placement: a state of no elements in a block (a frozen block's moments) is never on disk
    p = plan_placement([32, 80], torch.bfloat16, budget_bytes=2**30, nvme=True, force_disk=True,
                       train_numels=[0, 48])
    assert p.disk_blocks["exp_avg"] == (1,) and p.disk_blocks["shadow"] == (0, 1)
    assert p.numels["master"] == (0, 48) and p.numels["shadow"] == (32, 80)
