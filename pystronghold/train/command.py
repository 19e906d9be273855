"""``pystronghold train`` and ``pystronghold export``: argparse generated from ``TrainConfig``
(``pystronghold.options``); one-line errors and a non-zero exit for bad input."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import time

from pystronghold.options import first_line, one_line_error

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
  pystronghold train --model hf:llama-dir --lora-rank 16 --lora-targets q_proj,v_proj --checkpoint-dir ck
  pystronghold train --model hf:llama-dir --freeze 'embed|layers\\.([0-9]|1[0-5])\\.' --window 4  # top layers only
  torchrun --nproc-per-node 4 -m pystronghold train --model tiny --tp 2 --dp 2   # 4 processes
"""


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of parsed ``args`` (ValueError naming the option for bad values), with the
    options given (``TrainConfig.given``)."""
    from pystronghold.options import from_args, given_options
    from pystronghold.train.config import TrainConfig

    config = from_args(TrainConfig, args)
    config.given = given_options(TrainConfig, args)
    return config


RANK_0_REPORT_WAIT_S = 60.0


def _leave_the_first_exit_to_rank_0(message: str) -> None:
    """A rank other than 0 that failed at start-up: wait (at most ``RANK_0_REPORT_WAIT_S`` seconds)
    for the launcher to stop it, and print ``message`` only if it is still running then.

    Every rank fails alike on bad input, and rank 0 alone prints it. A rank that got there first and
    exited would make torchrun report its silent failure and terminate rank 0 before it printed
    (start-up times differ by seconds under load): so the others let rank 0 exit first, and
    torchrun's SIGTERM ends them. A rank still alive after the wait failed where rank 0 did not
    (its own files, say), so it says why itself.
    """
    time.sleep(RANK_0_REPORT_WAIT_S)
    print(f"pystronghold train: error: rank {os.environ.get('RANK')}: {message}", file=sys.stderr)


def run_train(args: argparse.Namespace) -> int:
    """Run ``pystronghold train``: 0 on success, 2 on bad input, 1 when training fails."""
    from pystronghold.runtime.optimizer.divergence import DivergenceError
    from pystronghold.train.checkpoint import CheckpointError, CheckpointWriteError, SaveInterrupted
    from pystronghold.options import ConfigError
    from pystronghold.train.loop import Trainer, close_parallel
    from pystronghold.train.metrics import OutputWriteError
    from pystronghold.train.run import resolve

    # Under torchrun every rank runs this; only rank 0 logs, draws the bar and prints errors (every
    # rank fails alike on bad input, so the others exit with the same status, silently).
    rank0 = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.ERROR, format="%(message)s", stream=sys.stdout)

    def error(message: str) -> None:
        if rank0:
            print(f"pystronghold train: error: {message}", file=sys.stderr)

    try:
        config = config_from_args(args)
        trainer = Trainer(resolve(config))
    except (ValueError, OSError, MemoryError, CheckpointError) as e:  # bad input, data, host too small
        close_parallel()
        message = e.on_command_line() if isinstance(e, ConfigError) else str(e)
        if rank0:
            error(message)
        else:
            _leave_the_first_exit_to_rank_0(message)
        return 2
    except BaseException:
        close_parallel()
        raise
    progress = None
    if rank0 and not config.run.quiet and trainer.step < config.run.steps:
        progress = Progress(config.run.steps, trainer.step, sys.stderr)

    def on_step(step: int, loss: float) -> None:
        if progress is not None:
            progress.update(step, loss)

    failure, result, every_rank = None, None, False
    stopper = StopOnSignal(trainer)
    try:
        with stopper:
            result = trainer.train(on_step)
    except SaveInterrupted as e:  # a second Ctrl-C in a save: it names the step saved
        failure = str(e)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once
        failure = f"interrupted again: stopped at once in step {trainer.step + 1} (no checkpoint written)"
    except DivergenceError as e:  # inf/NaN: its one line names the step already
        failure = str(e)
    except (OSError, CheckpointError, FloatingPointError) as e:  # disk full, non-finite gradients
        # a failed save names its own step (the one just trained), others the step in progress
        # (an output's names its option and path: the trace is written after the last step)
        named = isinstance(e, (CheckpointWriteError, OutputWriteError))
        failure = str(e) if named else f"at step {trainer.step + 1}: {e}"
    except RuntimeError as e:  # NOTE: a peer that died fails this rank's collective; anything else is a crash
        failure = _peer_failure(e, trainer)
        if failure is None:
            raise
        every_rank = True  # whichever rank survived says it (rank 0 may be the one that died)
    finally:
        if progress is not None:
            progress.close()
        try:
            trainer.close()
        except (OSError, CheckpointError, FloatingPointError) as e:
            failure = failure or f"finishing the run: {e}"  # the first failure is the one to report
        except KeyboardInterrupt:
            pass
    if failure is not None:
        if every_rank:
            print(f"pystronghold train: error: {failure}", file=sys.stderr)
        else:
            error(failure)
        return stopper.exit_status or 1
    if result.stopped_by is not None:
        where = f"; checkpoint {result.checkpoints[-1]}" if result.checkpoints else ""
        if rank0:
            print(f"pystronghold train: stopped by {result.stopped_by} after step {trainer.step}{where}",
                  file=sys.stderr)
        return stopper.exit_status or 130
    for line in result.summary_lines():
        log.info("%s", line)
    return 0


def _peer_failure(e: RuntimeError, trainer) -> str | None:
    """The one line of a collective that failed because another process of a torchrun run stopped or
    was killed (gloo: the connection to it reset or closed; NCCL, or a timeout: a DistError); None
    for any other RuntimeError, or with one process."""
    import torch.distributed as dist

    text = first_line(e)
    if trainer.groups is None or not (isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text):
        return None
    # "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20370: Connection reset by peer.
    # This is typically caused by ..."
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0].rstrip(".")
    return (f"rank {trainer.rank}: a collective with the other processes failed in step {trainer.step + 1}: "
            f"{text} (another process of the run stopped or was killed: see its output)")


class StopOnSignal:
    """Within ``with``: the first SIGINT or SIGTERM asks ``trainer`` to stop after the step in
    progress (``Trainer.stop_requested``); a second one raises KeyboardInterrupt at once.
    ``exit_status`` is then 128 + the first signal's number (130 for SIGINT, 143 for SIGTERM)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.exit_status: int | None = None
        self._previous: dict = {}

    def handle(self, signum: int, frame=None) -> None:
        if self.exit_status is not None:
            raise KeyboardInterrupt
        self.exit_status = 128 + signum
        self.trainer.stop_requested = signal.Signals(signum).name
        log.warning("%s: stopping after step %d (Ctrl-C again to stop at once)",
                    signal.Signals(signum).name, self.trainer.step + 1)

    def __enter__(self) -> "StopOnSignal":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


