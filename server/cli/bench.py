"""`corectl bench {throughput,latency,serve,grammar}`: offline engine benchmarks, the online load generator,
and the per-step cost of grammar-constrained decoding."""
from __future__ import annotations

from . import bench_grammar, bench_offline, bench_serve


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks: offline throughput and latency, online serving, grammar overhead")
    bench = parser.add_subparsers(dest="bench_command", required=True)
    bench_offline.register_throughput(bench)
    bench_offline.register_latency(bench)
    bench_serve.register(bench)
    bench_grammar.register(bench)
