"""FP8 W8A8: e4m3 weights with per-output-channel scales, activations quantized per token at
run time (dynamic scales), one `torch._scaled_mm` per layer on GPUs with FP8 tensor cores.

Three sources, one layout: `--quantization fp8` on a bf16/fp32 checkpoint quantizes each weight
row after loading; an `fp8` checkpoint (quant_method "fp8", per-tensor scales) and a
compressed-tensors FP8 checkpoint (per-tensor or per-channel scales) bring e4m3 weights and
`weight_scale`s. Per-tensor scales of a packed layer's shards (q, k, v) become per-channel scales
(exact: each row keeps its shard's scale). Static `input_scale`s are read and not used: dynamic
per-token scales are at least as accurate and cost one row max. An `fp8` checkpoint with
`weight_block_size` (block scales, DeepSeek V3's 128 x 128) is served by `fp8_block`'s methods.

Decode-sized steps (at most GEMV_MAX_M rows) take a W8A16 kernel where the worker provides one
(GEMV_KERNEL): activations stay in the model's dtype, the e4m3 weights are widened in the kernel
(exactly), fp32 sums, the row scale last. That skips the quantizer launch and reads the weights at
HBM bandwidth, where the FP8 tensor-core GEMM's 128-row tiles waste most of their work on one row;
it is also more accurate than W8A8 (no rounding of activations to e4m3). The path depends on the
row count only (known on the host), so each captured CUDA-graph batch size takes one path. On
that path a gated MLP's down projection also takes the packed gate_up activations and forms
silu(gate) * up as the kernel loads them (`apply_gated`): one launch per layer fewer.

Mixture-of-experts layers (`Fp8MoEMethod`): every expert's gate/up and down matrices in the same
layout (e4m3, an fp32 scale per output row: [E, 2I] and [E, H]), from either source. The experts
run W8A16 (the fused MoE kernel widens the e4m3 weights and scales its fp32 sums per row; the
torch path does the same): activations are never quantized there, so the static `input_scale`s
of the experts are not even loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import envs
from ..errors import ConfigError
from .base import LinearMethod, MoEMethod, QuantAxes, QuantizationConfig, tensor_bytes
from .fp8_block import Fp8BlockLinearMethod, Fp8BlockMoEMethod, block_kernel_for, parse_block_size
from .scope import optional_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale per row [R, 1]) with x ~= values * scale (the row max maps to 448)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The dequantize-then-matmul reference of the FP8 GEMM, in fp32."""
    out = (xq.float() * x_scale) @ (weight.float() * weight_scale.view(-1, 1)).t()
    return (out if bias is None else out + bias.float()).to(out_dtype)


def fp8_gemm_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Row-wise scaled FP8 GEMM (Hopper/Ada): `weight` [N, K] e4m3 row-major is the column-major
    [K, N] operand `_scaled_mm` wants. Fast accumulation (the tensor cores' own accumulator, as
    vLLM's and TensorRT-LLM's FP8 GEMMs use it) unless CORECTL_FP8_FAST_ACCUM=0: on an H100 it
    took prefill GEMMs from 1.17-1.32 to 1.45-1.51 PFLOP/s and added at most 1.6e-3 relative error
    to the 1.7e-3 of the bf16 output, far below what rounding the activations to e4m3 costs
    (docs/performance.md)."""
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype,
                           use_fast_accum=envs.fp8_fast_accum())
    return out if bias is None else out + bias


def fp8_w8a16_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    """The decode kernel's contract: x (not quantized) @ the dequantized weight.T, in fp32 math.
    `gated`: x is [M, 2K] (gate | up) and silu(gate) * up in x's dtype (HF's rounding) takes its place."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    out = x.float() @ (weight.float() * weight_scale.view(-1, 1)).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T as the method computes it (activations quantized per token), in fp32 math."""
    return fp8_gemm_reference(*quantize_rows(x), weight, weight_scale, bias, x.dtype)


