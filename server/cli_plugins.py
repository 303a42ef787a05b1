"""`corectl plugins`: what the installed plugins provide, and which platforms this machine can run."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    parser = sub.add_parser("plugins", help="list discovered platforms, model architectures and attention backends")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from corectl.platforms import spec_available
    from corectl.plugins import get_plugin_manager

    pm = get_plugin_manager()
    rows = [("platform", "name", "plugin", "package", "priority", "available")]
    for spec in sorted(pm.platforms().values(), key=lambda s: -s.priority):
        rows.append(("platform", spec.name, spec.plugin, pm.provider(spec.plugin), str(spec.priority),
                     "yes" if spec_available(spec) else "no"))
    for spec in sorted(pm.model_architectures().values(), key=lambda s: s.architecture):
        rows.append(("model", spec.architecture, spec.plugin, pm.provider(spec.plugin), "", ""))
    for spec in sorted(pm.attention_backends().values(), key=lambda s: s.name):
        rows.append(("attention", spec.name, spec.plugin, pm.provider(spec.plugin), "",
                     "platforms: " + ",".join(spec.platforms)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
