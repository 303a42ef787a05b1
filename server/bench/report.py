"""Results of `corectl bench serve`: vLLM's metric definitions, its printed table, and the JSON file.

TTFT: request sent to first non-empty text chunk. ITL: gaps between successive text chunks (a
chunk carrying several tokens counts once). TPOT: per request, (E2EL - TTFT) / (output tokens - 1).
E2EL: request sent to last byte. Means, medians and percentiles are over successful requests (ITL:
over all gaps of all successful requests).
"""
from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field

# A client process busy this share of the wall time was probably slowing the benchmark down: its
# event loop queues chunk reads. On 2 x H200 one client at 84% measured two data-parallel engines
# at 1.05x one engine's throughput (docs/performance.md), so the bar sits below that.
CLIENT_BOUND_CPU_SHARE = 0.75


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _summary(values: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    out = {"mean": statistics.fmean(ms) if ms else 0.0, "median": percentile(ms, 50),
           "std": statistics.pstdev(ms) if ms else 0.0}
    out.update({f"p{p:g}": percentile(ms, p) for p in percentiles})
    return out


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              client_cpu: list[float] | None = None) -> dict:
    """`client_cpu`: each client process's CPU seconds per wall second over the run."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "ttft_ms": _summary([r.ttft for r in ok], percentiles),
        "tpot_ms": _summary([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": _summary([gap for r in ok for gap in r.itl], percentiles),
        "e2el_ms": _summary([r.latency for r in ok], percentiles),
        "errors": dict(Counter(r.error or "unknown" for r in results if not r.success).most_common(10)),
        "client_cpu_share": client_cpu or [],
    }


_SECTIONS = [("ttft_ms", "Time to First Token", "TTFT"),
             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl_ms", "Inter-token Latency", "ITL"),
             ("e2el_ms", "End-to-end Latency", "E2EL")]


def format_report(summary: dict, percentiles: list[float]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for key, title, short in _SECTIONS:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        stats = summary[key]
        row(f"Mean {short} (ms):", stats["mean"])
        row(f"Median {short} (ms):", stats["median"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", stats[f"p{p:g}"])
    lines.append("=" * 50)
    for error, count in summary["errors"].items():
        lines.append(f"error ({count} request{'s' if count > 1 else ''}): {error}")
    cpu = summary["client_cpu_share"]
    if cpu:
        lines.append("client CPU, share of one core: " + ", ".join(f"{share:.0%}" for share in cpu))
        if max(cpu) >= CLIENT_BOUND_CPU_SHARE:
            lines.append(f"warning: a client was busy {max(cpu):.0%} of the time, so the load generator may have "
                         "been the bottleneck; run again with more --num-clients")
    return "\n".join(lines)


def save_result(path: str, summary: dict, config: dict, results: list[RequestResult]) -> None:
    data = {**config, **summary,
            "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results], "successes": [r.success for r in results]}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