class Progress:
    """A tqdm bar on a terminal; elsewhere (a file, a pipe) plain lines at every tenth of the run and
    at its end, so redirected output holds no redraws. While the bar is shown, the root logger's
    console lines go through ``tqdm.write``: each on a line of its own, the bar redrawn below it."""

    def __init__(self, total: int, initial: int, stream) -> None:
        self.total, self.stream = total, stream
        self.every = max(1, -(-total // 10))
        self.bar = None
        self._open = contextlib.ExitStack()
        if stream.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = self._open.enter_context(tqdm(total=total, initial=initial, desc="train", unit="step",
                                                     dynamic_ncols=True, file=stream))
            self._open.enter_context(logging_redirect_tqdm())

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"this step's loss {loss:.3f}")
        elif step % self.every == 0 or step == self.total:
            print(f"train: step {step}/{self.total} ({100 * step // self.total}%), "
                  f"this step's loss {loss:.3f}", file=self.stream, flush=True)

    def close(self) -> None:
        self._open.close()


def run_export(args: argparse.Namespace) -> int:
    """Run ``pystronghold export``: 0 on success, 2 for a missing/corrupt checkpoint."""
    from pystronghold.options import parse_bytes
    from pystronghold.train.checkpoint import CheckpointError, export_weights
    from pystronghold.train.checkpoint_dir import checkpoint_steps, newest_valid_checkpoint

    from pathlib import Path

    if not args.hf and (args.tokenizer is not None or args.no_tokenizer or args.merge):
        print("pystronghold export: error: --tokenizer, --no-tokenizer and --merge need --hf", file=sys.stderr)
        return 2
    if args.hf and args.overwrite:
        print("pystronghold export: error: --overwrite replaces an output file; --hf writes a new or empty "
              "directory", file=sys.stderr)
        return 2
    if not args.hf and os.path.lexists(args.output) and (os.path.isdir(args.output) or not args.overwrite):
        what = "is a directory" if os.path.isdir(args.output) else "exists (give --overwrite to replace it)"
        print(f"pystronghold export: error: {args.output} {what}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="pystronghold export: %(message)s", stream=sys.stderr)
    path = Path(args.checkpoint)
    if checkpoint_steps(path):  # a --checkpoint-dir: its newest valid checkpoint, damaged newer ones named
        path = newest_valid_checkpoint(path)
        if path is None:
            print(f"pystronghold export: error: no valid checkpoint in {args.checkpoint} (see the warnings above)",
                  file=sys.stderr)
            return 2
    try:
        if args.hf:
            from pystronghold.train.export_hf import export_hf

            out = export_hf(path, args.output, max_shard_bytes=parse_bytes(args.max_shard_size, "--max-shard-size"),
                            tokenizer_dir=args.tokenizer, copy_tokenizer=not args.no_tokenizer, merge=args.merge)
        else:
            out = export_weights(path, args.output)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"pystronghold export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (weights of {path})")
    return 0


def add_train_command(subparsers) -> argparse.ArgumentParser:
    """Add ``train`` to the ``pystronghold`` subcommands."""
    from pystronghold.options import add_options
    from pystronghold.train.config import TrainConfig

    parser = subparsers.add_parser(
        "train", help="train a GPT through the layer window (no arguments: the demo)",
        description="Train a GPT with only a window of its blocks on the device; the rest, and the "
                    "optimizer, on the host.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, TrainConfig)
    parser.error = one_line_error("pystronghold train")  # NOTE: argparse's usage dump is not one line
    parser.set_defaults(run=run_train)
    return parser


def add_export_command(subparsers) -> argparse.ArgumentParser:
    """Add ``export`` (checkpoint -> plain safetensors / PyTorch state dict)."""
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's weights as a plain safetensors (or .pt) state dict, or "
                       "(--hf) as a Hugging Face model directory",
        epilog="examples:\n"
               "  pystronghold export ck/ model.safetensors   # the latest checkpoint in ck/\n"
               "  pystronghold export ck/ tuned/ --hf         # a --model hf:DIR run -> from_pretrained('tuned/')\n"
               "  pystronghold export ck/ adapter/ --hf       # a --lora-rank run -> PeftModel.from_pretrained(base, 'adapter/')\n"
               "  pystronghold export ck/ merged/ --hf --merge  # a --lora-rank run, adapters merged -> from_pretrained('merged/')",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a --checkpoint-dir (its latest)")
    parser.add_argument("output", help="output file: .safetensors, or .pt for torch.save; with --hf a new "
                                       "(or empty) directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file (refused without it)")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face directory (config.json, safetensors shards, index, "
                             "tokenizer) of a run trained with --model hf:DIR")
    parser.add_argument("--merge", action="store_true",
                        help="--hf of a --lora-rank run: the base model with the adapters merged into its "
                             "weights (default: the adapters alone, in PEFT's format)")
    parser.add_argument("--max-shard-size", default="2GiB", metavar="BYTES",
                        help="--hf: most bytes per safetensors shard, e.g. 2GiB, 500MB (default: 2GiB)")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", metavar="DIR",
                           help="--hf: copy the tokenizer (and generation config) from DIR (default: the "
                                "run's --model hf:DIR)")
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="--hf: write the model without a tokenizer")
    parser.error = one_line_error("pystronghold export")
    parser.set_defaults(run=run_export)
    return parser
