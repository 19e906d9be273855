"""The tiled MLP on the CPU: how many bytes one block holds at its peak, untiled and over tiles.

A random Llama of the long-context shape (4 blocks, hidden 128, FFN 512, 32,000-token vocabulary,
``bench/long_context.py``'s), batch 1, fp32. One block runs the engine's way
(``runtime/blocks/block_fn.py``): its forward without a graph, then its backward: the recompute with a
graph and ``torch.autograd.grad`` for its input and parameters. The working set is the peak of the
bytes of the tensors made meanwhile that are alive (each storage counted once, from the op's output
until its last tensor dies), measured by a dispatch mode, not estimated. The MLP tiles through
``models.hf_tiling.tile_mlps``; tile 0 is untiled.

    .venv/bin/python bench/tiled_mlp.py --json bench/results/tiled_mlp.json
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 32_000, 128, 512, 4, 4


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops make while it is active and that are still alive (``now``),
    and their most at any moment (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.now = self.peak = 0

    def _dead(self, address: int) -> None:
        entry = self.live[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[address]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address == 0:
                continue
            if address in self.live:
                self.live[address][1] += 1  # a view, or the same tensor again
            else:
                self.live[address] = [storage.nbytes(), 1]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._dead, address)
        return out


def llama():
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=1 << 17,
                            use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config)


def block_working_set(model, seq: int) -> dict:
    """Peak live bytes of block 0's forward (no graph) and of its backward (recompute + grad)."""
    block = model.model.layers[0]
    x = torch.randn(1, seq, HIDDEN)
    rotary = model.model.rotary_emb(x, torch.arange(seq)[None])

    def run(inputs):
        out = block(inputs, position_embeddings=rotary)
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad(), LiveBytes() as forward:
        run(x)
    with LiveBytes() as backward:
        xi = x.detach().requires_grad_()
        out = run(xi)
        grads = torch.autograd.grad(out, [xi, *block.parameters()], torch.ones_like(out))
        del out
    del grads
    return {"forward_bytes": forward.peak, "backward_bytes": backward.peak}


def main() -> None:
    from pystronghold.models.hf_tiling import tile_mlps

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tiles", type=int, nargs="+", default=[0, 4096, 1024, 256])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = llama()
    records = []
    for seq in args.seqs:
        for tile in args.tiles:
            tile_mlps(model, tile if tile < seq else 0)
            rec = {"seq": seq, "tile": tile, **block_working_set(model, seq)}
            rec["intermediate_bytes"] = seq * FFN * 4
            records.append(rec)
    rows = [{"seq": r["seq"], "tile": r["tile"] or "untiled",
             "forward MiB": round(r["forward_bytes"] / 2**20, 1), "backward MiB": round(r["backward_bytes"] / 2**20, 1),
             "one (T, F) MiB": round(r["intermediate_bytes"] / 2**20, 1)} for r in records]
    print_table(rows, list(rows[0]), title="one block's working set (peak live bytes), Llama hidden 128, FFN 512, fp32")
    write_json(args.json, "tiled_mlp", records, {"shape": {"hidden": HIDDEN, "ffn": FFN, "heads": HEADS}})


if __name__ == "__main__":
    main()
