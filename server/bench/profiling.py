"""`corectl bench latency --profile`: where one batch's time goes, host side and device side.

Runs one more batch after the timed ones under cProfile (Python functions by own time) and
torch.profiler (operators and kernels by device time when a GPU is in use, else by CPU time).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

ROWS = 25


def profile_batch(run_batch: Callable[[], object]) -> str:
    """Run `run_batch` twice, once per profiler, and return both reports as text."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    host.enable()
    run_batch()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(ROWS)
    activities = [ProfilerActivity.CPU]
    sort_by = "self_cpu_time_total"
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        sort_by = "self_cuda_time_total"
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run_batch()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by=sort_by, row_limit=ROWS)
    return (f"== Python functions by own time (cProfile)\n{text.getvalue()}\n== operators by {sort_by}\n{table}\n"
            f"Wall time of the profiled run: {wall * 1e3:.1f} ms (compare with the device time total above)")
