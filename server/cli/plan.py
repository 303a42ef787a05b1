"""`corectl plan MODEL`: will it fit, and how much KV cache is left, before anything loads.

Exit status: 0 when the plan fits, 1 when it does not (the flags that would make it fit are
printed), 2 when the model or an option is wrong.
"""
from __future__ import annotations

import argparse
import json
import re

from .serve import SERVE_DEFAULTS
from .engine_args import add_engine_args, config_from_args

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_GIB, _MIB = 1 << 30, 1 << 20


def register(sub) -> None:
    parser = sub.add_parser(
        "plan", help="size a deployment from the model's config alone: weights, KV cache, what fits",
        description="Size a deployment before loading anything: weight, KV-cache and activation memory, "
                    "the KV capacity in tokens and the concurrency at max_model_len on a device, and the "
                    "flag that would make it fit. Engine flags are read as `corectl serve` reads them, with its "
                    "defaults; quantized weights (--quantization, a checkpoint's quantization_config, GGUF "
                    "files) are sized as the target platform serves them; "
                    "with -tp N, weights and KV heads are per rank; with -pp N, the plan is the stage "
                    "with the fewest KV blocks (every stage allocates that many), or one that does not fit.")
    group = parser.add_argument_group("plan")
    group.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                       help="what to size for: this machine's CPU, a GPU (this machine's, or one of "
                            "--device-memory), or auto: a GPU when --device-memory is given, else the "
                            "platform the engine would pick here (default: auto)")
    group.add_argument("--device-memory", type=parse_size, default=None, metavar="SIZE",
                       help="memory of one device, e.g. 80GiB or 141GB (default: this machine's)")
    group.add_argument("--device-capability", type=parse_capability, default=None, metavar="MAJOR.MINOR",
                       help="plan for a GPU of this compute capability instead of this machine's, e.g. 9.0 "
                            "for an H100 (its dtype and quantization kernels: FP8 from 8.9); needs "
                            "--device-memory (default for a GPU this machine lacks: 8.0)")
    group.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_engine_args(parser, model_positional=True, defaults=SERVE_DEFAULTS)
    parser.set_defaults(handler=run)


def parse_size(text: str) -> int:
    """'80GiB' -> bytes; binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size with a unit, e.g. 80GiB or 141GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_capability(text: str) -> tuple[int, int]:
    """'9.0' -> (9, 0)."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability MAJOR.MINOR, e.g. 9.0")
    return int(match.group(1)), int(match.group(2))


def run(args: argparse.Namespace) -> int:
    from corectl.planning import plan_deployment

    config = config_from_args(args)
    plan = plan_deployment(config, device=args.device, device_memory=args.device_memory,
                           device_capability=args.device_capability)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0 if plan.fits else 1


def render(plan) -> str:
    """The plan as a two-column table."""
    per_rank = _per_rank(plan)
    stored = ", ".join(f"{kind} {_bytes(n)}" for kind, n in sorted(plan.stored_bytes.items(), key=lambda kv: -kv[1]))
    kv = (f"{plan.kv_bytes_per_token:,} bytes per token{per_rank} ({plan.num_kv_heads_per_rank} KV heads), "
          f"blocks of {plan.block_size} tokens")
    if plan.profiles_memory:
        budget = (f"{plan.usable_bytes / plan.device_memory_bytes:.2f} of it usable (--gpu-memory-utilization), "
                  f"{_bytes(plan.non_torch_bytes)} outside torch (assumed)")
    else:
        budget = f"KV cache {_bytes(plan.kv_cache_bytes)} (--kv-cache-memory)"
    rows = [
        ("model", f"{plan.model} ({plan.architecture}, {plan.num_params / 1e9:.3g}B parameters)"),
        ("checkpoint", stored or "config only"),
        ("weights", _weights(plan, per_rank)),
        ("KV cache", kv),
        *([("draft", _draft(plan, per_rank))] if plan.draft_model else []),
        ("activations", f"~{_bytes(plan.activation_bytes)} peak for {plan.max_num_batched_tokens} tokens per step"),
        ("device", f"{plan.device} {_bytes(plan.device_memory_bytes)}; {budget}"),
        ("KV capacity", f"{plan.kv_tokens:,} tokens ({max(plan.num_kv_blocks, 0):,} blocks)"),
        ("concurrency", f"{plan.max_concurrency:.2f} sequences of max_model_len {plan.max_model_len}"),
        ("fits", "yes" if plan.fits else f"no: {plan.problem}"),
    ]
    if plan.remedies:
        rows.append(("to fit", "  or  ".join(plan.remedies)))
    return "\n".join(f"{name:<13} {value}" for name, value in rows)


def _per_rank(plan) -> str:
    """Which rank the per-rank figures describe: its tensor-parallel share, its pipeline stage."""
    parts = []
    if plan.tensor_parallel_size > 1:
        parts.append(f"-tp {plan.tensor_parallel_size}")
    if plan.pipeline_parallel_size > 1:
        first, count = plan.stage_layers
        parts.append(f"-pp {plan.pipeline_parallel_size} (stage {plan.pipeline_stage}, layers {first}-{first + count - 1})")
    return f" per rank at {' '.join(parts)}" if parts else ""


def _weights(plan, per_rank: str) -> str:
    served = f"{plan.quantization}, dtype {plan.dtype}" if plan.quantization else plan.dtype
    text = f"{served} {_bytes(plan.weight_bytes)}"
    if per_rank:
        text += f", {_bytes(plan.weight_bytes_per_rank)}{per_rank}"
    if plan.loading_weight_bytes_per_rank != plan.weight_bytes_per_rank:
        text += f"; {_bytes(plan.loading_weight_bytes_per_rank)} while loading{per_rank}, before repacking"
    return text


def _draft(plan, per_rank: str) -> str:
    return (f"{plan.draft_model}: {_bytes(plan.draft_weight_bytes_per_rank)}{per_rank}, "
            f"{plan.draft_kv_bytes_per_token:,} bytes per token of its own KV cache (a block with each of the target's)")


def _bytes(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / _MIB:.1f} MiB"
