"""The benchmarks behind `corectl bench`: offline throughput/latency, HTTP serving load, grammar compile."""
