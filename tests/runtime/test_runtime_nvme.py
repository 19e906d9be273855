"""The file (NVMe) tier: block states on disk give exactly the training of states in host memory."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import pystronghold as ph
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint_dir import latest_checkpoint
from pystronghold.runtime.memory.disk_tier import DiskTierError
from pystronghold.runtime.memory.placement import plan_placement
from runtime_models import (HetStack, assert_same_training, gpt_batches, het_batches, one_torch_thread,
                            run_both, tiny_gpt, train_engine)
from tmpfs import small_tmpfs
from train_helpers import kill_when_marked, run_training, tiny_config

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 20


def ram_and_disk(make_model, batches, tmp_path, disk_options, **options):
    """The same training twice from one initial model: states in host memory, then on disk."""
    model = make_model()
    disk_model = copy.deepcopy(model)
    torch.manual_seed(1234)
    ram = train_engine(model, batches, **options)
    torch.manual_seed(1234)
    disk = train_engine(disk_model, batches, nvme_dir=str(tmp_path / "nvme"), **disk_options, **options)
    return ram, disk


def assert_identical(ram, disk):
    (ram_losses, ram_params, _), (disk_losses, disk_params, _) = ram, disk
    assert disk_losses == ram_losses
    assert disk_params.keys() == ram_params.keys()
    for name, p in ram_params.items():
        assert torch.equal(disk_params[name], p), name


def test_every_state_on_disk_trains_exactly_as_in_ram_and_as_pytorch(tmp_path):
    """fp32, 20 steps, W=2, backward overlap: master, moments and (streamed) gradients on disk."""
    ram, disk = ram_and_disk(tiny_gpt, gpt_batches(STEPS), tmp_path, dict(nvme_states="all"),
                             window=2, strict=True)
    assert_identical(ram, disk)
    engine = disk[2]
    assert set(engine.placement.disk_states) == {"master", "exp_avg", "exp_avg_sq", "grad"}
    assert engine.placement.streamed_grads
    st = engine.stats()["disk"]
    # every step reads and writes each block's master and moments (some reads are cache hits)
    record = max(engine.memory_report().streamed_block_elements[0], 1) * 4
    assert st["write_bytes"] >= STEPS * 8 * 3 * record
    assert st["read_bytes"] > 0 and st["hits"] > 0
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir()), \
        "the scratch directory must be gone after close()"
    # and the disk run is the plain PyTorch run too
    model = tiny_gpt()
    ref, _ = run_both(lambda: copy.deepcopy(model), gpt_batches(STEPS), window=1)
    assert_same_training(ref, disk)


def test_a_host_budget_too_small_for_the_store_puts_every_state_on_disk(tmp_path):
    model = tiny_gpt()
    numels = [sum((n + 15) // 16 * 16 for n in (p.numel() for p in b.parameters())) + 16 for b in model.blocks]
    full = plan_placement(numels, torch.float32, budget_bytes=2**40)
    # a budget that holds the device arena and the cache but nothing else of the store
    arena = 2 * 2 * ((max(numels) * 4 + 4095) // 4096 * 4096)
    cache = 4 * 4 * ((max(numels) * 4 + 4095) // 4096 * 4096)
    budget = arena + cache + _head_tail(model) + 4096 * 8
    assert budget < full.host_bytes + arena
    ram, disk = ram_and_disk(tiny_gpt, gpt_batches(STEPS), tmp_path, dict(host_memory_bytes=budget),
                             window=2)
    assert_identical(ram, disk)
    placement = disk[2].placement
    assert all(len(placement.disk_blocks[s]) == 8 for s in ("master", "exp_avg", "exp_avg_sq", "grad"))
    assert placement.host_bytes + placement.fixed_bytes <= budget


@pytest.mark.parametrize("case", ["clip+accumulation", "forward", "cache1", "partial"])
def test_disk_states_in_every_mode(tmp_path, case):
    """Heterogeneous blocks (records of different sizes); gradients written to and read from disk
    (forward overlap, accumulation), one cache slot, and a store split between host and disk."""
    options = dict(window=2)
    disk_options = dict(nvme_states="all")
    if case == "clip+accumulation":
        options.update(clip_grad_norm=0.5, accumulation=2)
    elif case == "forward":
        options.update(overlap="forward")
    elif case == "cache1":
        disk_options.update(nvme_cache_blocks=1)
        options.update(strict=True)
    else:
        disk_options = dict(host_memory_bytes=_almost_all_budget(HetStack(), window=2), nvme_cache_blocks=1)
    ram, disk = ram_and_disk(HetStack, het_batches(12), tmp_path, disk_options, **options)
    assert_identical(ram, disk)
    placement = disk[2].placement
    if case == "partial":
        assert placement.spilled and any(len(b) < 6 for b in placement.disk_blocks.values())
    if case in ("clip+accumulation", "forward"):
        assert not placement.streamed_grads and disk[2].stats()["disk"]["write_bytes"] > 0


def _almost_all_budget(model, window):
    """A host budget one byte short of the whole store (and the device arena)."""
    numels = [sum((p.numel() + 15) // 16 * 16 for p in b.parameters()) + 16 for b in model.blocks]
    full = plan_placement(numels, torch.float32, budget_bytes=2**40)
    arena = window * 2 * ((max(numels) * 4 + 4095) // 4096 * 4096)
    return arena + _head_tail(model) + full.host_bytes - 1


def _head_tail(model):
    """Host bytes of head and tail on the CPU backend (counted against the budget)."""
    from pystronghold.runtime.memory.layout import head_tail_bytes

    return head_tail_bytes([p for n, p in model.named_parameters() if not n.startswith("blocks.")],
                           torch.float32)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_with_the_shadow_on_disk(tmp_path, precision):
    options = dict(window=2, precision=precision)
    ram, disk = ram_and_disk(tiny_gpt, gpt_batches(8), tmp_path, dict(nvme_states="all"), **options)
    assert_identical(ram, disk)
    assert "shadow" in disk[2].placement.disk_states


def test_blocks_built_on_meta_are_materialized_one_at_a_time(tmp_path):
    """GPT(materialize_blocks=False) + wrap: each block gets its eager initial values when the store
    is filled, and the training is the eager model's."""
    from pystronghold.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=97, seq_len=32, layers=4, hidden=64, heads=4)
    batches = gpt_batches(4)
    eager = train_engine(GPT(cfg, seed=3), batches, window=2)
    lazy_model = GPT(cfg, seed=3, materialize_blocks=False)
    assert all(p.is_meta for p in lazy_model.blocks.parameters())
    lazy = train_engine(lazy_model, batches, window=2, nvme_dir=str(tmp_path), nvme_states="all")
    assert_identical(eager, lazy)


