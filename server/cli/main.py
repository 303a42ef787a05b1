"""The `corectl` command line: one subcommand per module, dispatched here."""
from __future__ import annotations

import argparse
import sys

from corectl.errors import CorectlError

from . import bench, generate, plan, plugins, proxy, run_batch, serve
from .vllm_flags import expand_config_file

SUBCOMMANDS = [generate, plugins, serve, proxy, run_batch, plan, bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corectl", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv = expand_config_file(list(sys.argv[1:] if argv is None else argv))
    except CorectlError as exc:
        print(f"corectl: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's own usage, which lists the flags it takes (argparse would print corectl's).
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args) or 0
    except CorectlError as exc:
        print(f"corectl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


if __name__ == "__main__":
    sys.exit(main())
