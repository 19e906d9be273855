"""`train --model hf:DIR --tp 2` against one process: step time and the bytes each rank hands to the
collectives per step, on the CPU with gloo; with ``--lora-rank R`` LoRA adapters on q and v (PEFT's
default targets), with ``--moe`` a Qwen2-MoE (4 experts of width hidden, top 2, a shared expert).

A Hugging Face Llama from a small config (``common.hf_llama``: nothing downloaded) saved to a
temporary directory, trained on a token file through ``pystronghold.train.Trainer``: first in this
process, then on two spawned gloo ranks (``--tp 2``), each timing its own steps after ``--warmup``;
a TP step's time is the slower rank's. Before timing is read, the TP run's losses must equal the
one process's (rtol 1e-5). Bytes per rank per step are counted by ``parallel.Counter`` (the inputs
of ``all_reduce`` / ``all_gather``), and computed:

    TP: 4 b T C (6 L + 2) + 16 b T + 8
        per block 2 all_reduces forward (attention and MLP outputs), 2 again in the recompute, and in
        backward 2 of the input gradients (q, k and v enter the region once, gate and up once); the
        embedding's all_reduce forward; the LM head input's gradient; the vocabulary-parallel
        cross-entropy's two fp32 statistics per row; the float64 clipping norm.
    LoRA: 4 b T C (6 L + 1) + 8 b T r L + 16 b T + 8: in backward each of q's and v's A all-reduces
        its output's gradient (r wide); the frozen embedding takes no gradient, so the first
        attention's input gradient is not all-reduced.
    MoE: 4 b T C (9 L + 2) + 8 b T L + 16 b T + 8: per block the attention's 3 as above, and 3 each
        for the experts (their partial sums forward and in the recompute, the hidden states'
        gradient) and the shared expert; and the 2 routing weights' gradients of each token.

NOTE: unpaired (one process, then the two ranks), so the ratio carries the load's drift; the
record says the load at both ends.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common import LoadWatch, Timing, hf_llama, print_table, write_json  # noqa: E402


def _config(args, directory: Path, data: Path, tp: int):
    from pystronghold.runtime.config import RuntimeConfig
    from pystronghold.settings.finetune import FinetuneOptions
    from pystronghold.settings.parallel import ParallelOptions
    from pystronghold.train.config import DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig

    return TrainConfig(model=ModelOptions(model=f"hf:{directory}"), finetune=FinetuneOptions(lora_rank=args.lora_rank),
                       data=DataOptions(data=[str(data)], batch=args.batch, seq=args.seq),
                       optim=OptimOptions(lr=1e-4, warmup=1),
                       runtime=RuntimeConfig(window=2, clip_grad_norm=1.0),
                       run=RunOptions(steps=args.warmup + args.steps, eval_every=0, eval_batches=1, quiet=True),
                       parallel=ParallelOptions(tp=tp))


def _train(args, directory: Path, data: Path, tp: int, counter_groups: bool) -> dict:
    """Every step's (loss, seconds) and the bytes per step (counted from the first timed step on)."""
    from pystronghold.train import Trainer, resolve

    trainer = Trainer(resolve(_config(args, directory, data, tp)))
    counter = None
    if counter_groups:
        from parallel import Counter

        counter = Counter(trainer.groups)
    losses, times = [], []
    try:
        for step in range(args.warmup + args.steps):
            if counter is not None and step == args.warmup:
                counter.on = True
            start = time.perf_counter()
            losses.append(trainer.train_step())
            times.append(time.perf_counter() - start)
    finally:
        trainer.close()
    per_step = {k: v // args.steps for k, v in counter.bytes.items()} if counter is not None else {}
    return {"losses": losses, "times": times[args.warmup:], "bytes": per_step}


def _rank(rank: int, args, directory: str, data: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    torch.save(_train(args, Path(directory), Path(data), 2, True), f"{out}.{rank}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank on q and v")
    parser.add_argument("--moe", action="store_true", help="a Qwen2-MoE instead of a Llama")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from pystronghold.parallel.groups import free_local_port

    watch = LoadWatch()
    with tempfile.TemporaryDirectory() as tmp:
        directory, data = Path(tmp) / "llama", Path(tmp) / "tokens.bin"
        model = _qwen2_moe(args) if args.moe else hf_llama(args.layers, args.hidden, vocab=args.vocab,
                                                            positions=args.seq)
        model.save_pretrained(str(directory))
        rng = np.random.default_rng(0)
        rng.integers(0, args.vocab, size=200_000, dtype=np.uint16).tofile(data)
        one = _train(args, directory, data, 1, False)
        mp.start_processes(_rank, args=(args, str(directory), str(data), free_local_port(), f"{tmp}/tp"), nprocs=2,
                           start_method="spawn")
        ranks = [torch.load(f"{tmp}/tp.{r}") for r in range(2)]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    tp_times = [max(a, b) for a, b in zip(ranks[0]["times"], ranks[1]["times"])]
    b, T, C, L = args.batch, args.seq, args.hidden, args.layers
    if args.moe:
        computed = 4 * b * T * C * (9 * L + 2) + 8 * b * T * L + 16 * b * T + 8
    else:
        computed = 4 * b * T * C * (6 * L + 2) + 16 * b * T + 8
        if args.lora_rank:
            computed += 8 * b * T * args.lora_rank * L - 4 * b * T * C
    t1, t2 = Timing.of(one["times"]), Timing.of(tp_times)
    load = watch.stop()
    rows = [{"layout": "1 process", "step ms": f"{t1.median_s * 1e3:.0f}", "p20-p80 ms": f"{t1.p20_s * 1e3:.0f}-{t1.p80_s * 1e3:.0f}",
             "vs 1": "1.00", "TP bytes computed": 0, "TP bytes measured": 0},
            {"layout": "--tp 2", "step ms": f"{t2.median_s * 1e3:.0f}", "p20-p80 ms": f"{t2.p20_s * 1e3:.0f}-{t2.p80_s * 1e3:.0f}",
             "vs 1": f"{t2.median_s / t1.median_s:.2f}", "TP bytes computed": computed,
             "TP bytes measured": ranks[0]["bytes"]["tp"]}]
    what = ("Qwen2-MoE" if args.moe else "Llama") + (f" + LoRA r={args.lora_rank}" if args.lora_rank else "")
    print_table(rows, list(rows[0]), f"hf {what} {L} blocks, hidden {C}, seq {T}, batch {b}, fp32, W=2, gloo; "
                                     f"load {load.label()}")
    write_json(args.json, "hf_tp", rows, {**load.fields(), "args": vars(args), "bytes_by_group": ranks[0]["bytes"]})
    return 0


def _qwen2_moe(args):
    """A Qwen2-MoE from a small config: 4 experts and a shared expert, each of width hidden, top 2."""
    import transformers

    heads = max(1, args.hidden // 64)
    cfg = transformers.Qwen2MoeConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      num_attention_heads=heads, num_key_value_heads=heads,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=args.hidden,
                                      shared_expert_intermediate_size=args.hidden, intermediate_size=4 * args.hidden,
                                      vocab_size=args.vocab, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg)


if __name__ == "__main__":
    sys.exit(main())
