"""Command line: `pystronghold info` (more subcommands join as they are built)."""

from __future__ import annotations

import argparse
import json
import sys


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
    parser = argparse.ArgumentParser(
        prog="pystronghold",
        description="Train models larger than accelerator memory.",
        epilog="example: pystronghold info --json",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, build (compiler, SIMD), threads, CUDA and Triton status")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=_cmd_info)
    from pystronghold.planner.command import add_plan_command

    add_plan_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
