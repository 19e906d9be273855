"""Long context on the CPU: peak resident memory of ``pystronghold train`` on a Llama-shaped model
(4 blocks, hidden 128, a 32,000-token vocabulary, a token file, ``--window 1``, batch 1) at two
sequence lengths, with the loss over chunks (``--loss-chunk auto``) and with the full logits
(``--loss-chunk 0``), each in a fresh process (peak RSS from ``wait4``); and the step time of the
chunked loss against the full logits at the shorter length, the two runs taking turns.

    .venv/bin/python bench/long_context.py --json bench/results/long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, paired_ratio, write_json  # noqa: E402

VOCAB, HIDDEN, LAYERS = 32_000, 128, 4


def make_model(root: Path) -> Path:
    """A random Llama of the shape above saved with transformers (nothing downloaded)."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=1 << 16, use_cache=False)
    torch.manual_seed(0)
    directory = root / "llama"
    tf.LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def run(model: Path, tokens: Path, seq: int, chunk: str, steps: int) -> dict:
    """One ``train`` process: its peak RSS (bytes) and wall time per step after the first (s)."""
    metrics = tokens.parent / f"m-{seq}-{chunk}.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pystronghold", "train", "--model", f"hf:{model}", "--data", str(tokens),
            "--seq", str(seq), "--batch", "1", "--window", "1", "--steps", str(steps), "--log-every", "1",
            "--eval-every", "0", "--eval-batches", "1", "--loss-chunk", chunk, "--quiet",
            "--metrics-file", str(metrics)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    if status != 0:
        raise SystemExit(f"train failed ({status}):\n{err[-2000:]}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_ms = [rec["ms_per_step"] for rec in lines if "ms_per_step" in rec][1:]
    return {"seq": seq, "loss_chunk": chunk, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "step_s": [ms / 1e3 for ms in step_ms], "losses": [rec["loss"] for rec in lines if "loss" in rec]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs=2, default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds of the step-time comparison "
                        "(each a process of 7 steps per configuration, the first step dropped)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model(root)
        tokens = root / "tokens.bin"
        np.random.default_rng(0).integers(0, VOCAB, 32 * args.seqs[1] + 64, dtype=np.uint16).tofile(tokens)
        records = []
        for seq in args.seqs:
            for chunk in ("0", "auto"):
                rec = run(model, tokens, seq, chunk, steps=2)
                records.append(rec)
                print(f"seq {seq:6d} --loss-chunk {chunk:4s} peak RSS {rec['peak_rss_bytes'] / 2**30:.2f} GiB",
                      flush=True)
        growth = {c: next(r for r in records if r["seq"] == args.seqs[1] and r["loss_chunk"] == c)["peak_rss_bytes"]
                  - next(r for r in records if r["seq"] == args.seqs[0] and r["loss_chunk"] == c)["peak_rss_bytes"]
                  for c in ("0", "auto")}
        print(f"growth {args.seqs[0]} -> {args.seqs[1]}: full logits {growth['0'] / 2**30:.2f} GiB, "
              f"chunked {growth['auto'] / 2**30:.2f} GiB")
        watch = LoadWatch()
        full, chunked = [], []
        for _ in range(args.rounds):  # taking turns, each a fresh process
            full += run(model, tokens, args.seqs[0], "0", steps=7)["step_s"]
            chunked += run(model, tokens, args.seqs[0], "auto", steps=7)["step_s"]
        load = watch.stop()
        r = paired_ratio(full, chunked)
        print(f"step time at {args.seqs[0]}: chunked / full = {1 / r.median:.3f} "
              f"(p20-p80 {1 / r.p80:.3f}-{1 / r.p20:.3f}), load {load.label()}")
        if args.json:
            write_json(args.json, "long_context", records,
                       {"growth_bytes": growth, "chunked_over_full_step": 1 / r.median, "p20": 1 / r.p80,
                        "p80": 1 / r.p20, **load.fields()})


if __name__ == "__main__":
    main()
