"""Loading a Hugging Face model from a local directory: load time and peak host memory (resident
set) of transformers' ``from_pretrained`` against ``pystronghold.from_pretrained`` with every block
state on disk.

A random Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, FFN 5632, 32 heads, 4 KV heads,
vocabulary 32000) is saved once as bf16 safetensors shards of ``--shard-size`` in ``--dir`` (kept
there for the next run; default: a temporary directory). Each contender then runs in its own fresh
Python process, which imports torch, transformers and pystronghold, reads its peak resident set
(VmHWM) as the baseline, loads, and reports the peak again:

  transformers bf16      ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)``
  transformers fp32      the same with ``dtype=torch.float32``: what a plain fp32 AdamW fine-tune
                         starts from (its first step then adds gradients and two moments: 16 B/param)
  pystronghold           ``pystronghold.from_pretrained(DIR, precision=..., nvme_dir=..., nvme_states="all")``:
                         blocks are read one at a time into the store, whose master, moments,
                         gradient and shadow live on disk apart from a host cache of
                         ``--cache-blocks`` blocks; then one training step (time to first step)

Every contender runs one forward on the same batch after loading (every weight touched:
transformers maps the shards and reads pages on first use), and pystronghold's logits are checked
against transformers' fp32 ones before any figure is printed (fp32: ``FP32_TOL``; bf16: an error at
most ``BF16_ERROR_FACTOR`` times transformers' own in bf16). For pystronghold the
engine's own figures are printed beside the measured peak: its host store (``stats()["store_bytes"]``,
the disk tier's cache included), the window's arena, the head and tail (parameters, gradients,
masters and moments, ``head_tail_bytes``) and one block in fp32 (how it is read from the shards):
the peak is their sum plus transformers' and torch's working memory, whatever the number of layers.

    .venv/bin/python bench/hf_load.py --dir /work/tmp/hf_load --json bench/results/hf_load.json   # 1.1B
    .venv/bin/python bench/hf_load.py --small                                                      # seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, host_peak_bytes, print_table, write_json  # noqa: E402

TINYLLAMA = dict(layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000)
"""TinyLlama-1.1B's shape (1.10B parameters, untied head)."""
SMALL = dict(layers=4, hidden=64, ffn=176, heads=4, kv_heads=2, vocab=512)
"""A tiny Llama for the test: loads in seconds."""
CONTENDERS = ("transformers bf16", "transformers fp32", "pystronghold")
BF16_ERROR_FACTOR = 2.0
"""In bf16, pystronghold's largest logit error against transformers' fp32 logits may be at most this
many times transformers' own bf16 error (the same weights, rounded alike; the engine's block calls
round in other places, so equality is not expected)."""
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
"""In fp32, pystronghold's logits against transformers' fp32 ones."""
MiB = 2**20


# ---- the model on disk


def model_dir(root: Path, shape: dict) -> Path:
    """Where the model of ``shape`` is kept under ``root`` (one directory per shape)."""
    return root / "llama-{layers}x{hidden}-ffn{ffn}-h{heads}-kv{kv_heads}-v{vocab}".format(**shape)


def llama_config(shape: dict):
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                                    intermediate_size=shape["ffn"], num_attention_heads=shape["heads"],
                                    num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                                    max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False)


def write_model(directory: Path, shape: dict, shard_size: str) -> None:
    """Save a random bf16 Llama of ``shape`` to ``directory`` (sharded safetensors), unless it is
    there already. Built in bf16 (2 bytes per parameter, 2.2 GB at 1.1B), in a child process so
    that its memory is returned before anything is measured."""
    if (directory / "config.json").exists():
        return
    code = ("import json, sys, torch, transformers; sys.path.insert(0, sys.argv[1]); import hf_load\n"
            "torch.manual_seed(0); torch.set_default_dtype(torch.bfloat16)\n"
            "model = transformers.LlamaForCausalLM(hf_load.llama_config(json.loads(sys.argv[2])))\n"
            "model.save_pretrained(sys.argv[3] + '.partial', max_shard_size=sys.argv[4])\n")
    partial = Path(str(directory) + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    run_python(["-c", code, str(Path(__file__).resolve().parent), json.dumps(shape), str(directory), shard_size])
    partial.rename(directory)  # a run killed while writing leaves no half model behind


def parameter_counts(shape: dict) -> dict:
    """Parameters of the whole model, of one block and of the head and tail (counted on ``meta``)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(shape))
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    return {"parameters": total, "block_parameters": block, "head_tail_parameters": total - shape["layers"] * block}


def run_python(argv: list[str]) -> str:
    """Run this interpreter with ``argv``; the last line of its output ("" when none)."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {argv[:2]} failed:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


# ---- the contenders, each in its own process


def batch(vocab: int):
    import torch

    return torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))