def test_without_a_disk_directory_a_too_small_budget_is_refused_with_the_hint(tmp_path):
    model = tiny_gpt()
    with pytest.raises(MemoryError, match=r"host store needs [\d,]+ bytes .*--nvme DIR"):
        ph.wrap(model, blocks=model.blocks, host_memory_bytes=100_000)


def test_even_all_on_disk_too_big_names_the_cache(tmp_path):
    model = tiny_gpt()
    with pytest.raises(MemoryError, match=r"even with every state on disk .* cache of 4 blocks"):
        ph.wrap(model, blocks=model.blocks, host_memory_bytes=100_000, nvme_dir=str(tmp_path))
    assert not any(tmp_path.iterdir()), "nothing may be created when the plan is refused"


def test_not_enough_free_disk_space_is_refused_before_training(tmp_path, monkeypatch):
    from pystronghold.io import scratch

    monkeypatch.setattr(scratch, "free_bytes", lambda path: 4096)
    model = tiny_gpt()
    with pytest.raises(OSError, match=r"(?s)needs? .*[\d,]+ bytes.*4,096"):
        ph.wrap(model, blocks=model.blocks, nvme_dir=str(tmp_path / "nvme"), nvme_states="all")


def test_disk_full_during_training_names_the_directory_and_the_last_checkpoint_loads(tmp_path):
    """Sparse tier files on a small tmpfs: the first gradient write of the resumed run (clipping:
    gradients go to disk) finds the disk full. The run stops with DiskTierError naming the
    directory; the checkpoint it resumed from is untouched and a later resume (in host memory)
    reproduces the uninterrupted run."""
    from pystronghold.io import FileStore
    from pystronghold.runtime.config import RuntimeConfig

    ck = tmp_path / "ck"
    straight = run_training(tiny_config(tmp_path, steps=4, clip=1.0))
    first = run_training(tiny_config(tmp_path, steps=4, clip=1.0, ckpt=str(ck), every=2), keep=True)
    shutil.rmtree(ck / "step-00000004")  # as if the run had been killed after step 2
    saved = latest_checkpoint(ck)
    # room for the header of every state file and master/exp_avg/exp_avg_sq of every block, not the gradients
    numel = max(first.engine.memory_report().streamed_block_elements)
    record = FileStore.file_bytes_for(4, numel * 4)
    with small_tmpfs(3 * record + 4 * 4096 + 8192) as mount:
        if mount is None:
            pytest.skip("cannot mount a tmpfs here")
        config = tiny_config(tmp_path, steps=4, clip=1.0, ckpt=str(ck), every=2, resume=True)
        config.runtime = RuntimeConfig(clip_grad_norm=1.0, nvme_dir=str(mount / "nvme"), nvme_states="all",
                                       nvme_preallocate=False)
        trainer = Trainer(resolve(config))
        with pytest.raises(DiskTierError, match=str(mount / "nvme")) as info:
            try:
                trainer.train()
            finally:
                with pytest.raises(OSError):
                    trainer.close()
        assert "No space left" in str(info.value) or "ENOSPC" in str(info.value) or "28" in str(info.value)
    assert latest_checkpoint(ck) == saved
    resumed = run_training(tiny_config(tmp_path, steps=4, clip=1.0, ckpt=str(ck), resume=True))
    assert resumed.start_step == 2
    assert resumed.losses == straight.losses[2:]


