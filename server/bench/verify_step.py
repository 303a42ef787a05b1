"""`corectl bench verify-step` (W11): the cost of a speculative verify step against a plain decode step.

It drives the engine's own model runner with synthetic steps (the runner path of every real step:
inputs, forward pass, logits, sampling or rejection sampling, the host read), for B requests at a
given context: plain decode steps (one new token each) and verify steps (one token plus k random
drafts each, so nearly every draft is rejected and the next step's shape stays the same),
alternating, timing each; the ratio of the medians is W11's figure. The engine runs with an n-gram
speculative config of k tokens unless `--speculative-config` names another, so what it builds for
speculation (CUDA graph buckets of k + 1 rows a request) is in place; CORECTL_GRAPH_VERIFY=0 times
eager verify steps.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from ..cli.engine_args import add_engine_args, config_from_args
from .offline import llm_from_config
from .report import percentile


def register(sub) -> None:
    p = sub.add_parser("verify-step", help="W11: a speculative verify step (k drafts a request) vs a decode step")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--context-len", type=int, default=512, help="tokens each request holds before the timed steps")
    p.add_argument("--num-steps", type=int, default=20, help="timed steps of each kind per batch size")
    p.add_argument("--num-warmup-steps", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="after timing each batch size, profile 5 decode steps, then 5 verify steps (cProfile and "
                        "torch.profiler, bench/profiling.py) and print both reports")
    p.add_argument("--engine-steps", type=int, default=0,
                   help="then, per batch size, time this many steps of the running engine with n-gram speculation "
                        "(requests held to two tokens, so that lookup drafts every step) and print host time per "
                        "step against device time per step (bench/spec_host.py)")
    p.add_argument("--gemm-rows", default="",
                   help="comma-separated row counts: time the model's GEMMs (first layer's projections, LM head) "
                        "at each by cuBLAS and cuBLASLt, and its element-wise kernels (bench/gemm_rows.py; CUDA)")
    add_engine_args(p)
    p.set_defaults(handler=run_verify_step)


def run_verify_step(args: argparse.Namespace) -> int:
    if args.speculative_config is None:
        # The engine is built for k drafts a request (its decode graphs then reach the verify steps'
        # rows); n-gram, as the synthetic steps bring their own drafts.
        args.speculative_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    llm = llm_from_config(config_from_args(args))
    runner = llm.engine.executor.worker.runner
    vocab = llm.engine.info.vocab_size
    block_size = llm.engine.info.block_size
    batches = [int(b) for b in args.batch_sizes.split(",")]
    for batch in batches:
        # A profile adds 10 steps of each kind (5 under each profiler), which need their blocks too.
        num_pairs = args.num_warmup_steps + args.num_steps + (10 if args.profile else 0)
        steps = _SyntheticSteps(runner, batch, args.context_len, block_size, vocab, args.num_speculative_tokens,
                                num_pairs)
        timings = steps.run(args.num_warmup_steps, args.num_steps)
        decode, verify = (statistics.median(timings[kind]) for kind in ("decode", "verify"))
        print(f"batch {batch}: decode step median {decode * 1e3:.3f} ms (p90 {percentile(timings['decode'], 90) * 1e3:.3f}), "
              f"verify step (k={args.num_speculative_tokens}) median {verify * 1e3:.3f} ms "
              f"(p90 {percentile(timings['verify'], 90) * 1e3:.3f}): {verify / decode:.3f}x")
        launches = [statistics.median(timings[f"{kind} launch"]) * 1e3 for kind in ("decode", "verify")]
        print(f"batch {batch} host: the runner's launch median decode {launches[0]:.3f} ms, verify {launches[1]:.3f} ms "
              "(the rest of a step waits for the device)")
        if args.profile:
            from .profiling import profile_batch

            for kind, drafts in (("decode", 0), ("verify", args.num_speculative_tokens)):
                print(f"== batch {batch}: 5 {kind} steps\n" + profile_batch(lambda: [steps.step(drafts) for _ in range(5)]))
        steps.finish()
    if args.engine_steps:
        from .spec_host import HEADER, measure_engine_steps

        print(f"== the engine with speculation {args.speculative_config}, {args.engine_steps} steps a window\n"
              + HEADER)
        windows = {batch: measure_engine_steps(llm, batch, args.context_len, args.engine_steps) for batch in batches}
        print("\n".join(w.row(batch) for batch, w in windows.items()))
        print("\n".join(w.parts_line(batch) for batch, w in windows.items()))
    if args.gemm_rows:
        from .gemm_rows import elementwise_rows_report, gemm_rows_report

        rows = [int(m) for m in args.gemm_rows.split(",")]
        print("== GEMMs by rows\n" + gemm_rows_report(runner.model, rows))
        print("== element-wise kernels by rows\n" + elementwise_rows_report(runner.model, rows))
    return 0


class _SyntheticSteps:
    """A batch of requests driven straight through a model runner; it plays the scheduler's part
    (block ids, computed counts, finishing), block ids from the start of the KV cache."""

    def __init__(self, runner, batch: int, context_len: int, block_size: int, vocab: int, k: int, num_pairs: int):
        from corectl.sampling_params import SamplingParams
        from corectl.step_messages import CachedRequestData, NewRequestData, SchedulerOutput

        self.runner, self.k, self.vocab = runner, k, vocab
        self._messages = (CachedRequestData, SchedulerOutput)
        self.rng = random.Random(0)
        self.ids = [f"verify-step-{i}" for i in range(batch)]
        # A decode and a verify step add at most 1 + (k + 1) tokens a request.
        per_request = -(-(context_len + num_pairs * (k + 2)) // block_size)
        new = [NewRequestData(req_id=req_id, token_ids=[self.rng.randrange(vocab) for _ in range(context_len)],
                              num_prompt_tokens=context_len, sampling_params=SamplingParams(temperature=0.0),
                              block_ids=list(range(1 + i * per_request, 1 + (i + 1) * per_request)),
                              num_computed_tokens=0) for i, req_id in enumerate(self.ids)]
        out = runner.execute_model(SchedulerOutput(new, CachedRequestData(), {r: context_len for r in self.ids},
                                                   context_len * batch, []))
        self.computed = {r: context_len for r in out.req_ids}

    def step(self, drafts: int) -> tuple[float, float]:
        """(the step's seconds, of them the host's in the runner's launch: inputs, graph replay,
        logits and sampling queued; the rest waits for the device)."""
        CachedRequestData, SchedulerOutput = self._messages
        cached = CachedRequestData(req_ids=list(self.ids), new_block_ids=[[] for _ in self.ids],
                                   num_computed_tokens=[self.computed[r] for r in self.ids])
        spec = {r: [self.rng.randrange(self.vocab) for _ in range(drafts)] for r in self.ids} if drafts else {}
        sched = SchedulerOutput([], cached, {r: 1 + drafts for r in self.ids}, len(self.ids) * (1 + drafts), [],
                                spec_token_ids=spec)
        start = time.perf_counter()
        pending = self.runner.launch(sched)
        launched = time.perf_counter()
        out = pending.result()
        elapsed = time.perf_counter() - start
        for req_id, rows in zip(out.req_ids, out.token_rows()):
            self.computed[req_id] += len(rows)
        return elapsed, launched - start

    def run(self, warmup: int, steps: int) -> dict[str, list[float]]:
        """Seconds of each timed step ("decode", "verify") and of its launch ("decode launch", "verify launch")."""
        timings: dict[str, list[float]] = {"decode": [], "verify": [], "decode launch": [], "verify launch": []}
        for i in range(warmup + steps):
            decode, verify = self.step(0), self.step(self.k)
            if i >= warmup:
                for kind, (elapsed, launch) in (("decode", decode), ("verify", verify)):
                    timings[kind].append(elapsed)
                    timings[f"{kind} launch"].append(launch)
        return timings

    def finish(self) -> None:
        CachedRequestData, SchedulerOutput = self._messages
        self.runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, list(self.ids)))
