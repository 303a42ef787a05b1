"""`corectl bench {throughput,latency,serve,grammar,verify-step}`: offline engine benchmarks, the online
load generator, the per-step cost of grammar-constrained decoding, and of speculative verification."""
from __future__ import annotations

from ..bench import grammar, images, offline, serve, verify_step


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks: offline throughput and latency, online serving, grammar overhead")
    bench = parser.add_subparsers(dest="bench_command", required=True)
    offline.register_throughput(bench)
    offline.register_latency(bench)
    serve.register(bench)
    grammar.register(bench)
    verify_step.register(bench)
    images.register(bench)
