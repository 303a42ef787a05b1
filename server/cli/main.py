"""The `corectl` command line: one subcommand per module, dispatched here."""
from __future__ import annotations

import argparse
import sys

from corectl.errors import CorectlError

from . import bench, generate, plan, plugins, run_batch, serve

SUBCOMMANDS = [generate, plugins, serve, run_batch, plan, bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corectl", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except CorectlError as exc:
        print(f"corectl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
