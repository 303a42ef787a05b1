"""The serving side of corectl, one subpackage per job: `http/` (the OpenAI-compatible Litestar server),
`cli/` (the `corectl` command line) and `bench/` (the benchmarks `corectl bench` runs)."""
