"""W11's second requirement: does a running engine with speculation keep the device busy, its host
work per step (scheduler, proposer, verify bookkeeping, the sampler's host side, output handling)
under the device's time per step?

The engine runs B greedy requests through `EngineCore.step()` as `LLM.generate` drives it. Each
request's output is held to two tokens of its own by `logit_bias` (+100 each; dummy weights' logits
are a few units) and its prompt is a random string of those two: n-gram lookup then finds drafts in
nearly every step (a 5-gram of a two-token string recurs), and the model's choice between the two
decides how many are accepted. The bias is sampler work a plain greedy request does not have (its
metadata built each step on the host, a scatter on the device): host time is, if anything, over.
After the prefill and a few steps, three windows of steps follow: one timed plainly (wall time per
step), one under torch.profiler, which gives the device's busy time (the union of its kernels' and copies'
intervals) and the time the host thread spent blocked in CUDA synchronisation calls (host time per
step is the profiled wall time less that blocked time: an upper bound, the profiler's own cost per
operator is in it), and one under cProfile, which splits the host's step into its parts (scheduler
with the n-gram proposer, the runner's launch with the verify sampling, the result read, the
scheduler's update). The device's idle time per step is what bubbles cost.
"""
from __future__ import annotations

import cProfile
import pstats
import random
import time
from dataclasses import dataclass, field

# CUDA runtime calls in which the host thread waits for the device.
_SYNC_CALLS = frozenset({"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"})
_WARMUP_STEPS = 6
# The engine step's parts, by (the end of the file's path, function): cumulative time in a step.
_PARTS = {
    "scheduler.schedule": ("scheduler/scheduler.py", "schedule"),
    "  of it n-gram drafts": ("spec_decode/scheduling.py", "drafts"),
    "runner launch": ("worker/model_runner.py", "launch"),
    "  of it verify sampling": ("worker/model_runner.py", "_verify"),
    "result read (waits for the device)": ("worker/inflight.py", "result"),
    "scheduler.update": ("scheduler/scheduler.py", "update"),
}


@dataclass(frozen=True)
class StepWindow:
    """One window of engine steps: seconds per step, and the speculation counters over it."""

    steps: int
    wall: float
    profiled_wall: float
    device_busy: float
    host_blocked: float
    drafts: int
    draft_tokens: int
    accepted: int
    # Host milliseconds a step in each of `_PARTS`, under cProfile (whose cost per call is in them).
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def host_busy(self) -> float:
        return self.profiled_wall - self.host_blocked

    def row(self, batch: int) -> str:
        ms = 1e3 / self.steps
        mean_len = 1 + self.accepted / self.drafts if self.drafts else 1.0
        return (f"| {batch} | {self.steps} | {self.drafts / self.steps:.1f} | {mean_len:.2f} | {self.wall * ms:.3f} "
                f"| {self.device_busy * ms:.3f} | {self.host_busy * ms:.3f} | {max(0.0, self.wall - self.device_busy) * ms:.3f} "
                f"| {'yes' if self.host_busy < self.device_busy else 'no'} |")

    def parts_line(self, batch: int) -> str:
        return f"batch {batch} host ms/step (cProfile): " + ", ".join(f"{k.strip()} {v:.3f}" for k, v in self.parts.items())


HEADER = ("| batch | steps | requests drafting a step | mean accepted length | wall ms/step | device busy ms/step "
          "| host busy ms/step (profiled) | device idle ms/step | host < device |\n|---|---|---|---|---|---|---|---|---|")


def measure_engine_steps(llm, batch: int, context_len: int, num_steps: int, seed: int = 0) -> StepWindow:
    """Run `batch` requests in `llm`'s engine and time three windows of `num_steps` steps (plain,
    torch.profiler, cProfile); the requests are aborted after."""
    from corectl.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    # Enough tokens for every step to emit k + 1 of them and still not finish inside the windows,
    # where the model's length allows.
    max_tokens = min((_WARMUP_STEPS + 3 * num_steps) * 17 + 64, engine.max_model_len - context_len)
    processor = llm._processor()
    ids = [f"spec-host-{batch}-{i}" for i in range(batch)]
    requests = []
    for rid in ids:
        pair = rng.sample(range(engine.info.vocab_size), 2)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                                logit_bias={token: 100.0 for token in pair})
        requests += processor.add_request(rid, None, [rng.choice(pair) for _ in range(context_len)], params)
    engine.add_requests(requests)
    try:
        for _ in range(_WARMUP_STEPS + -(-batch * context_len // engine.config.max_num_batched_tokens)):
            engine.step()
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
        before = engine.scheduler.make_stats()
        profiled_wall, device_busy, blocked = _profiled(engine, num_steps)
        after = engine.scheduler.make_stats()
        parts = _host_parts(engine, num_steps)
    finally:
        engine.abort_requests(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return StepWindow(num_steps, wall, profiled_wall, device_busy, blocked,
                      after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                      after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                      after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens, parts)


def _host_parts(engine, num_steps: int) -> dict[str, float]:
    """Milliseconds a step in each part of the engine step (`_PARTS`), over `num_steps` steps under cProfile."""
    host = cProfile.Profile()
    host.enable()
    for _ in range(num_steps):
        engine.step()
    host.disable()
    cumulative = {(file.replace("\\", "/"), name): stat[3] for (file, _, name), stat in pstats.Stats(host).stats.items()}
    return {part: 1e3 / num_steps * sum(t for (file, name), t in cumulative.items() if name == fn and file.endswith(suffix))
            for part, (suffix, fn) in _PARTS.items()}


def _profiled(engine, num_steps: int) -> tuple[float, float, float]:
    """(wall, device busy, host blocked in CUDA synchronisation), seconds, over `num_steps` steps under
    torch.profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
    events = prof.events()
    device = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    blocked = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CPU and e.name in _SYNC_CALLS)
    return wall, union_length(device) * 1e-6, blocked * 1e-6


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (a device's busy time: its streams overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
