"""Sizing a deployment from a model's config alone, before anything loads (`corectl plan`).

The model is built on torch's meta device (shapes, no memory, no weights) with the quantization
method the target platform binds (`corectl.planning_weights`), so the tensors counted are exactly
those the engine would load, each quantized layer sized as its method serves it, and `ModelInfo`
gives the engine's own KV bytes per block. The KV cache is sized with the workers' rules
(`corectl.kv.sizing`): a budget in GiB on platforms that do not profile memory (CPU), what is left
of `gpu_memory_utilization` of the device on those that do, less a vision-language model's encoder
cache (`corectl.multimodal.profile`). Two numbers a plan can only estimate, where the engine
measures them: the activation peak of a full token budget, and the memory a GPU process holds
outside torch; a vision-language model's tower activations, which the engine's profile also
measures, are not estimated.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .config import EngineConfig
from .discovery import host_platform, planned_platform, resolve_platform
from .distributed import get_pp, viewed_as_stage
from .engine.core import resolve_max_model_len
from .errors import ConfigError, ModelNotFoundError
from .kv.sizing import (
    DEFAULT_KV_CACHE_BYTES,
    blocks_per_sequence,
    fixed_kv_blocks,
    profile_num_seqs,
    profiled_kv_blocks,
)
from .loaders.checkpoint_files import safetensors_files
from .loaders.hf_config import checkpoint_dtype
from .loaders.presets import PRESETS, is_preset
from .loaders.resolve import default_model, resolve_model_source
from .loaders.source import ModelSource
from .models.base import check_tensor_parallel
from .models.pipeline import check_pipeline_parallel, layer_partition, resolve_layer_partition
from .models.registry import resolve_model_class
from .multimodal.profile import encoder_cache_bytes, serves_images
from .planning_drafts import DraftShape, draft_shape
from .planning_weights import ModelWeights, planned_model, rank_share, size_weights
from .platform import resolve_dtype
from .pooling import pooling_architectures
from .quantization.base import QuantizationConfig
from .quantization.selection import select_quantization
from .worker.worker import _DTYPES, ModelInfo, _model_info

GIB = 1 << 30
DEVICES = ("auto", "cpu", "gpu")
# What a GPU process holds outside torch's allocator (driver context, kernel images, library
# handles): the CUDA worker measures it, a plan assumes it. With it, the plan's memory besides the
# KV cache came within 0.1 GiB of what the worker measured for qwen3-0.6b on an H100 (torch 2.11).
NON_TORCH_BYTES = 512 << 20
# Tensor-parallel sizes tried when suggesting one.
TP_SIZES = (2, 4, 8)
# The compute capability of a GPU planned for without --device-capability: the oldest that runs
# bf16 (Ampere; MI200 on ROCm), so 'auto' takes bf16 there; it has no FP8 kernel.
DEFAULT_GPU_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Checkpoint:
    """A model's config and what its files hold, read without loading any weight.

    stored_bytes: bytes of the checkpoint's tensors by storage type (safetensors dtypes such as
    BF16, or GGUF quantizations such as Q4_1); empty for shape presets and hub ids (config only).
    source: what quantization methods read to choose their config (for a GGUF file, its header
    only: `model_dir` is the file's folder, nothing is converted).
    """

    name: str
    hf_config: Any
    model_dtype: str | None
    stored_bytes: dict[str, int]
    source: ModelSource


@dataclass(frozen=True)
class Target:
    """The device a plan is for. The KV cache gets the explicit budget where one is given
    (`EngineConfig.kv_cache_budget_bytes`), everything fitting in `memory_bytes`; otherwise, with
    `profiles_memory` (GPUs), what is left of `memory_bytes * gpu_memory_utilization`, and on a CPU
    the default budget. Quantization binds to `quantization_kernels`, those of
    `platform`'s device (`PlatformCaps`)."""

    name: str
    profiles_memory: bool
    memory_bytes: int
    dtype: str
    platform: str
    quantization_kernels: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """How a model fits a device, per tensor-parallel rank; `remedies` are flags that would make
    a plan that does not fit fit. `quantization` is the bound method (`QuantizationConfig.describe`),
    None for dense weights; `weight_bytes` are as served, `loading_weight_bytes_per_rank` what a
    rank holds while the checkpoint loads, before quantized layers are repacked."""

    model: str
    architecture: str
    dtype: str
    stored_bytes: dict[str, int]
    num_params: int
    weight_bytes: int
    tensor_parallel_size: int
    weight_bytes_per_rank: int
    loading_weight_bytes_per_rank: int
    buffer_bytes: int
    num_kv_heads_per_rank: int
    kv_bytes_per_token: int
    block_size: int
    max_num_batched_tokens: int
    activation_bytes: int
    device: str
    profiles_memory: bool
    device_memory_bytes: int
    usable_bytes: int
    non_torch_bytes: int
    num_kv_blocks: int
    min_kv_blocks: int
    max_model_len: int
    problem: str | None
    remedies: list[str] = field(default_factory=list)
    quantization: str | None = None
    # The window every layer keeps to, if one does: a sequence then holds only its window's blocks.
    sliding_window: int | None = None
    # A vision-language model's encoder cache, reserved outside the KV cache where memory is profiled.
    encoder_cache_bytes: int = 0
    # Under pipeline parallelism the plan is one stage's (`_plan_stages` says which): its first layer
    # and layer count; the model's totals (`num_params`, `weight_bytes`) stay the whole model's.
    pipeline_parallel_size: int = 1
    pipeline_stage: int = 0
    stage_layers: tuple[int, int] | None = None
    # A speculative draft model or EAGLE head this rank holds (`corectl.planning_drafts`): its weights,
    # and its cache's bytes a token, a block of which comes with each of the target's.
    draft_model: str | None = None
    draft_weight_bytes_per_rank: int = 0
    draft_kv_bytes_per_token: int = 0

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def kv_tokens(self) -> int:
        return max(self.num_kv_blocks, 0) * self.block_size

    @property
    def kv_block_bytes(self) -> int:
        """A block of the KV budget: the target's, and a draft's where one runs."""
        return self.block_size * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)

    @property
    def kv_cache_bytes(self) -> int:
        return max(self.num_kv_blocks, 0) * self.kv_block_bytes

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV cache: weights (a draft's too), buffers, activations, non-torch
        memory and an encoder cache."""
        return (self.weight_bytes_per_rank + self.buffer_bytes + self.activation_bytes + self.non_torch_bytes
                + self.encoder_cache_bytes + self.draft_weight_bytes_per_rank)

    @property
    def max_concurrency(self) -> float:
        """Sequences of `max_model_len` tokens the KV cache holds at once (what the engine logs)."""
        if self.sliding_window is None:
            return self.kv_tokens / self.max_model_len
        return max(self.num_kv_blocks, 0) / blocks_per_sequence(self.max_model_len, self.block_size,
                                                                self.sliding_window)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fits": self.fits, "kv_tokens": self.kv_tokens,
                "kv_cache_bytes": self.kv_cache_bytes, "max_concurrency": round(self.max_concurrency, 3)}


@dataclass(frozen=True)
class _Shape:
    info: ModelInfo
    hidden_size: int
    intermediate_size: int
    weights: ModelWeights
    max_model_len: int
    quantization: QuantizationConfig | None
    model_cls: type
    draft: DraftShape | None = None


def plan_deployment(config: EngineConfig, *, device: str = "auto", device_memory: int | None = None,
                    device_capability: tuple[int, int] | None = None) -> Plan:
    """The plan for `config`'s model, per rank of `config.tensor_parallel_size`, on `device`
    ('auto', 'cpu' or 'gpu'; see `resolve_target`) of `device_memory` bytes."""
    checkpoint = read_checkpoint(config)
    target = resolve_target(config, checkpoint.model_dtype, device, device_memory, device_capability)
    if config.pipeline_parallel_size > 1:
        return _plan_stages(checkpoint, config, target)
    return _plan(checkpoint, config, target)


def _plan(checkpoint: Checkpoint, config: EngineConfig, target: Target) -> Plan:
    shape = _model_shape(checkpoint, config, target)
    result = _size(checkpoint, shape, config, target, config.tensor_parallel_size)
    if result.fits:
        return result
    return dataclasses.replace(result, remedies=_remedies(result, checkpoint, shape, config, target))


def _plan_stages(checkpoint: Checkpoint, config: EngineConfig, target: Target) -> Plan:
    """Each pipeline stage's plan, its model built as that stage builds it (its layers; the
    embedding on the first, the head on the last): the first that does not fit, else the one with
    the fewest KV blocks, which every stage then allocates (the engine takes the ranks' minimum)."""
    hf, num_stages = checkpoint.hf_config, config.pipeline_parallel_size
    partition = resolve_layer_partition(config)
    check_pipeline_parallel(hf, resolve_model_class(pooling_architectures(hf)), config, partition)
    whole = _model_shape(checkpoint, config, target)
    plans = []
    for stage, layers in enumerate(layer_partition(hf.num_hidden_layers, num_stages, partition)):
        with viewed_as_stage(stage, num_stages, partition):
            plan = _plan(checkpoint, config, target)
        plans.append(dataclasses.replace(
            plan, num_params=whole.info.num_params, weight_bytes=whole.weights.served.total,
            pipeline_parallel_size=num_stages, pipeline_stage=stage, stage_layers=(layers.start, len(layers))))
    failing = [plan for plan in plans if not plan.fits]
    return failing[0] if failing else min(plans, key=lambda plan: plan.num_kv_blocks)


def read_checkpoint(config: EngineConfig) -> Checkpoint:
    """The config of `config.model` (a GGUF header, a folder's config.json, a preset or a hub id's
    config), and what the checkpoint's files hold; no weight is read."""
    spec = config.model or default_model()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_checkpoint(path, config.hf_overrides)
    try:
        # Random weights need only the config: no weight file is listed or downloaded.
        source = resolve_model_source(config.replace(model=spec, load_format="dummy"))
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"{exc} (shape presets: {', '.join(PRESETS)})") from None
    preset = is_preset(spec) and not path.exists()
    stored = {} if preset else _safetensors_bytes(safetensors_files(source.model_dir))
    return Checkpoint(spec, source.hf_config, source.model_dtype, stored, source)


