"""`corectl plugins`: what the installed plugins provide, and which platforms this machine can run."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    parser = sub.add_parser("plugins", help="list discovered platforms, model architectures, attention and "
                                               "structured-output backends, and tool and reasoning parsers")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from corectl.discovery import plugin_inventory

    rows = [("kind", "name", "plugin", "package", "priority", "available")]
    rows += [(r.kind, r.name, r.plugin, r.package, r.priority, r.detail) for r in plugin_inventory()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
