"""`corectl bench throughput` and `corectl bench latency`: offline engine benchmarks (vLLM's shapes).

Prompts are random token ids (seed 0) and EOS is ignored, so every run does the same work. Neither
needs a tokenizer: a shape preset (`--model llama3-8b --load-format dummy`) runs with no hub access.
Numbers are vLLM's: throughput in requests/s, output tokens/s and total tokens/s; latency as
end-to-end percentiles of one batch plus per-step ones (a decode step is one TPOT), timed by when
each step's tokens arrive.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import metadata

import msgspec

from ..cli.engine_args import add_engine_args, config_from_args
from .lora import add_lora_bench_args, bench_loras, lora_engine_options, round_robin
from .report import percentile
from .edit_text import acceptance, edit_text_prompts, format_acceptance

PERCENTILES = (10, 25, 50, 75, 90, 99)
# Distribution names to report, first one installed wins (ROCm wheels rename triton).
PACKAGES = {"corectl": ("corectl",), "torch": ("torch",), "triton": ("triton", "pytorch-triton-rocm"),
            "transformers": ("transformers",)}


def register_throughput(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: all prompts submitted at once")
    p.add_argument("--dataset", choices=["random", "edit-text"], default="random",
                   help="random token ids, or 'edit-text': passages the answer repeats with small edits (greedy, "
                   "EOS ends it; --output-len caps it), speculative decoding's case")
    p.add_argument("--spec-compare-base", action="store_true",
                   help="with --speculative-config: also time the workload without speculation (an engine of its "
                   "own, warmed up), in this run, over --passes passes that alternate which side goes first")
    p.add_argument("--passes", type=_at_least_one, default=3,
                   help="with --spec-compare-base: passes of both sides, each on prompts of its own (default 3)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--min-len", type=int, default=None, help="with --max-len: lengths uniform in [min, max]")
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")
    _add_profile_arg(p)
    add_lora_bench_args(p)
    add_engine_args(p)
    p.set_defaults(handler=run_throughput)


def register_latency(sub) -> None:
    p = sub.add_parser("latency", help="latency of one batch: per-step and end-to-end percentiles")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    _add_profile_arg(p)
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")
    add_lora_bench_args(p)
    add_engine_args(p)
    p.set_defaults(handler=run_latency)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_profile_arg(p) -> None:
    p.add_argument("--profile", action="store_true",
                   help="after timing, run the workload again under cProfile and torch.profiler and print both")


def _lengths(rng: random.Random, args, n: int, base: int) -> list[int]:
    if args.min_len is not None and args.max_len is not None:
        return [rng.randint(args.min_len, args.max_len) for _ in range(n)]
    lo, hi = int(base * (1 - args.range_ratio)), int(base * (1 + args.range_ratio))
    return [rng.randint(max(1, lo), max(1, hi)) for _ in range(n)]


def _random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _prompt_vocab(llm) -> int:
    """Ids every part of the engine knows: the model's rows, and the tokenizer's entries when there is one."""
    vocab = llm.engine.info.vocab_size
    return vocab if llm.tokenizer is None else min(vocab, llm.tokenizer.vocab_size)


def run_throughput(args: argparse.Namespace) -> int:
    from corectl import SamplingParams

    llm = _make_llm(args)
    rng = random.Random(0)
    in_lens = _lengths(rng, args, args.num_prompts, args.input_len)
    out_lens = _lengths(rng, args, args.num_prompts, args.output_len)
    if args.dataset == "edit-text":
        def prompts_for(seed: int) -> list[list[int]]:
            return edit_text_prompts(llm.get_tokenizer(), args.num_prompts, seed)

        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in out_lens]
    else:
        def prompts_for(seed: int) -> list[list[int]]:
            return _random_prompts(rng if seed == 0 else random.Random(seed), in_lens, _prompt_vocab(llm))

        params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n, seed=None) for n in out_lens]
    prompts, warmup = prompts_for(0), prompts_for(1)
    loras = round_robin(bench_loras(args, llm), len(prompts))
    # Warm-up: the same workload on other prompts (no prefix-cache hits for the timed run), so the
    # Triton kernels' first-use compilation for every shape this workload meets stays out of the timing.
    llm.generate(warmup, params, use_tqdm=False, lora_request=loras)
    stats_before = llm.engine.scheduler.make_stats()
    result = _timed_throughput(llm, prompts, params, loras)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
          f"{result['output_tokens_per_s']:.2f} output tokens/s")
    print(f"Total num prompt tokens: {result['input_tokens']}\nTotal num output tokens: {result['output_tokens']}")
    result["speculative"] = acceptance(stats_before, llm.engine.scheduler.make_stats())
    if result["speculative"] is not None:
        print(format_acceptance(result["speculative"]))
    if args.spec_compare_base and llm.config.speculative_config is not None:
        result["passes"] = _compare_without_speculation(args, llm, warmup, params, prompts_for)
    if loras and args.lora_compare_base:
        base = _timed_throughput(llm, _random_prompts(random.Random(3), in_lens, _prompt_vocab(llm)), params, None)
        result["base"] = base
        print(f"Base model (no adapter): {base['output_tokens_per_s']:.2f} output tokens/s; with adapters "
              f"{result['output_tokens_per_s'] / base['output_tokens_per_s']:.3f}x of it")
    _save(args, llm, result)
    if args.profile:
        from .profiling import profile_batch

        # Fresh prompts again: the timed ones sit in the prefix cache now.
        fresh = [_random_prompts(random.Random(2 + i), in_lens, _prompt_vocab(llm)) for i in range(2)]
        print(profile_batch(lambda: llm.generate(fresh.pop(), params, use_tqdm=False)))
    return 0


def _compare_without_speculation(args, llm, warmup, params, prompts_for) -> list[dict]:
    """`args.passes` passes of the workload on `llm` and on an engine like it without speculative
    decoding (warmed up like it), both sides on fresh prompts of the pass (seeds 2, 3, ...: no
    prefix-cache hits), the side going first alternating: a machine whose speed drifts favours
    neither side, and every pass is printed."""
    base = llm_from_config(config_from_args(args).replace(speculative_config=None))
    base.generate(warmup, params, use_tqdm=False)
    passes = []
    for i in range(args.passes):
        sides = [("speculative", llm), ("base", base)][::-1 if i % 2 else 1]
        prompts = prompts_for(2 + i)
        rates = {name: _timed_throughput(engine, prompts, params, None)["output_tokens_per_s"] for name, engine in sides}
        ratio = rates["speculative"] / rates["base"]
        passes.append({**rates, "first": sides[0][0], "ratio": ratio})
        print(f"Pass {i + 1} ({sides[0][0]} first): {rates['speculative']:.2f} output tokens/s with speculation, "
              f"{rates['base']:.2f} without: {ratio:.3f}x")
    ratios = [p["ratio"] for p in passes]
    print(f"With speculation against without, {len(ratios)} passes: median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x)")
    return passes


def _timed_throughput(llm, prompts, params, loras) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(p) for p in prompts)
    return {
        "benchmark": "throughput", "num_prompts": len(prompts), "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed, "input_tokens": n_in, "output_tokens": n_out,
    }


def run_latency(args: argparse.Namespace) -> int:
    from corectl import SamplingParams

    llm = _make_llm(args)
    rng = random.Random(0)
    vocab = _prompt_vocab(llm)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    loras = round_robin(bench_loras(args, llm), args.batch_size)
    e2e, steps, prefills = [], [], []
    for it in range(args.num_iters_warmup + args.num_iters):
        prompts = _random_prompts(rng, [args.input_len] * args.batch_size, vocab)
        times = _token_intervals(llm, prompts, params, loras)
        if it >= args.num_iters_warmup:
            e2e.append(sum(times))
            prefills.append(times[0])
            steps.extend(times[1:])
    result = {
        "benchmark": "latency", "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "latencies_s": e2e, "e2e_s": _percentiles(e2e),
        "prefill_step_s": _percentiles(prefills), "decode_step_s": _percentiles(steps),
        "num_decode_steps": len(steps),
    }
    print(f"Avg latency: {statistics.mean(e2e):.6f} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {result['e2e_s'][f'p{p}']:.6f} seconds")
    tpot = result["decode_step_s"]
    print(f"TPOT (decode step): mean {tpot['mean'] * 1e3:.3f} ms, median {tpot['p50'] * 1e3:.3f} ms, "
          f"p99 {tpot['p99'] * 1e3:.3f} ms; prefill step median {result['prefill_step_s']['p50'] * 1e3:.2f} ms")
    if loras and args.lora_compare_base:
        base = [t for _ in range(args.num_iters) for t in _token_intervals(
            llm, _random_prompts(rng, [args.input_len] * args.batch_size, vocab), params, None)[1:]]
        result["base_decode_step_s"] = _percentiles(base)
        print(f"Base model TPOT: median {result['base_decode_step_s']['p50'] * 1e3:.3f} ms; with adapters "
              f"{tpot['p50'] / result['base_decode_step_s']['p50']:.3f}x of it")
    _save(args, llm, result)
    if args.profile:
        from .profiling import profile_batch

        prompts = _random_prompts(rng, [args.input_len] * args.batch_size, vocab)
        print(profile_batch(lambda: _token_intervals(llm, prompts, params, loras)))
    return 0


def _token_intervals(llm, prompts, params, loras=None) -> list[float]:
    """Run one batch to completion; returns the time to the step that produced the first tokens
    (the prefill), then the time between each step producing tokens and the next (one TPOT each).

    Timing the arrival of tokens rather than `step()` calls keeps the numbers true with async
    scheduling, where a call launches one step and returns the tokens of the one before.
    """
    from corectl.engine.messages import EngineCoreRequest

    engine = llm.engine
    engine.add_requests([EngineCoreRequest(f"lat-{time.monotonic_ns()}-{i}", ids, params, time.monotonic(),
                                           lora_request=None if loras is None else loras[i])
                         for i, ids in enumerate(prompts)])
    times, last = [], time.perf_counter()
    while engine.has_unfinished_requests():
        if engine.step().outputs:
            now = time.perf_counter()
            times.append(now - last)
            last = now
    return times


def _make_llm(args):
    return llm_from_config(config_from_args(args).replace(**lora_engine_options(args)))


def llm_from_config(config):
    from corectl import LLM

    return LLM(**{f: getattr(config, f) for f in config.__struct_fields__})


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    return {"mean": statistics.mean(values), **{f"p{p}": percentile(values, p) for p in PERCENTILES}}


def _save(args: argparse.Namespace, llm, result: dict) -> None:
    """Write the result with everything needed to reproduce it: the workload, the engine config as
    run, the device and the package versions."""
    if not args.save_result:
        return
    skip = {"handler", "command", "bench_command", "save_result"}
    record = {
        **result,
        "workload": {k: v for k, v in vars(args).items() if k not in skip and not hasattr(llm.config, k)},
        "config": msgspec.to_builtins(llm.config),
        "engine": _engine_summary(llm),
        "versions": _versions(),
    }
    with open(args.save_result, "w") as f:
        json.dump(record, f, indent=2)


def _engine_summary(llm) -> dict:
    info = llm.engine.info
    return {"model": info.model, "architecture": info.architecture, "platform": info.platform,
            "device": info.device, "dtype": info.dtype, "max_model_len": info.max_model_len,
            "kv_tokens": info.kv_capacity_tokens, "tokenizer": info.tokenizer_dir is not None}


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name, distributions in PACKAGES.items():
        found[name] = None
        for dist in distributions:
            try:
                found[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return found