def resolve_target(config: EngineConfig, model_dtype: str | None, device: str = "auto",
                   memory_bytes: int | None = None, capability: tuple[int, int] | None = None) -> Target:
    """'cpu': this machine's CPU; 'gpu': this machine's GPU, or one it does not have (then
    `memory_bytes` is required): one of compute `capability` (default `DEFAULT_GPU_CAPABILITY`) of
    `config.platform`; 'auto': 'gpu' when `memory_bytes` or `capability` is given, else the
    platform the engine would pick here (`config.platform`). Memory defaults to what the platform
    reports."""
    if device not in DEVICES:
        raise ConfigError("device", f"must be one of {', '.join(DEVICES)}; got {device!r}")
    if memory_bytes is not None and memory_bytes <= 0:
        raise ConfigError("device_memory", f"must be a positive size (e.g. 80GiB); got {memory_bytes} bytes")
    if device == "auto" and (memory_bytes is not None or capability is not None):
        device = "gpu"
    if device == "cpu" and capability is not None:
        raise ConfigError("device_capability", "is a GPU's compute capability; it does not apply to --device cpu")
    if device == "gpu" and capability is not None:
        return _gpu_elsewhere(config, model_dtype, memory_bytes, capability)
    platform = host_platform() if device == "cpu" else resolve_platform(config.platform)
    caps = platform.capabilities()
    if device == "gpu" and not caps.profiles_memory:
        return _gpu_elsewhere(config, model_dtype, memory_bytes, DEFAULT_GPU_CAPABILITY)
    memory = memory_bytes or platform.device_memory()
    if not memory:
        raise ConfigError("device_memory", f"platform {platform.name!r} does not report its memory; "
                                           "give it (--device-memory 80GiB)")
    return Target(platform.name, caps.profiles_memory, memory, platform.resolve_dtype(config.dtype, model_dtype),
                  platform.name, caps.quantization_kernels)