def import_everything() -> None:
    """Import what any contender uses, transformers' lazily imported Llama modules included (~170 MiB
    of code and data): every child does, before its baseline, so that the baselines are equal."""
    import pystronghold  # noqa: F401
    import transformers

    transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018  (resolve the lazy imports)


def measure_transformers(directory: str, dtype_name: str, logits_path: str) -> dict:
    import torch
    import transformers

    import_everything()
    baseline = host_peak_bytes()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.bfloat16 if dtype_name == "bf16" else torch.float32)
    load_s = time.perf_counter() - t0
    loaded = host_peak_bytes()
    x = batch(model.config.vocab_size)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    forward_s = time.perf_counter() - t0
    torch.save(logits, logits_path)
    return {"baseline_MiB": baseline / MiB, "load_s": load_s, "forward_s": forward_s,
            "loaded_MiB": (loaded - baseline) / MiB, "forward_MiB": (host_peak_bytes() - baseline) / MiB}


def check_logits(logits, logits_paths: dict, precision: str) -> tuple[float, float]:
    """The largest logit errors against transformers' fp32 logits of pystronghold's and of
    transformers' bf16, after checking the first (fp32: ``FP32_TOL``; bf16: within
    ``BF16_ERROR_FACTOR`` times the second)."""
    import torch

    fp32 = torch.load(logits_paths["fp32"])
    error = (logits.float() - fp32).abs().max().item()
    reference_error = (torch.load(logits_paths["bf16"]).float() - fp32).abs().max().item()
    if precision == "fp32":
        torch.testing.assert_close(logits, fp32, **FP32_TOL)
        return error, reference_error
    if not error <= BF16_ERROR_FACTOR * reference_error:
        raise AssertionError(f"bf16 logits: largest error {error:.3g} against transformers' fp32, more than "
                             f"{BF16_ERROR_FACTOR:g} x transformers' own bf16 error {reference_error:.3g}")
    return error, reference_error


def measure_pystronghold(directory: str, precision: str, nvme: str, window: int, cache_blocks: int,
                         logits_paths: dict) -> dict:
    import torch

    import pystronghold as ph
    from pystronghold.runtime.memory.layout import head_tail_bytes
    from pystronghold.settings.precision import compute_dtype

    import_everything()
    baseline = host_peak_bytes()
    t0 = time.perf_counter()
    engine = ph.from_pretrained(directory, window=window, precision=precision, nvme_dir=nvme, nvme_states="all",
                                nvme_cache_blocks=cache_blocks, optimizer=ph.AdamW(lr=1e-5))
    load_s = time.perf_counter() - t0
    loaded = host_peak_bytes()
    x = batch(engine.model.config.vocab_size)
    engine.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    forward_s = time.perf_counter() - t0
    forward = host_peak_bytes()
    logits_error, bf16_logits_error = check_logits(logits, logits_paths, precision)
    engine.train()
    t0 = time.perf_counter()
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.synchronize()
    step_s = time.perf_counter() - t0
    stats = engine.stats()
    engine.close()
    return {"baseline_MiB": baseline / MiB, "load_s": load_s, "forward_s": forward_s, "first_step_s": step_s,
            "loaded_MiB": (loaded - baseline) / MiB, "forward_MiB": (forward - baseline) / MiB,
            "step_MiB": (host_peak_bytes() - baseline) / MiB, "logits_error": logits_error,
            "transformers_bf16_logits_error": bf16_logits_error,
            "store_host_MiB": stats["store_bytes"] / MiB, "store_disk_MiB": stats["disk"]["file_bytes"] / MiB,
            "arena_MiB": stats["arena_used_bytes"] / MiB,
            "head_tail_MiB": head_tail_bytes(engine.head_tail_params, compute_dtype(precision)) / MiB}


def child(argv: list[str]) -> None:
    """``--child NAME ...``: one contender in this fresh process; prints its record as JSON."""
    name, directory, logits_dir = argv[0], argv[1], Path(argv[2])
    logits_paths = {p: str(logits_dir / f"logits_{p}.pt") for p in ("bf16", "fp32")}
    if name == "pystronghold":
        precision, nvme, window, cache_blocks = argv[3], argv[4], int(argv[5]), int(argv[6])
        out = measure_pystronghold(directory, precision, nvme, window, cache_blocks, logits_paths)
    else:
        dtype_name = name.split()[-1]
        out = measure_transformers(directory, dtype_name, logits_paths[dtype_name])
    print(json.dumps(out))


