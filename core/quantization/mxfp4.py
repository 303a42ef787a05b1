"""MXFP4 mixture-of-experts checkpoints (gpt-oss): 4-bit e2m1 values with an e8m0 scale per 32.

A checkpoint (`quantization_config.quant_method == "mxfp4"`) stores each layer's stacked experts as
`<stack>_blocks` uint8 [E, rows, K / 32, 16] (two e2m1 codes a byte, the low nibble first) and
`<stack>_scales` uint8 [E, rows, K / 32] (a power of two, biased by 127), rows being the output
features (gpt-oss interleaves gate and up rows). Everything else (attention, router, biases,
embeddings) is dense.

Served two ways, the platform's choice (`bind`):
  - packed, where the platform provides the `mxfp4_moe` kernel (`PlatformCaps.quantization_kernels`;
    CUDA's is a Triton fused MoE that decodes e2m1 and applies the e8m0 scales inside its K loop,
    bf16 activations and fp32 sums): the loaded blocks and scales are what the layer keeps, 4.25
    bits a weight, and `apply` hands them, the biases and the router's logits to the kernel;
  - dequantized everywhere else (CPU): `process_weights_after_loading` dequantizes them into the
    dense stacked experts the torch MoE path runs on, in the model dtype's bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .base import LinearMethod, MoEMethod, QuantizationConfig
from .scope import kernel as provided_kernel

GROUP = 32
# The platform kernel that runs packed experts: (hidden, router_logits, gate_up, down, top_k,
# renormalize, alpha, limit) -> this rank's output, gate_up and down (blocks, scales, bias) tuples.
PACKED_KERNEL = "mxfp4_moe"
# e2m1 code -> value (sign bit 3, then two exponent bits and one mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> values [..., G * 32] in `dtype`."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    values = lut[codes] * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"
    kernels = (PACKED_KERNEL, "dequantized")

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "Mxfp4Config":
        if quant_config is None:
            raise ConfigError("quantization", "'mxfp4' reads an MXFP4 checkpoint's experts; this checkpoint has "
                              "no quantization_config (on-the-fly MXFP4 quantization is not supported)")
        return cls()

    def bind(self, provided: tuple[str, ...], platform: str) -> "Mxfp4Config":
        # Without the platform's kernel, dequantized at load: torch code, which every platform runs.
        return dataclasses.replace(self, kernel=PACKED_KERNEL if PACKED_KERNEL in provided else "dequantized")

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        return None

    def moe_method(self, prefix: str, layer) -> MoEMethod | None:
        if not hasattr(layer, "load_stacked"):
            raise ConfigError("quantization", f"MXFP4 experts are read for gpt-oss's stacked layout; {prefix} "
                              f"({type(layer).__name__}) is not one")
        return Mxfp4MoEMethod(packed=self.kernel == PACKED_KERNEL)


class Mxfp4MoEMethod(MoEMethod):
    """Loads this rank's MXFP4 blocks and scales (module doc): kept for the platform's kernel when
    `packed`, else dense after loading."""

    def __init__(self, packed: bool):
        self.packed = packed
        self.moe = provided_kernel(PACKED_KERNEL) if packed else None

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        e, h, rows = layer.num_experts, layer.hidden_size, layer.rows
        if h % GROUP or rows % GROUP:
            raise ConfigError("tensor_parallel_size", f"MXFP4 experts split in groups of {GROUP}: the hidden size "
                              f"{h} and this rank's {rows} expert rows must be multiples of it")
        self.dtype = dtype
        shapes = {"gate_up_proj": (e, 2 * rows, h // GROUP), "down_proj": (e, h, rows // GROUP)}
        for stack, shape in shapes.items():
            for suffix, full in (("_blocks", (*shape, GROUP // 2)), ("_scales", shape)):
                layer.register_parameter(stack + suffix, torch.nn.Parameter(torch.zeros(full, dtype=torch.uint8),
                                                                            requires_grad=False))

    def load_stacked(self, layer, name: str, loaded: torch.Tensor) -> None:
        """`<stack>_blocks` or `<stack>_scales` of the whole layer into this rank's slice: gate_up's
        interleaved rows split into gate then up rows, down's input groups narrowed."""
        param = getattr(layer, name)
        e, h, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        groups, rows = layer.first_row // GROUP, layer.rows // GROUP
        if name.startswith("gate_up_proj"):
            expected = (e, 2 * inter, h // GROUP) + param.shape[3:]
            self._expect(name, loaded, expected)
            pair = loaded.unflatten(1, (-1, 2)).unbind(2)
            param.data.copy_(torch.cat([part.narrow(1, layer.first_row, layer.rows) for part in pair], dim=1))
        else:
            self._expect(name, loaded, (e, h, inter // GROUP) + param.shape[3:])
            param.data.copy_(loaded.narrow(2, groups, rows))

    @staticmethod
    def _expect(name: str, loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != tuple(shape):
            raise ValueError(f"experts.{name}: expected {tuple(shape)}, checkpoint has {tuple(loaded.shape)}")

    def process_weights_after_loading(self, layer) -> None:
        if self.packed:
            return
        for stack in ("gate_up_proj", "down_proj"):
            blocks, scales = getattr(layer, f"{stack}_blocks").data, getattr(layer, f"{stack}_scales").data
            dense = torch.empty(*scales.shape[:2], scales.shape[2] * GROUP, dtype=self.dtype, device=blocks.device)
            # One expert at a time: the transient codes and fp32 values are one expert's, not the layer's.
            for expert in range(dense.shape[0]):
                dense[expert] = mxfp4_dequantize(blocks[expert], scales[expert], self.dtype)
            delattr(layer, f"{stack}_blocks")
            delattr(layer, f"{stack}_scales")
            layer.register_parameter(stack, torch.nn.Parameter(dense, requires_grad=False))

    def served_bytes(self, layer) -> int:
        e, h, rows = layer.num_experts, layer.hidden_size, layer.rows
        if self.packed:  # half a byte a weight, a byte of scale per 32
            return e * 3 * rows * h * (GROUP // 2 + 1) // GROUP
        return e * 3 * rows * h * self.dtype.itemsize

    def apply(self, layer, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return layer.run_experts(hidden, router_logits)
        gate_up = (layer.gate_up_proj_blocks, layer.gate_up_proj_scales, layer.gate_up_proj_bias)
        down = (layer.down_proj_blocks, layer.down_proj_scales, layer.down_proj_bias)
        return self.moe(hidden, router_logits, gate_up, down, layer.top_k, layer.renormalize, layer.alpha, layer.limit)