def _gpu_elsewhere(config: EngineConfig, model_dtype: str | None, memory_bytes: int | None,
                   capability: tuple[int, int]) -> Target:
    """A GPU this machine does not have (or not the one planned for): its platform tells what one
    of `capability` runs."""
    if memory_bytes is None:
        raise ConfigError("device_memory", "the GPU to plan for is not this machine's: give its memory "
                                           "(--device-memory 80GiB)")
    platform, caps = planned_platform(config.platform, capability)
    dtype = resolve_dtype(caps, platform.name, config.dtype, model_dtype)
    return Target("gpu", True, memory_bytes, dtype, platform.name, caps.quantization_kernels)


def _gguf_checkpoint(path: Path, overrides: dict | None) -> Checkpoint:
    # Imported here: only GGUF files need the gguf package (as in corectl.loaders.resolve).
    from .loaders.gguf_cache import read_gguf_header

    header = read_gguf_header(path)
    hf = header.hf_config
    if overrides:
        hf = type(hf).from_dict({**hf.to_dict(), **overrides})
    dtype = checkpoint_dtype(hf.to_dict())
    source = ModelSource(hf, path.parent, None, f"gguf header of {path}", dtype, gguf_file=path)
    return Checkpoint(str(path), hf, dtype, header.tensor_bytes(), source)


