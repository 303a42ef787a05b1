"""The `corectl` command line: one subcommand per module, dispatched here."""
from __future__ import annotations

import argparse
import importlib
import sys

from corectl.errors import CorectlError

from .vllm_flags import expand_config_file

# Command -> the module that registers and runs it. A command imports only its own module: `serve`
# does not pay for the benchmarks' imports on every start.
SUBCOMMANDS = {"generate": "generate", "plugins": "plugins", "serve": "serve", "proxy": "proxy",
               "run-batch": "run_batch", "plan": "plan", "bench": "bench"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """corectl's parser: every subcommand, or only `command`'s when one is named."""
    parser = argparse.ArgumentParser(prog="corectl", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        if command in (None, name):
            importlib.import_module(f"{__package__}.{module}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv = expand_config_file(list(sys.argv[1:] if argv is None else argv))
    except CorectlError as exc:
        print(f"corectl: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
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
