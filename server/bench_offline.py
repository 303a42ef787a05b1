"""`corectl bench throughput` and `corectl bench latency`: offline engine benchmarks (vLLM's shapes).

Prompts are random token ids (seed 0) and EOS is ignored, so every run does the same work.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from .engine_args import add_engine_args, config_from_args


def register_throughput(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: all prompts submitted at once")
    p.add_argument("--dataset", choices=["random"], default="random")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--min-len", type=int, default=None, help="with --max-len: lengths uniform in [min, max]")
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")
    add_engine_args(p)
    p.set_defaults(handler=run_throughput)


def register_latency(sub) -> None:
    p = sub.add_parser("latency", help="latency of one batch: per-step and end-to-end percentiles")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--save-result", default=None)
    add_engine_args(p)
    p.set_defaults(handler=run_latency)


def _lengths(rng: random.Random, args, n: int, base: int) -> list[int]:
    if args.min_len is not None and args.max_len is not None:
        return [rng.randint(args.min_len, args.max_len) for _ in range(n)]
    lo, hi = int(base * (1 - args.range_ratio)), int(base * (1 + args.range_ratio))
    return [rng.randint(max(1, lo), max(1, hi)) for _ in range(n)]


def _random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_throughput(args: argparse.Namespace) -> int:
    from corectl import SamplingParams

    llm = _make_llm(args)
    rng = random.Random(0)
    in_lens = _lengths(rng, args, args.num_prompts, args.input_len)
    out_lens = _lengths(rng, args, args.num_prompts, args.output_len)
    prompts = _random_prompts(rng, in_lens, min(llm.engine.info.vocab_size, llm.tokenizer.vocab_size))
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n, seed=None) for n in out_lens]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(in_lens)
    result = {
        "benchmark": "throughput", "num_prompts": len(prompts), "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed, "input_tokens": n_in, "output_tokens": n_out,
        "engine": _engine_summary(llm),
    }
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total tokens/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s")
    _save(args.save_result, result)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from corectl import SamplingParams

    llm = _make_llm(args)
    rng = random.Random(0)
    vocab = min(llm.engine.info.vocab_size, llm.tokenizer.vocab_size)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    e2e, steps, prefills = [], [], []
    for it in range(args.num_iters_warmup + args.num_iters):
        prompts = _random_prompts(rng, [args.input_len] * args.batch_size, vocab)
        times = _timed_steps(llm, prompts, params)
        if it >= args.num_iters_warmup:
            e2e.append(sum(times))
            prefills.append(times[0])
            steps.extend(times[1:])
    result = {
        "benchmark": "latency", "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "e2e_s": _percentiles(e2e), "prefill_step_s": _percentiles(prefills),
        "decode_step_s": _percentiles(steps), "engine": _engine_summary(llm),
    }
    print(f"Avg latency: {statistics.mean(e2e):.4f} s; decode step (TPOT) median "
          f"{result['decode_step_s']['p50'] * 1e3:.3f} ms, p99 {result['decode_step_s']['p99'] * 1e3:.3f} ms; "
          f"prefill step median {result['prefill_step_s']['p50'] * 1e3:.2f} ms")
    _save(args.save_result, result)
    return 0


def _timed_steps(llm, prompts, params) -> list[float]:
    """Run one batch to completion, timing each engine step (the first is the prefill)."""
    from corectl.engine.messages import EngineCoreRequest

    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"lat-{time.monotonic_ns()}-{i}", ids, params, time.monotonic()))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _make_llm(args):
    from corectl import LLM

    config = config_from_args(args)
    return LLM(**{f: getattr(config, f) for f in config.__struct_fields__})


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.mean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def _engine_summary(llm) -> dict:
    info = llm.engine.info
    return {"platform": info.platform, "device": info.device, "dtype": info.dtype, "architecture": info.architecture,
            "max_model_len": info.max_model_len, "kv_tokens": info.kv_capacity_tokens}


def _save(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