def _safetensors_bytes(files: list[Path]) -> dict[str, int]:
    """Bytes by dtype of the tensors in safetensors files, from their headers alone."""
    sizes: dict[str, int] = {}
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[entry["dtype"]] = sizes.get(entry["dtype"], 0) + end - start
    return sizes


def _model_shape(checkpoint: Checkpoint, config: EngineConfig, target: Target) -> _Shape:
    """The engine's model built on the meta device as `Worker.load_model` builds it, with the
    quantization `EngineCore` would choose for the target (bound to its kernels)."""
    hf = checkpoint.hf_config
    max_model_len = resolve_max_model_len(config, hf)
    quantization = select_quantization(config, checkpoint.source, target.quantization_kernels, target.platform)
    # A bare backbone (an embedding model's `Qwen3Model`) resolves to its causal LM's class, as
    # a pooling engine loads it.
    model = planned_model(resolve_model_class(pooling_architectures(hf)), hf, _DTYPES[target.dtype], max_model_len,
                          quantization, target.quantization_kernels)
    info = _model_info(hf, model, target.dtype, config.kv_cache_dtype)
    weights = size_weights(model, info.head_dim)
    info = dataclasses.replace(info, num_params=weights.num_params)
    return _Shape(info=info, hidden_size=hf.hidden_size, intermediate_size=_mlp_rows_per_token(hf),
                  weights=weights, max_model_len=max_model_len, quantization=quantization, model_cls=type(model),
                  draft=draft_shape(config, model, hf, target.dtype, max_model_len))


def _mlp_rows_per_token(hf) -> int:
    """The MLP width a token's activations take: the dense width, or for a mixture of experts its
    k routed experts' widths (each (token, expert) pair has rows of its own), whichever is larger."""
    dense = getattr(hf, "intermediate_size", 4 * hf.hidden_size)
    experts_per_token = getattr(hf, "num_experts_per_tok", None)
    if not experts_per_token:
        return dense
    return max(dense, experts_per_token * (getattr(hf, "moe_intermediate_size", None) or dense))


