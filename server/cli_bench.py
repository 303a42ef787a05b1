"""`corectl bench {throughput,latency,serve}`: offline engine benchmarks and the online load generator."""
from __future__ import annotations

from . import bench_offline, bench_serve


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks: offline throughput and latency, online serving")
    bench = parser.add_subparsers(dest="bench_command", required=True)
    bench_offline.register_throughput(bench)
    bench_offline.register_latency(bench)
    bench_serve.register(bench)