# ---- the comparison


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny Llama instead of TinyLlama-1.1B's shape")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--dir", default=None, help="where the model is kept (written once) and the NVMe tier's "
                        "scratch goes; default: a temporary directory, removed at the end")
    parser.add_argument("--shard-size", default="2GB", help="max_shard_size of the saved model")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="pystronghold's")
    parser.add_argument("--window", type=int, default=2, help="W, blocks in the window")
    parser.add_argument("--cache-blocks", type=int, default=1, help="host cache of the NVMe tier, blocks")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    shape = dict(SMALL if args.small else TINYLLAMA)
    if args.layers:
        shape["layers"] = args.layers
    counts = parameter_counts(shape)
    block_fp32_MiB = counts["block_parameters"] * 4 / MiB

    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hf_load.") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        directory = model_dir(root, shape)
        t0 = time.perf_counter()
        write_model(directory, shape, args.shard_size)
        print(f"model: {directory} ({time.perf_counter() - t0:.0f} s to make it ready)")
        script = str(Path(__file__).resolve())
        rows = []
        for name in CONTENDERS:
            watch = LoadWatch()
            if name == "pystronghold":
                nvme = Path(tmp) / "nvme"
                nvme.mkdir()
                extra = [args.precision, str(nvme), str(args.window), str(args.cache_blocks)]
            else:
                extra = []
            line = run_python([script, "--child", name, str(directory), tmp, *extra])
            rows.append({"loader": name, **json.loads(line), **watch.stop().fields()})

    base = {row["loader"]: row for row in rows}
    ours = base["pystronghold"]
    for row in rows:
        # NOTE: transformers maps the shards and reads a weight at its first use, so its load_s
        # leaves part of the reading to the first forward: times compare up to that forward's end.
        row["ready_s"] = row["load_s"] + row["forward_s"]
    for row in rows:
        for versus in ("transformers bf16", "transformers fp32"):
            row[f"ready_x {versus}"] = row["ready_s"] / base[versus]["ready_s"]
            row[f"peak_x {versus}"] = row["forward_MiB"] / base[versus]["forward_MiB"]
    ours["accounted_MiB"] = ours["store_host_MiB"] + ours["arena_MiB"] + ours["head_tail_MiB"] + block_fp32_MiB

    print(f"\nLlama {shape['layers']} layers, hidden {shape['hidden']}, FFN {shape['ffn']}, {shape['heads']} heads "
          f"({shape['kv_heads']} KV), vocabulary {shape['vocab']}: {counts['parameters'] / 1e6:,.1f}M parameters "
          f"({counts['block_parameters'] / 1e6:.1f}M per block, {counts['head_tail_parameters'] / 1e6:.1f}M head and "
          f"tail); bf16 shards of {args.shard_size}; pystronghold: {args.precision}, W={args.window}, every block "
          f"state on disk, host cache {args.cache_blocks} block(s); logits checked first against transformers' "
          f"fp32: largest error {ours['logits_error']:.3g} (transformers' bf16: "
          f"{ours['transformers_bf16_logits_error']:.3g}" + (f", x{BF16_ERROR_FACTOR:g} allowed)" if args.precision == "bf16" else ")"))
    print_table(rows, ["loader", "load_s", "forward_s", "loaded_MiB", "forward_MiB", "step_MiB", "ready_x transformers fp32",
                       "peak_x transformers bf16", "peak_x transformers fp32", "load"],
                f"peak resident set above the baseline (after every import: {rows[0]['baseline_MiB']:,.0f} MiB), MiB: "
                "after loading, after one forward, after one training step; ready_x: load + first forward time, "
                "peak_x: forward_MiB, as ratios to the transformers row of the same run")
    print_table([ours], ["store_host_MiB", "store_disk_MiB", "arena_MiB", "head_tail_MiB", "accounted_MiB",
                         "step_MiB", "first_step_s"],
                f"pystronghold's own figures: host store (NVMe cache included) and its files on disk, window arena, "
                f"head and tail when training; accounted = their sum + one block in fp32 ({block_fp32_MiB:,.0f} MiB)")
    plain_adam_MiB = counts["parameters"] * 16 / MiB
    print(f"a plain fp32 AdamW step on transformers' fp32 model would hold {plain_adam_MiB:,.0f} MiB "
          "(parameters, gradients, two moments: 16 B/param); not run")
    write_json(args.json, "hf_load", rows, {"shape": shape, "bf16_error_factor": BF16_ERROR_FACTOR, **counts, "shard_size": args.shard_size,
                                            "precision": args.precision, "window": args.window,
                                            "cache_blocks": args.cache_blocks, "block_fp32_MiB": block_fp32_MiB,
                                            "plain_adam_MiB": plain_adam_MiB})
    return 0


if __name__ == "__main__":
    sys.exit(main())