def _activation_bytes(shape: _Shape, kv_heads: int, tp: int, tokens: int, num_seqs: int) -> int:
    """Peak of one step's intermediate tensors: per token the residual stream and the normed input,
    plus the larger of the attention block (q, k, v, its output, the projection) and the MLP (gate
    and up, their product, the projection); then logits in the model dtype and fp32, and the
    sampler's fp32 work on them, for each sampled row (one per sequence)."""
    info = shape.info
    itemsize = _DTYPES[info.dtype].itemsize
    q_size = info.num_heads // tp * info.head_dim
    attention = 2 * q_size + 2 * kv_heads * info.head_dim + shape.hidden_size
    mlp = 3 * shape.intermediate_size // tp + shape.hidden_size
    per_token = (2 * shape.hidden_size + max(attention, mlp)) * itemsize
    return tokens * per_token + num_seqs * info.vocab_size * (itemsize + 2 * 4)


def _size(checkpoint: Checkpoint, shape: _Shape, config: EngineConfig, target: Target, tp: int) -> Plan:
    info, weights = shape.info, shape.weights
    check_tensor_parallel(shape.model_cls, tp)
    # The split layers' matrices (and quantized tensors) divided over the ranks, the rest whole
    # on each, plus the K/V projection rows each rank repeats when KV heads are replicated.
    kv_heads, served, per_token = rank_share(info, weights, tp)
    num_seqs = profile_num_seqs(config.max_num_seqs, config.max_num_batched_tokens, shape.max_model_len)
    activations = _activation_bytes(shape, kv_heads, tp, config.max_num_batched_tokens, num_seqs)
    draft_weights, draft_per_token = (0, 0) if shape.draft is None else shape.draft.bytes_per_rank(tp)
    per_block = (per_token + draft_per_token) * config.block_size
    encoder_cache = 0
    budget = config.kv_cache_budget_bytes
    if target.profiles_memory:
        non_torch, usable = NON_TORCH_BYTES, int(target.memory_bytes * config.gpu_memory_utilization)
        # Under pipeline stages only the first holds the tower and its cache.
        if serves_images(shape.model_cls, checkpoint.source.model_dir) and get_pp().is_first:
            encoder_cache = encoder_cache_bytes(shape.hidden_size, _DTYPES[info.dtype].itemsize)
        held = served + weights.buffer_bytes_per_rank(tp) + activations + draft_weights
        blocks = profiled_kv_blocks(target.memory_bytes, config.gpu_memory_utilization, held, non_torch, per_block,
                                    encoder_cache)
        if budget is not None:  # the budget replaces the utilization: all of the device may hold it
            usable = target.memory_bytes
            blocks = fixed_kv_blocks(budget, per_block)
    else:
        non_torch, usable = 0, target.memory_bytes
        blocks = fixed_kv_blocks(budget or DEFAULT_KV_CACHE_BYTES, per_block)
    plan = Plan(
        model=checkpoint.name, architecture=info.architecture, dtype=target.dtype,
        stored_bytes=checkpoint.stored_bytes, num_params=info.num_params, weight_bytes=weights.served.total,
        tensor_parallel_size=tp, weight_bytes_per_rank=served,
        loading_weight_bytes_per_rank=weights.loading.per_rank(kv_heads, info.num_kv_heads, tp),
        buffer_bytes=weights.buffer_bytes_per_rank(tp), num_kv_heads_per_rank=kv_heads, kv_bytes_per_token=per_token,
        block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
        activation_bytes=activations, device=target.name, profiles_memory=target.profiles_memory,
        device_memory_bytes=target.memory_bytes, usable_bytes=usable, non_torch_bytes=non_torch,
        num_kv_blocks=blocks, min_kv_blocks=blocks_per_sequence(shape.max_model_len, config.block_size,
                                                                info.sliding_window, config.max_num_batched_tokens),
        max_model_len=shape.max_model_len, problem=None, sliding_window=info.sliding_window,
        quantization=None if shape.quantization is None else shape.quantization.describe(),
        encoder_cache_bytes=encoder_cache, draft_model=None if shape.draft is None else shape.draft.name,
        draft_weight_bytes_per_rank=draft_weights, draft_kv_bytes_per_token=draft_per_token,
    )
    return dataclasses.replace(plan, problem=_problem(plan))