def test_placement_order_split_and_streamed_gradients():
    numels = [1024] * 6  # 4 KiB per fp32 block buffer
    kib = 4096
    everything = plan_placement(numels, torch.float32, budget_bytes=2**30)
    assert not everything.spilled and everything.host_bytes == 4 * 6 * kib
    # one state's worth short, cache of 1: the moments' last blocks go first, split
    p = plan_placement(numels, torch.float32, budget_bytes=4 * 6 * kib - 3 * kib, nvme=True, cache_blocks=1)
    assert p.disk_blocks == {"exp_avg_sq": (2, 3, 4, 5)}
    assert p.on_disk("exp_avg_sq", 5) and not p.on_disk("exp_avg_sq", 1) and not p.on_disk("master", 5)
    assert p.host_bytes <= 4 * 6 * kib - 3 * kib
    # streamed gradients go first and cost no disk bytes
    s = plan_placement(numels, torch.float32, budget_bytes=3 * 6 * kib + kib, nvme=True, cache_blocks=1,
                       streamed_grads=True)
    assert set(s.disk_blocks) == {"grad"} and s.streamed_grads and s.disk_bytes == 0
    assert s.step_io_bytes(numels) == 0
    # bf16: the shadow exists and is spilled last; fp32 master as upload state counts its loads
    half = plan_placement(numels, torch.bfloat16, budget_bytes=2**30, nvme=True, force_disk=True)
    assert half.disk_states == ("master", "exp_avg", "exp_avg_sq", "grad", "shadow")
    full = plan_placement(numels, torch.float32, budget_bytes=2**30, nvme=True, force_disk=True)
    assert full.step_io_bytes(numels) == 6 * kib * (4 + 2 + 2 + 2)  # master 2 loads + update, moments, grad
    with pytest.raises(ValueError, match="cache_blocks"):
        plan_placement(numels, torch.float32, budget_bytes=1, nvme=True, cache_blocks=0)


