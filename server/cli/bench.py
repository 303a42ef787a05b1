"""`corectl bench {throughput,latency,serve,grammar}`: offline engine benchmarks, the online load generator,
and the per-step cost of grammar-constrained decoding."""
from __future__ import annotations

from ..bench import grammar, offline, serve


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks: offline throughput and latency, online serving, grammar overhead")
    bench = parser.add_subparsers(dest="bench_command", required=True)
    offline.register_throughput(bench)
    offline.register_latency(bench)
    serve.register(bench)
    grammar.register(bench)