_KERNELS = {"fp8_scaled_mm": fp8_gemm_scaled_mm, "fp8_reference": fp8_gemm_reference}
# A worker may provide a one-launch activation quantizer with the contract of `quantize_rows`.
QUANTIZE_KERNEL = "fp8_quantize_rows"
# ... and a decode GEMM: (x [M <= GEMV_MAX_M, K], e4m3 weight [N, K], fp32 scales [N], bias | None,
# gated=False) -> x @ (weight * scale[:, None]).T + bias in x's dtype, without quantizing x
# (fp8_w8a16_reference). gated=True: x is a packed gate_up [M, 2K] and silu(gate) * up, rounded to
# x's dtype as the layers' silu_and_mul kernel rounds it, is multiplied instead (`apply_gated`).
GEMV_KERNEL = "fp8_w8a16_gemv"
GEMV_MAX_M = 8


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    name = "fp8"
    kernels = ("fp8_scaled_mm", "fp8_reference")
    # The checkpoint stores e4m3 weights and scales (False: quantize dense weights after loading).
    serialized: bool = False
    per_channel: bool = False
    static_input_scales: bool = False
    ignored: tuple[str, ...] = ()
    # (bn, bk): a scale per block of each weight (`fp8_block`), None for row or tensor scales.
    weight_block: tuple[int, int] | None = None

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "Fp8Config":
        if quant_config is None:
            return cls()
        block = quant_config.get("weight_block_size")
        return cls(serialized=True, static_input_scales=quant_config.get("activation_scheme") == "static",
                   ignored=tuple(quant_config.get("ignored_layers") or quant_config.get("modules_to_not_convert") or ()),
                   weight_block=None if block is None else parse_block_size(block))

    def bind(self, provided: tuple[str, ...], platform: str) -> "Fp8Config":
        if self.weight_block is None:
            return super().bind(provided, platform)
        # Block scales run W8A16: the platform's block GEMM, else torch code, which every platform runs.
        return dataclasses.replace(self, kernel=block_kernel_for(self.weight_block, provided))

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if self._ignores(layer.checkpoint_weight_names(prefix)):
            return None
        if self.weight_block is None:
            return Fp8LinearMethod(self)
        return Fp8BlockLinearMethod(self.weight_block, self.kernel, self.static_input_scales)

    def moe_method(self, prefix: str, layer) -> MoEMethod | None:
        if self._ignores(layer.checkpoint_weight_names(prefix)):
            return None
        return Fp8MoEMethod(self) if self.weight_block is None else Fp8BlockMoEMethod(self.weight_block)

    def _ignores(self, names: list[str]) -> bool:
        return any(ignored and ignored in name for name in names for ignored in self.ignored)


@dataclass(frozen=True)
class CompressedTensorsFp8Config(Fp8Config):
    """compressed-tensors checkpoints whose scheme is FP8 weights and FP8 activations."""

    name = "compressed-tensors"

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "CompressedTensorsFp8Config":
        if quant_config is None:
            raise ConfigError("quantization", "'compressed-tensors' reads a checkpoint's quantization_config; "
                              "this checkpoint has none (use 'fp8' to quantize on the fly)")
        groups = list((quant_config.get("config_groups") or {}).values())
        if len(groups) != 1 or not _is_fp8_scheme(groups[0]):
            raise ConfigError("quantization", "compressed-tensors checkpoints are served when their one config "
                              "group is FP8 weights (8-bit float, tensor or channel strategy) with FP8 activations; "
                              f"this one has {groups}")
        weights, activations = groups[0]["weights"], groups[0]["input_activations"]
        return cls(serialized=True, per_channel=weights.get("strategy") == "channel",
                   static_input_scales=not activations.get("dynamic", False),
                   ignored=tuple(name.removeprefix("re:") for name in quant_config.get("ignore") or ()))


