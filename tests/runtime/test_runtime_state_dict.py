"""``model.state_dict()`` / ``engine.optimizer.state_dict()`` of a wrapped model hold every trained
value (blocks from the store), load back, and are interchangeable with plain PyTorch + AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import HYPER, engine_steps, gpt_batches, one_torch_thread, plain_steps, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)

FIRST, THEN = 3, 4


def wrapped(model, **options):
    return ph.wrap(model, window=2, optimizer=ph.AdamW(**HYPER, bitwise_torch=True), **options)


def assert_params(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if exact:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_state_dict_holds_every_trained_block_weight_in_the_model_dtype():
    model = tiny_gpt(layers=4)
    names = list(model.state_dict())
    engine = wrapped(model)
    engine_steps(engine, gpt_batches(FIRST))
    state = model.state_dict()
    assert list(state) == names
    masters = engine.master_parameters()
    for name, value in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    store_master = engine_parts_for_tests(engine)["store"].read_state(0, "master").untyped_storage().data_ptr()
    name = engine.states.block_names[0][0]  # fp32 in host memory: a view into the store, as PyTorch aliases
    assert state[name].untyped_storage().data_ptr() == store_master
    blocks = model.blocks[1].state_dict()  # a block alone: names relative to it
    assert torch.equal(blocks["mlp.fc1.weight"], masters["blocks.1.mlp.fc1.weight"])
    engine.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_state_dict_holds_the_fp32_masters_and_load_sets_them(precision):
    """As the model under plain autocast: fp32 values (the model's dtype before wrap) for streamed
    and resident blocks, head and tail alike, not their rounded compute copies."""
    model = tiny_gpt(layers=4)
    names = list(model.state_dict())
    engine = wrapped(model, precision=precision, resident_blocks=1)
    engine_steps(engine, gpt_batches(FIRST))
    state, masters = model.state_dict(), engine.master_parameters()
    assert list(state) == names
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for name, value in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
        assert not torch.equal(value.to(compute).float(), value), name  # so a rounded copy would show
    name = engine.states.block_names[1][0]  # a streamed block: a view into the store, nothing doubled
    store = engine_parts_for_tests(engine)["store"]
    assert state[name].untyped_storage().data_ptr() == store.read_state(0, "master").untyped_storage().data_ptr()
    shifted = {k: v + 0.001 for k, v in state.items()}
    model.load_state_dict(shifted)
    for name, value in engine.master_parameters().items():  # fp32 masters take the fp32 values
        assert torch.equal(value, shifted[name]), name
    engine.close()


def test_state_dict_is_in_each_parameters_dtype_before_wrap():
    model = tiny_gpt(layers=3)
    model.head.to(torch.bfloat16)  # a head built in bf16: its masters are saved in bf16
    engine = wrapped(model)
    state, masters = model.state_dict(), engine.master_parameters()
    for name, value in masters.items():
        dtype = torch.bfloat16 if name.startswith("head.") else torch.float32
        assert state[name].dtype == dtype and torch.equal(state[name], value.to(dtype)), name
    engine.close()


@pytest.mark.parametrize("case", ["window", "clip", "disk", "hf-gpt2", "bf16", "fp16-layer-drop"])
def test_save_and_restore_the_usual_way_continues_bit_for_bit(case, tmp_path):
    """torch.save of model.state_dict(), engine.optimizer.state_dict() and engine.state_dict() after
    3 steps; a fresh model and engine load them and continue: the losses and weights of an
    uninterrupted run (bf16: the fp32 masters are saved; fp16: the loss scale, which has backed off
    from 2**18 and grows every 2 clean steps, and the layer-drop draws come back too)."""
    options = {"clip": dict(clip_grad_norm=0.5), "disk": dict(nvme_dir=str(tmp_path), nvme_states="all"),
               "bf16": dict(precision="bf16", resident_blocks=1),
               "fp16-layer-drop": dict(precision="fp16", initial_loss_scale=2.0**18, loss_scale_interval=2,
                                       layer_drop=0.3, layer_drop_seed=5)}
    options = options.get(case, {})
    if case == "hf-gpt2":
        transformers = pytest.importorskip("transformers")

        def make():  # default config (dropout on, cache on); tied embeddings
            cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=97, n_positions=32)
            return transformers.GPT2LMHeadModel(cfg)

        def loss_of(engine, x, y):
            return engine(input_ids=x, labels=y).loss
    else:
        def make():
            return tiny_gpt(layers=4)

        def loss_of(engine, x, y):
            return engine(x, y)

    batches = gpt_batches(FIRST + THEN)
    torch.manual_seed(7)
    model = make()
    start = copy.deepcopy(model.state_dict())
    engine = wrapped(model, **options)
    engine_steps(engine, batches[:FIRST], loss_of)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(engine.optimizer.state_dict(), tmp_path / "optim.pt")
    torch.save(engine.state_dict(), tmp_path / "engine.pt")
    saved = engine.stats()
    if case == "fp16-layer-drop":  # else the engine's state would not matter
        assert saved["skipped_steps"] > 0 and len(set(engine.state_dict()["block_steps"])) > 1
    rng = torch.get_rng_state()  # dropout masks of the steps to come
    want = engine_steps(engine, batches[FIRST:], loss_of)
    want_params = {k: v.clone() for k, v in engine.master_parameters().items()}
    engine.close()

    fresh = make()
    with torch.no_grad():  # other values: everything must come from the files
        for p in fresh.parameters():
            p.add_(0.5)
    assert not any(torch.equal(v, start[k]) for k, v in fresh.state_dict().items() if v.is_floating_point())
    engine = wrapped(fresh, **options)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt"))
    engine.optimizer.load_state_dict(torch.load(tmp_path / "optim.pt"))
    engine.load_state_dict(torch.load(tmp_path / "engine.pt"))
    assert {k: engine.stats()[k] for k in ("steps", "skipped_steps", "loss_scale")} == \
        {k: saved[k] for k in ("steps", "skipped_steps", "loss_scale")}
    torch.set_rng_state(rng)
    got = engine_steps(engine, batches[FIRST:], loss_of)
    assert got == want
    assert_params(engine.master_parameters(), want_params, exact=True)
    engine.close()


def test_plain_pytorch_state_loads_into_the_engine_and_the_reverse():
    batches = gpt_batches(FIRST + THEN)
    model = tiny_gpt(layers=4)
    # plain PyTorch, uninterrupted: the reference for both directions
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    want = plain_steps(ref, ref_opt, batches)
    want_params = {k: v.detach().clone() for k, v in ref.named_parameters()}

    # plain for 3 steps -> the engine continues
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), **HYPER)
    first = plain_steps(plain, opt, batches[:FIRST])
    fresh = tiny_gpt(layers=4)
    engine = wrapped(fresh)
    fresh.load_state_dict(plain.state_dict())
    engine.optimizer.load_state_dict(opt.state_dict())
    assert engine.steps == FIRST
    got = first + engine_steps(engine, batches[FIRST:])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
    assert_params(engine.master_parameters(), want_params, exact=False)
    engine.close()

    # the engine for 3 steps -> plain PyTorch continues
    trained = copy.deepcopy(model)
    engine = wrapped(trained)
    first = engine_steps(engine, batches[:FIRST])
    plain = tiny_gpt(layers=4)
    plain.load_state_dict(trained.state_dict())
    opt = torch.optim.AdamW(plain.parameters(), **HYPER)
    opt.load_state_dict(engine.optimizer.state_dict())
    engine.close()
    got = first + plain_steps(plain, opt, batches[FIRST:])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
    assert_params({k: v.detach() for k, v in plain.named_parameters()}, want_params, exact=False)


def test_optimizer_state_dict_has_torch_adamws_format():
    model = tiny_gpt(layers=3)
    plain = copy.deepcopy(model)
    engine = wrapped(model)
    assert engine.optimizer.state_dict()["state"] == {}  # as torch: no state before the first step
    engine_steps(engine, gpt_batches(1))
    opt = torch.optim.AdamW(plain.parameters(), **HYPER)
    plain_steps(plain, opt, gpt_batches(1))
    got, want = engine.optimizer.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert got["state"][i].keys() == st.keys()
        assert got["state"][i]["step"].dtype == st["step"].dtype and float(got["state"][i]["step"]) == 1.0
    engine.close()


def test_a_state_dict_loads_back_into_its_own_engine():
    """Its tensors are views of the store being written: loading must not clobber them first."""
    model = tiny_gpt(layers=3)
    engine = wrapped(model)
    engine_steps(engine, gpt_batches(2))
    masters = {k: v.clone() for k, v in engine.master_parameters().items()}
    optim = copy.deepcopy(engine.optimizer.state_dict())
    model.load_state_dict(model.state_dict())
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    assert_params(engine.master_parameters(), masters, exact=True)
    after = engine.optimizer.state_dict()
    for i, st in optim["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    engine.close()


def test_keys_missing_under_strict_false_keep_their_trained_values():
    model = tiny_gpt(layers=3)
    engine = wrapped(model)
    engine_steps(engine, gpt_batches(2))
    before = {k: v.clone() for k, v in engine.master_parameters().items()}
    partial = {"blocks.1.mlp.fc1.weight": torch.zeros_like(before["blocks.1.mlp.fc1.weight"])}
    result = model.load_state_dict(partial, strict=False)
    assert "blocks.1.mlp.fc2.weight" in result.missing_keys
    after = engine.master_parameters()
    for name, value in before.items():
        want = partial.get(name, value)
        assert torch.equal(after[name], want), name
    engine.close()


def test_bad_state_dicts_are_refused_with_one_line_errors():
    model = tiny_gpt(layers=3)
    engine = wrapped(model)
    engine_steps(engine, gpt_batches(1))
    state = engine.optimizer.state_dict()
    two_groups = {"state": {}, "param_groups": [dict(state["param_groups"][0]), dict(state["param_groups"][0])]}
    with pytest.raises(ValueError, match="expected 1 param group"):
        engine.optimizer.load_state_dict(two_groups)
    wrong = copy.deepcopy(state)
    index = next(iter(wrong["state"]))
    wrong["state"][index]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg of .* has shape"):
        engine.optimizer.load_state_dict(wrong)
    uneven = copy.deepcopy(state)
    block_index = [i for i, (name, _) in enumerate(model.named_parameters()) if name.startswith("blocks.")][0]
    uneven["state"][block_index]["step"] = torch.tensor(5.0)
    with pytest.raises(ValueError, match="one step count"):
        engine.optimizer.load_state_dict(uneven)
    amsgrad = copy.deepcopy(state)
    amsgrad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        engine.optimizer.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(model.state_dict(), assign=True)
    engine.close()


def test_bad_engine_states_are_refused_before_anything_changes():
    model = tiny_gpt(layers=3)
    engine = wrapped(model, precision="fp16", resident_blocks=1)
    engine_steps(engine, gpt_batches(2))
    state, before = engine.state_dict(), engine.stats()
    with pytest.raises(ValueError, match="engine.load_state_dict: the state has no loss_scaler; pass what "
                                         "engine.state_dict"):
        engine.load_state_dict({k: v for k, v in state.items() if k != "loss_scaler"})
    with pytest.raises(ValueError, match=r"step counts per block \[5, 5, 5\] do not fit 3 blocks"):
        engine.load_state_dict({**state, "steps": 7, "block_steps": [5, 5, 5]})
    with pytest.raises(ValueError, match="loss scale state: need scale > 0"):
        engine.load_state_dict({**state, "steps": 9, "block_steps": [9, 9, 9],
                                "loss_scaler": {"scale": 0.0, "clean_steps": 0}})
    assert engine.stats() == before
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="a step is in progress"):
        engine.load_state_dict(state)
    engine.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_distributed_checkpoint_saves_and_loads_the_store_in_place(tmp_path):
    """dcp.save writes the store's views (no copy of the model); dcp.load fills a fresh engine's
    state dict, whose fp32 block entries are its store, in place."""
    import torch.distributed.checkpoint as dcp

    model = tiny_gpt(layers=3)
    engine = wrapped(model)
    engine_steps(engine, gpt_batches(2))
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    fresh = tiny_gpt(layers=3)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.5)
    fresh_engine = wrapped(fresh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    fresh.load_state_dict(state)  # head/tail (and a no-op for the blocks already in the store)
    assert_params(fresh_engine.master_parameters(), engine.master_parameters(), exact=True)
    engine.close()
    fresh_engine.close()