def _problem(plan: Plan) -> str | None:
    # Loading is bounded by the device, not by --gpu-memory-utilization: the KV cache is sized after.
    loading = plan.loading_weight_bytes_per_rank + plan.buffer_bytes + plan.non_torch_bytes
    if loading > plan.device_memory_bytes:
        return (f"loading holds the weights as they load, before quantized layers are repacked: "
                f"{loading / GIB:.2f} GiB of the device's {plan.device_memory_bytes / GIB:.2f} GiB")
    if plan.fixed_bytes > plan.usable_bytes:
        return (f"weights and activations need {plan.fixed_bytes / GIB:.2f} GiB of the "
                f"{plan.usable_bytes / GIB:.2f} GiB usable, before any KV cache")
    if plan.num_kv_blocks < plan.min_kv_blocks:
        return (f"the KV cache holds {plan.kv_tokens} tokens, fewer than one sequence of "
                f"max_model_len {plan.max_model_len}")
    if plan.fixed_bytes + plan.kv_cache_bytes > plan.usable_bytes:
        return (f"weights, activations and the KV cache need "
                f"{(plan.fixed_bytes + plan.kv_cache_bytes) / GIB:.2f} GiB of the {plan.usable_bytes / GIB:.2f} GiB")
    return None


def _remedies(plan: Plan, checkpoint: Checkpoint, shape: _Shape, config: EngineConfig, target: Target) -> list[str]:
    """Flags that each alone would make `plan` fit."""
    needed_kv = plan.min_kv_blocks * plan.kv_block_bytes
    room = plan.usable_bytes - plan.fixed_bytes
    remedies = []
    if plan.block_size <= plan.kv_tokens < plan.max_model_len and plan.kv_cache_bytes <= room:
        remedies.append(f"--max-model-len {plan.kv_tokens}")
    budget = config.kv_cache_budget_bytes
    if target.profiles_memory and budget is None:
        utilization = math.ceil((plan.fixed_bytes + needed_kv) / plan.device_memory_bytes * 100) / 100
        if config.gpu_memory_utilization < utilization <= 1.0:
            remedies.append(f"--gpu-memory-utilization {utilization:.2f}")
    elif needed_kv <= room:
        # The budget is too small: the least holding one sequence; too large: the most that fits.
        fitting = needed_kv if plan.num_kv_blocks < plan.min_kv_blocks else room
        remedies.append(_budget_flag(fitting, config, rounding_up=fitting == needed_kv))
    if plan.quantization is None and _fits_with_fp8(checkpoint, config, target):
        remedies.append("--quantization fp8")
    for tp in (n for n in TP_SIZES if n > plan.tensor_parallel_size):
        try:
            if _size(checkpoint, shape, config, target, tp).fits:
                remedies.append(f"--tensor-parallel-size {tp}")
                break
        except ConfigError:
            continue
    return remedies


def _budget_flag(nbytes: int, config: EngineConfig, rounding_up: bool) -> str:
    """The KV budget flag the config used (GiB by default), set to `nbytes`."""
    if config.kv_cache_memory_bytes is not None:
        return f"--kv-cache-memory-bytes {nbytes}"
    rounded = (math.ceil if rounding_up else math.floor)(nbytes / GIB * 1000) / 1000
    return f"--kv-cache-memory {rounded:g}"


def _fits_with_fp8(checkpoint: Checkpoint, config: EngineConfig, target: Target) -> bool:
    """Whether dense weights quantized to FP8 on the fly would fit, where the target has an FP8 kernel."""
    fp8 = config.replace(quantization="fp8")
    try:
        return _size(checkpoint, _model_shape(checkpoint, fp8, target), fp8, target, config.tensor_parallel_size).fits
    except ConfigError:  # no FP8 kernel on the target's platform
        return False
