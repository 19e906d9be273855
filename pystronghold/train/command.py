"""``pystronghold train`` and ``pystronghold export``: argparse generated from the dataclasses of
``pystronghold.train.config``; one-line errors and a non-zero exit for bad input."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from pystronghold.planner.command import field_docs

__all__ = ["add_train_command", "add_export_command", "config_from_args"]

log = logging.getLogger("pystronghold.train")

EXAMPLES = """examples:
  pystronghold train                                   # the demo: 12 blocks, W=2, stdlib text, ~3 min
  pystronghold train --steps 20 --log-every 5          # a short run
  pystronghold train --model tiny --window auto --trace out/   # Perfetto trace + PNG timeline + loss
  pystronghold train --data notes.txt src/ --batch 4 --seq 64
  pystronghold train --checkpoint-dir ck --checkpoint-every 50  # then add --resume to continue
  pystronghold train --model gpt3-125m --device cuda --precision bf16 --window 4
  pystronghold train --model hf:llama-dir --data notes.jsonl --checkpoint-dir ck   # then export ck out/ --hf
  torchrun --nproc-per-node 4 -m pystronghold train --model tiny --tp 2 --dp 2   # 4 processes
"""

_TYPES = {"str": str, "int": int, "float": float}


def _add_fields(parser, cls) -> None:
    group = parser.add_argument_group(cls.__doc__.strip().rstrip("."))
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        kind = str(f.type).replace("| None", "").strip()
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        elif kind == "list[str]":
            group.add_argument(flag, dest=f.name, nargs="+", default=default, metavar="PATH", help=help_text)
        else:
            if default is not None:
                help_text += f" (default: {default})"
            metavar = None if "choices" in f.metadata else f.metadata.get(
                "metavar", {"int": "N", "float": "X", "str": "TEXT"}[kind])
            group.add_argument(flag, dest=f.name, type=_TYPES[kind], default=default, help=help_text,
                               choices=f.metadata.get("choices"), metavar=metavar)


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of parsed ``args`` (ValueError for bad values)."""
    from pystronghold.train.config import COMPONENTS, TrainConfig

    parts = {name: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
             for name, cls in COMPONENTS.items()}
    return TrainConfig(**parts)


def _one_line_error(prog: str):
    def error(message: str):
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    return error


def run_train(args: argparse.Namespace) -> int:
    """Run ``pystronghold train``: 0 on success, 2 on bad input, 1 when training fails."""
    from pystronghold.train.checkpoint import CheckpointError
    from pystronghold.train.loop import Trainer, close_parallel

    # Under torchrun every rank runs this; only rank 0 logs, draws the bar and prints errors (every
    # rank fails alike on bad input, so the others exit with the same status, silently).
    rank0 = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.ERROR, format="%(message)s", stream=sys.stdout)

    def error(message: str) -> None:
        if rank0:
            print(f"pystronghold train: error: {message}", file=sys.stderr)

    try:
        config = config_from_args(args)
        trainer = Trainer(config)
    except (ValueError, OSError, MemoryError, CheckpointError) as e:  # bad input, data, host too small
        close_parallel()
        error(str(e))
        return 2
    except BaseException:
        close_parallel()
        raise
    bar = None
    if rank0 and not config.run.quiet and trainer.step < config.run.steps:
        from tqdm import tqdm

        bar = tqdm(total=config.run.steps, initial=trainer.step, desc="train", unit="step",
                   dynamic_ncols=True, file=sys.stderr)

    def on_step(step: int, loss: float) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

    failure = None
    try:
        result = trainer.train(on_step)
    except (OSError, CheckpointError, FloatingPointError) as e:  # disk full, non-finite gradients
        # NOTE: a collective that timed out (a peer died) surfaces as a RuntimeError subclass
        # (DistBackendError) and keeps its traceback: that is a crash, not bad input.
        failure = f"at step {trainer.step + 1}: {e}"
    finally:
        if bar is not None:
            bar.close()
        try:
            trainer.close()
        except (OSError, CheckpointError, FloatingPointError) as e:
            failure = failure or f"finishing the run: {e}"  # the first failure is the one to report
    if failure is not None:
        error(failure)
        return 1
    for line in result.summary_lines():
        log.info("%s", line)
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Run ``pystronghold export``: 0 on success, 2 for a missing/corrupt checkpoint."""
    from pystronghold.train.checkpoint import CheckpointError, export_weights, latest_checkpoint
    from pystronghold.train.config import parse_bytes

    from pathlib import Path

    path = Path(args.checkpoint)
    if not (path / "manifest.json").exists():
        path = latest_checkpoint(path) or path
    try:
        if args.hf:
            from pystronghold.train.export_hf import export_hf

            out = export_hf(path, args.output, max_shard_bytes=parse_bytes(args.max_shard_size, "--max-shard-size"))
        else:
            out = export_weights(path, args.output)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"pystronghold export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (weights of {path})")
    return 0


def add_train_command(subparsers) -> argparse.ArgumentParser:
    """Add ``train`` to the ``pystronghold`` subcommands."""
    from pystronghold.train.config import COMPONENTS

    parser = subparsers.add_parser(
        "train", help="train a GPT through the layer window (no arguments: the demo)",
        description="Train a GPT with only a window of its blocks on the device; the rest, and the "
                    "optimizer, on the host.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    for cls in COMPONENTS.values():
        _add_fields(parser, cls)
    parser.error = _one_line_error("pystronghold train")  # NOTE: argparse's usage dump is not one line
    parser.set_defaults(run=run_train)
    return parser


def add_export_command(subparsers) -> argparse.ArgumentParser:
    """Add ``export`` (checkpoint -> plain safetensors / PyTorch state dict)."""
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's weights as a plain safetensors (or .pt) state dict, or "
                       "(--hf) as a Hugging Face model directory",
        epilog="examples:\n"
               "  pystronghold export ck/ model.safetensors   # the latest checkpoint in ck/\n"
               "  pystronghold export ck/ tuned/ --hf         # a --model hf:DIR run -> from_pretrained('tuned/')",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a --checkpoint-dir (its latest)")
    parser.add_argument("output", help="output file: .safetensors, or .pt for torch.save; with --hf a new "
                                       "(or empty) directory")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face directory (config.json, safetensors shards, index, "
                             "tokenizer) of a run trained with --model hf:DIR")
    parser.add_argument("--max-shard-size", default="2GiB", metavar="BYTES",
                        help="--hf: most bytes per safetensors shard, e.g. 2GiB, 500MB (default: 2GiB)")
    parser.error = _one_line_error("pystronghold export")
    parser.set_defaults(run=run_export)
    return parser
