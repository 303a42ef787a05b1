"""`corectl bench grammar`: what grammar-constrained decoding adds to one engine step, on this host.

A batch of requests under one JSON schema walks through a valid JSON answer token by token, as the
engine drives them: each step fills every row's next-token bitmask (the backend's `fill_bitmasks`,
on each `--fill-threads` count), then
applies it to a `[batch, vocab]` float32 logits tensor on the CPU (the worker's
`apply_grammar_bitmask`), then advances each matcher by the row's token (`accept`). The three are
timed apart per step and reported as per-step medians for each batch size; the engine's other work
(forward, sampling) is not included, so the numbers are the overhead a constrained batch adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 60},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines", "poetry"],
          "address": {"city": "London", "zip": "W1"}}


def register(sub) -> None:
    p = sub.add_parser("grammar", help="per-step CPU cost of grammar-constrained decoding (bitmask fill, apply, "
                                       "accept) at several batch sizes")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    p.add_argument("--repeats", type=int, default=5, help="walks through the answer per batch size (default: 5)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for applying the masks (default: torch's, one per core)")
    p.add_argument("--fill-threads", default=None,
                   help="comma-separated thread counts that fill a step's rows together, each measured "
                        "(default: the engine's, one)")
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import platform

    import torch
    from corectl.sampling_params import StructuredOutputsParams
    from corectl.structured.xgrammar_backend import XGrammarBackend, default_fill_threads
    from corectl.tokenizer import Tokenizer

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    folder = args.tokenizer or _default_tokenizer_dir()
    tokenizer = Tokenizer.from_dir(folder)
    answer = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False) + [tokenizer.eos_token_id]
    threads = [int(t) for t in args.fill_threads.split(",")] if args.fill_threads else [default_fill_threads()]
    result = {"benchmark": "grammar", "cpu": _cpu_name() or platform.processor(), "vocab_size": tokenizer.vocab_size,
              "torch_threads": torch.get_num_threads(), "answer_tokens": len(answer), "per_step_ms": {}}
    for fill_threads in threads:
        backend = XGrammarBackend(folder, tokenizer.vocab_size, [tokenizer.eos_token_id], fill_threads=fill_threads)
        grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            times = _measure(backend, grammar, answer, batch, args.repeats, tokenizer.vocab_size)
            result["per_step_ms"][f"{batch}/{fill_threads}"] = times
    print(f"CPU: {result['cpu']}, {result['torch_threads']} torch threads; vocab {result['vocab_size']}; "
          f"{len(answer)} steps per answer")
    for key, times in result["per_step_ms"].items():
        batch, fill_threads = key.split("/")
        print(f"batch {batch:>3}, {fill_threads} fill threads: fill {times['fill']:.3f} ms, apply {times['apply']:.3f} ms, "
              f"accept {times['accept']:.3f} ms, total {times['total']:.3f} ms per step")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _measure(backend, grammar, answer: list[int], batch: int, repeats: int, vocab: int) -> dict[str, float]:
    import numpy as np
    import torch
    from corectl.sample.grammar import apply_grammar_bitmask
    from corectl.structured.backend import bitmask_width

    steps: dict[str, list[float]] = {"fill": [], "apply": [], "accept": [], "total": []}
    logits = torch.zeros(batch, vocab)
    for _ in range(repeats):
        matchers = [backend.new_matcher(grammar) for _ in range(batch)]
        for token in answer:
            t0 = time.perf_counter()
            bitmask = np.empty((batch, bitmask_width(vocab)), dtype=np.int32)
            backend.fill_bitmasks(matchers, bitmask, list(range(batch)))
            t1 = time.perf_counter()
            apply_grammar_bitmask(logits, torch.from_numpy(bitmask), None)
            t2 = time.perf_counter()
            if not all(matcher.accept_token(token) for matcher in matchers):
                raise RuntimeError(f"the grammar refused token {token} of the answer")
            t3 = time.perf_counter()
            for key, seconds in (("fill", t1 - t0), ("apply", t2 - t1), ("accept", t3 - t2), ("total", t3 - t0)):
                steps[key].append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in steps.items()}


def _default_tokenizer_dir() -> str:
    from corectl.config import EngineConfig
    from corectl.loaders import resolve_model_source

    return str(resolve_model_source(EngineConfig()).tokenizer_dir)


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None