def _is_fp8_scheme(group: dict) -> bool:
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    fp8 = lambda spec: spec.get("num_bits") == 8 and spec.get("type") == "float"  # noqa: E731
    return fp8(weights) and fp8(activations) and weights.get("strategy") in ("tensor", "channel")


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: Fp8Config):
        self.config = config
        self.gemm = _KERNELS[config.kernel]
        self.quantize = optional_kernel(QUANTIZE_KERNEL) or quantize_rows
        self.gemv = optional_kernel(GEMV_KERNEL)

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        cfg = self.config
        layer.register_quant_param("weight", torch.empty(n, k, dtype=FP8 if cfg.serialized else dtype), QuantAxes())
        if not cfg.serialized:
            return
        if cfg.per_channel:
            layer.register_quant_param("weight_scale", torch.ones(n, 1), QuantAxes(0, 1, None))
        else:
            layer.register_quant_param("weight_scale", torch.ones(len(layer.full_sizes or (None,))),
                                       QuantAxes(None, 1, None, per_shard=True))
        if cfg.static_input_scales:
            layer.register_quant_param("input_scale", torch.ones(len(layer.full_sizes or (None,))),
                                       QuantAxes(None, 1, None, per_shard=True))

    def process_weights_after_loading(self, layer) -> None:
        if not self.config.serialized:
            weight, scale = quantize_rows(layer.weight.data)
        else:
            weight, scale = layer.weight.data, _per_channel(layer, layer.weight_scale.data)
        del layer.weight
        if hasattr(layer, "input_scale"):
            del layer.input_scale
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.reshape(-1).float().contiguous(), requires_grad=False)

    def served_bytes(self, layer) -> int:
        # e4m3 weights and an fp32 scale per output row, whether the checkpoint brought them or
        # they were quantized from a dense weight after loading.
        n, k = layer.out_features, layer.in_features
        return n * k * FP8.itemsize + n * torch.float32.itemsize + tensor_bytes(layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._decode_sized(rows):
            out = self.gemv(rows, layer.weight, layer.weight_scale, layer.bias)
        else:
            xq, x_scale = self.quantize(rows)
            out = self.gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_gated(self, layer, gate_up: torch.Tensor) -> torch.Tensor | None:
        # Only the W8A16 GEMV reads the activation as it loads it; the W8A8 path quantizes a
        # materialised activation, so larger steps keep the separate silu_and_mul.
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        if not self._decode_sized(rows):
            return None
        out = self.gemv(rows, layer.weight, layer.weight_scale, layer.bias, gated=True)
        return out.view(*gate_up.shape[:-1], out.shape[-1])

    def _decode_sized(self, rows: torch.Tensor) -> bool:
        """Whether these rows take the worker's W8A16 GEMV (it is provided, and they are few enough)."""
        return self.gemv is not None and rows.shape[0] <= GEMV_MAX_M


def _per_channel(layer, scale: torch.Tensor) -> torch.Tensor:
    """A scale per output row from a per-tensor scale per shard (or per-channel scales as they are)."""
    if scale.numel() == layer.out_features:
        return scale.reshape(-1)
    if layer.shards is None:
        return scale.reshape(1).expand(layer.out_features)
    return torch.cat([scale[i].expand(size) for i, (_, size, _) in enumerate(layer.shards.values())])


class Fp8MoEMethod(MoEMethod):
    """A mixture-of-experts layer's experts in e4m3 with an fp32 scale per output row (module doc)."""

    unused_tensors = ("input_scale",)

    def __init__(self, config: Fp8Config):
        self.config = config

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        e, h, rows = layer.num_experts, layer.hidden_size, layer.rows
        weight_dtype = FP8 if self.config.serialized else dtype
        layer.register_expert_param("gate_up_proj", torch.empty(e, 2 * rows, h, dtype=weight_dtype),
                                    layer.load_gate_up)
        layer.register_expert_param("down_proj", torch.empty(e, h, rows, dtype=weight_dtype), layer.load_down)
        if self.config.serialized:
            # Per-tensor or per-channel, a checkpoint's scales load as one per row (exact).
            layer.register_expert_param("gate_up_proj_scale", torch.ones(e, 2 * rows), layer.load_gate_up_rows)
            layer.register_expert_param("down_proj_scale", torch.ones(e, h), layer.load_down_rows)

    def process_weights_after_loading(self, layer) -> None:
        if self.config.serialized:
            return
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = _quantize_experts(getattr(layer, name).data)
            delattr(layer, name)
            layer.register_parameter(name, torch.nn.Parameter(weight, requires_grad=False))
            layer.register_parameter(f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))

    def served_bytes(self, layer) -> int:
        # e4m3 matrices and an fp32 scale per output row of each, whichever source they came from.
        e, h, rows = layer.num_experts, layer.hidden_size, layer.rows
        return e * 3 * rows * h * FP8.itemsize + e * (2 * rows + h) * torch.float32.itemsize

    def apply(self, layer, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(hidden, router_logits, layer.gate_up_proj_scale, layer.down_proj_scale)


def _quantize_experts(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of each expert of a stacked [E, N, K] weight -> (e4m3 [E, N, K], fp32 [E, N]);
    one expert at a time, so the transient fp32 copy is one expert's, not the layer's."""
    weight = torch.empty(dense.shape, dtype=FP8, device=dense.device)
    scale = torch.empty(dense.shape[:2], dtype=torch.float32, device=dense.device)
    for expert in range(dense.shape[0]):
        weight[expert], expert_scale = quantize_rows(dense[expert])
        scale[expert] = expert_scale.view(-1)
    return weight, scale
