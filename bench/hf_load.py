"""Host memory of loading a Hugging Face model from a local directory: transformers' own
``from_pretrained`` against ``pystronghold.from_pretrained`` with every block state on disk.

A random Llama of the given shape is saved (sharded safetensors) to a temporary directory; then
each loader runs in its own fresh Python process, which reports its peak resident set size
(``ru_maxrss``): after the imports (the baseline), after loading and one forward (every weight
touched: transformers 5 maps the shards and reads pages on first use), and (pystronghold) after
one training step. pystronghold builds the blocks one at a time into the store (``nvme_states="all"``:
masters, moments and gradients on disk, a host cache of ``--cache-blocks`` blocks), so its peak
above the baseline is about the head/tail plus a few blocks, whatever the number of layers;
transformers holds the whole model. Before any figure is reported, both loaders' logits on one
batch must be equal (fp32).

    .venv/bin/python bench/hf_load.py                          # 24 layers, hidden 1024 (~1.3 GB fp32)
    .venv/bin/python bench/hf_load.py --layers 8 --json bench/results/hf_load.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

_PREAMBLE = """
import resource, sys, json, torch
import pystronghold as ph
import transformers
torch.manual_seed(0)
x = torch.randint(0, {vocab}, (1, 32))
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
out = {{"baseline_mib": peak_mib()}}
"""

_SAVE = """
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(num_hidden_layers={layers}, hidden_size={hidden}, num_attention_heads={heads},
    num_key_value_heads={kv_heads}, intermediate_size={ffn}, vocab_size={vocab}, max_position_embeddings=256,
    use_cache=False)
with torch.device("meta"):
    numel = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
model = transformers.LlamaForCausalLM(config)
model.save_pretrained({directory!r}, max_shard_size="200MB")
print(numel)
"""

_TRANSFORMERS = """
model = transformers.AutoModelForCausalLM.from_pretrained({directory!r}, local_files_only=True, dtype=torch.float32)
with torch.no_grad():
    torch.save(model(input_ids=x).logits, {logits!r})
out["loaded_mib"] = peak_mib()  # after a forward: every weight has been touched
print(json.dumps(out))
"""

_PYSTRONGHOLD = """
engine = ph.from_pretrained({directory!r}, window=2, nvme_dir={nvme!r}, nvme_states="all",
                            nvme_cache_blocks={cache_blocks}, optimizer=ph.AdamW(lr=1e-5))
engine.model.eval()
with torch.no_grad():
    logits = engine(input_ids=x).logits
engine.model.train()
out["loaded_mib"] = peak_mib()
torch.testing.assert_close(logits, torch.load({logits!r}), rtol=0, atol=0)
loss = engine(input_ids=x, labels=x).loss
engine.backward(loss); engine.step(); engine.zero_grad(); engine.close()
out["step_mib"] = peak_mib()
print(json.dumps(out))
"""


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--cache-blocks", type=int, default=2, help="host cache of the NVMe tier, blocks")
    parser.add_argument("--dir", default=None, help="where the model and the NVMe tier go (default: a temp dir)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                 ffn=args.hidden * 11 // 4, vocab=args.vocab)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory, logits = str(Path(tmp) / "model"), str(Path(tmp) / "logits.pt")
        numel = int(_run(_SAVE.format(directory=directory, **shape)))
        pre = _PREAMBLE.format(vocab=args.vocab)
        hf = json.loads(_run(pre + _TRANSFORMERS.format(directory=directory, logits=logits)))
        ph = json.loads(_run(pre + _PYSTRONGHOLD.format(directory=directory, logits=logits, nvme=tmp,
                                                        cache_blocks=args.cache_blocks)))
    model_mib = numel * 4 / 2**20
    rows = [dict(loader="transformers from_pretrained", **hf),
            dict(loader=f"pystronghold from_pretrained (NVMe all, cache {args.cache_blocks})", **ph)]
    for row in rows:
        row["load_above_baseline_mib"] = row["loaded_mib"] - row["baseline_mib"]
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {numel / 1e6:.1f}M "
          f"parameters, {model_mib:.0f} MiB in fp32; logits equal (fp32)")
    print_table(rows, ["loader", "baseline_mib", "loaded_mib", "load_above_baseline_mib", "step_mib"],
                "peak resident set size, MiB")
    write_json(args.json, "hf_load", rows, {"shape": shape, "parameters": numel, "model_mib": model_mib})


if __name__ == "__main__":
    main()
