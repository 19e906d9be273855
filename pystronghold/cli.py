"""Command line: `pystronghold info | plan | train | export | bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pystronghold.interrupts import catch_start_up_signals, exit_status, start_up_message
from pystronghold.options import Parser, one_line_error


def _cmd_info(args: argparse.Namespace) -> int:
    from pystronghold.info import collect

    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 1 if str(facts.get("extension", "")).startswith("ERROR") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pystronghold",
        description="Train models larger than accelerator memory.",
        epilog="example: pystronghold info --json",
    )
    # NOTE: e.g. an unknown option after a subcommand lands here
    parser.error = one_line_error("pystronghold", hint=" (see pystronghold --help)")
    from pystronghold import __version__

    parser.add_argument("--version", action="version", version=f"pystronghold {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, build (compiler, SIMD), threads, CUDA and Triton status")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=_cmd_info)
    from pystronghold.planner.command import add_plan_command

    add_plan_command(sub)
    from pystronghold.train.command import add_export_command, add_train_command

    add_train_command(sub)
    add_export_command(sub)
    from pystronghold.bench_suite import add_bench_command

    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    words = sys.argv[1:] if argv is None else argv
    command = "pystronghold" + (f" {words[0]}" if words and not words[0].startswith("-") else "")
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank gets the Ctrl-C
    try:
        # NOTE: first, before torch is imported: a Ctrl-C while torch loaded numpy was lost
        with catch_start_up_signals(command, speak=rank0):
            args = build_parser().parse_args(argv)
            return args.run(args)
    except KeyboardInterrupt as e:  # start-up (imports, building); a run handles its own signals
        if rank0:
            print(f"{command}: {start_up_message(e)}", file=sys.stderr)
        return exit_status(e)


def run() -> None:
    """The ``pystronghold`` command (its console script and ``python -m pystronghold``): ``main``,
    then exit with its status. A rank of a multi-process run (``WORLD_SIZE`` > 1) leaves without
    the interpreter's finalization, once its output is flushed."""
    code = main()
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        # NOTE: a torch gloo worker may drop a finished collective's tensors just after the collective
        # returned; during finalization that GIL request ends the thread with pthread_exit, whose
        # unwind through C++ destructors aborts the process (SIGABRT after a run that succeeded). A
        # run has closed its engine, checkpoints and process group by now: nothing is left to finish
        # (multiprocessing's forked children leave the same way).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