def test_runtime_options_are_validated():
    model = tiny_gpt(layers=2)
    with pytest.raises(ValueError, match="nvme_states='all' needs nvme_dir"):
        ph.wrap(model, blocks=model.blocks, nvme_states="all")
    with pytest.raises(ValueError, match="nvme_cache_blocks"):
        ph.wrap(model, blocks=model.blocks, nvme_dir="/tmp", nvme_cache_blocks=0)
    with pytest.raises(ValueError, match="host_memory_bytes"):
        ph.wrap(model, blocks=model.blocks, host_memory_bytes=-5)


def test_checkpoint_from_the_disk_tier_resumes_in_host_memory(tmp_path):
    """A run with every state on disk writes checkpoints (read through the tier) that a run in host
    memory resumes to the uninterrupted losses."""
    from pystronghold.runtime.config import RuntimeConfig

    straight = run_training(tiny_config(tmp_path, steps=4, clip=None))
    ck = tmp_path / "ck"
    config = tiny_config(tmp_path, steps=4, clip=None, ckpt=str(ck), every=2)
    config.runtime = RuntimeConfig(nvme_dir=str(tmp_path / "nvme"), nvme_states="all")
    on_disk = run_training(config)
    assert on_disk.losses == straight.losses
    shutil.rmtree(ck / "step-00000004")
    resumed = run_training(tiny_config(tmp_path, steps=4, clip=None, ckpt=str(ck), resume=True))
    assert resumed.losses == straight.losses[2:]


def test_a_process_killed_mid_step_leaves_the_checkpoint_and_its_scratch_is_cleaned(tmp_path):
    """SIGKILL during a step with states on disk: the last checkpoint is complete (the tier is
    scratch, never part of it); the next run resumes from it to the uninterrupted losses and
    removes the dead process's scratch directory."""
    import textwrap
    from pathlib import Path

    from pystronghold.runtime.config import RuntimeConfig

    ck, nvme, marker = tmp_path / "ck", tmp_path / "nvme", tmp_path / "in-step-3"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from pathlib import Path
        from train_helpers import save_trainer, tiny_config
        from pystronghold.train import Trainer, resolve
        from pystronghold.runtime.config import RuntimeConfig
        config = tiny_config(Path({str(tmp_path)!r}), steps=4, clip=None)
        config.runtime = RuntimeConfig(nvme_dir={str(nvme)!r}, nvme_states="all")
        t = Trainer(resolve(config))
        t.train_step(); t.train_step()
        save_trainer(t, {str(ck)!r})
        engine = t.engine
        from pystronghold.runtime.engine import engine_parts_for_tests
        updates = engine_parts_for_tests(engine)["updates"]
        original = updates.submit_update
        def stalled(block, *args, **kwargs):  # step 3's backward: the update of the last block hangs
            original(block, *args, **kwargs)
            Path({str(marker)!r}).write_text(str(block))
            time.sleep(60)
        updates.submit_update = stalled
        t.train_step()
    """)
    kill_when_marked(script, marker, "step 3")
    stale = [p for p in nvme.iterdir() if p.name.startswith("pystronghold-scratch-")]
    assert len(stale) == 1 and any(stale[0].rglob("*.psr"))  # the dead run's tier is still there
    assert latest_checkpoint(ck).name == "step-00000002"
    straight = run_training(tiny_config(tmp_path, steps=4, clip=None))
    config = tiny_config(tmp_path, steps=4, clip=None, ckpt=str(ck), resume=True)
    config.runtime = RuntimeConfig(nvme_dir=str(nvme), nvme_states="all")
    resumed = run_training(config)
    assert resumed.losses == straight.losses[2:]
    assert not stale[0].exists(), "the next run removes a dead process's scratch directory"
