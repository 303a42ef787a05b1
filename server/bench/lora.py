"""LoRA options of the offline benchmarks: which adapters the prompts use (round-robin), and the
base model's figure beside the adapters' when asked (the same engine, so the same call and device)."""
from __future__ import annotations

import argparse
import tempfile

from corectl.errors import ConfigError


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("LoRA workload")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters the prompts use, round-robin (implies --enable-lora)")
    group.add_argument("--num-loras", type=int, default=0,
                       help="random adapters written for the model's shape, all seven projections of every "
                            "layer, used round-robin (implies --enable-lora)")
    group.add_argument("--lora-rank", type=int, default=16, help="rank of the --num-loras adapters (default: 16)")
    group.add_argument("--lora-compare-base", action="store_true",
                       help="also time the same workload on the base model (no adapter) and report the ratio")


def lora_engine_options(args: argparse.Namespace) -> dict:
    """Engine options the LoRA workload needs on top of the flags given."""
    count = len(args.lora_modules) or args.num_loras
    if not count:
        return {}
    if args.num_loras and args.lora_modules:
        raise ConfigError("num_loras", "give --lora-modules or --num-loras, not both")
    return {"enable_lora": True, "max_loras": max(args.max_loras, min(count, args.max_num_seqs)),
            "max_lora_rank": max(args.max_lora_rank, args.lora_rank if args.num_loras else 0)}


def bench_loras(args: argparse.Namespace, llm) -> list:
    """The workload's adapters (an empty list without a LoRA workload)."""
    from corectl.lora.request import LoRARequest

    if args.lora_modules:
        from ..http.lora import LoRAModule

        modules = [LoRAModule.parse(text) for text in args.lora_modules]
        return [LoRARequest(m.name, i + 1, m.path) for i, m in enumerate(modules)]
    if not args.num_loras:
        return []
    from corectl.lora.dummy import write_dummy_adapters

    folder = tempfile.mkdtemp(prefix="corectl-bench-loras-")
    return write_dummy_adapters(folder, llm.engine.source.hf_config, args.num_loras, args.lora_rank)


def round_robin(loras: list, count: int) -> list | None:
    return [loras[i % len(loras)] for i in range(count)] if loras else None
