"""Fused kernels a worker may hand the model's layers in place of their torch code.

The layers' torch code is the numerical reference (HF-exact, see layers.py) and runs wherever no
kernels are installed. On GPUs each torch expression is several kernel launches (RMSNorm alone is
six), which dominates small-batch decode even inside a CUDA graph; a platform's worker installs
fused equivalents with `install_layer_kernels` after building the model. Core never names a
backend: the worker decides what to install.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .. import envs


@dataclass(frozen=True)
class LayerKernels:
    # (x [T, N], weight [N], eps, residual [T, N] | None) -> out, or (out, x + residual) with a residual
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    # x [T, 2I], gate first -> silu(gate) * up [T, I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (positions [T], q [T, Hq, D], k [T, Hk, D], cos [P, D], sin [P, D]) -> None; rotates q, k in place
    rotary_embedding: Callable[..., None]
    # (positions, q, k, q_weight [D], k_weight [D], eps, cos, sin) -> None: per-head RMSNorm of q and k
    # (Qwen3) then the rotation, in place; None runs the norms and `rotary_embedding` separately
    qk_norm_rotary: Callable[..., None] | None = None
    # (hidden [T, H], gate_up [E, 2I, H], down [E, H, I], router_logits [T, E], top_k, renormalize,
    # gate_up_scale=None, down_scale=None) -> [T, H]: a mixture-of-experts layer, routing included
    # (corectl.models.moe); the scales ([E, 2I], [E, H] fp32) come with e4m3 weights (FP8 experts,
    # scaled per output row). None runs its torch path
    fused_moe: Callable[..., torch.Tensor] | None = None
    # (hidden [T, H], gate_up, down, topk_weights [T, k] fp32, topk_ids [T, k], gate_up_scale=None,
    # down_scale=None) -> [T, H]: `fused_moe` with the routing chosen by the model (DeepSeek's grouped,
    # scaled top-k), read on the device only. None runs the torch path
    fused_moe_routed: Callable[..., torch.Tensor] | None = None
    # (hidden [T, H], weight [E, H], bias [E] | None = None) -> hidden @ weight.T + bias [T, E] in
    # hidden's dtype: a mixture-of-experts router's logits (small E: decode steps are mostly launch
    # latency, which a GEMV kernel cuts). None runs F.linear
    router_logits: Callable[..., torch.Tensor] | None = None
    # (x [T, K], weight [N, K], bias [N] | None, gated) -> x @ weight.T + bias [T, N], or None where the
    # platform has nothing faster than F.linear for this shape and batch; gated: x is [T, 2K] (gate |
    # up) and silu(gate) * up takes its place. An unquantized linear layer's GEMM (decode-sized
    # steps, where a GEMV can read small weights closer to copy bandwidth than cuBLAS; under
    # `--batch-invariant`, every one, never None: its launch must not depend on the batch). None: F.linear
    dense_linear: Callable[..., torch.Tensor | None] | None = None
    # Batched mixed-adapter LoRA (corectl.lora.punica says what each computes; slot -1 rows are left
    # alone). shrink: (x [T, K], a [S, R, K], token_slots [T] int32, segments | None, gated=False) -> fp32 partial
    # sums [P, T, R] (xa is their sum over P); expand: (xa [P, T, n * R], b [S, N, R], scales [S] fp32,
    # token_slots, segments | None, out [T, N], slice_sizes: the n slices' widths) -> None, adding into
    # out. `segments` (a LoRASegments) gives the segment form of a prefill step, None the gathered form
    # (decode; graph capture); gated: x is [T, 2K] (gate | up) and silu(gate) * up takes its place. None: the torch path
    lora_shrink: Callable[..., torch.Tensor] | None = None
    lora_expand: Callable[..., None] | None = None
    # (x [M, K], stacked [N', K], bias [N'] | None, base_rows N, gated) -> x @ stacked.T + bias [M, N'],
    # or None: a LoRA layer's weight with its adapters' A rows stacked under it, by the GEMV tuned for
    # the base's [N, K] (batch-1 decode: the shrink rides the base GEMV). None where the base would
    # not take a GEMV at this batch, or where this field is None: the base and the shrink run apart
    lora_stacked_linear: Callable[..., torch.Tensor | None] | None = None
    # `fused_moe` with each token's adapter added in its experts: the same arguments plus
    # lora=<corectl.lora.experts.ExpertLoRA> (its stacks, and its batch's token_slots and scales;
    # that module says what it computes). None runs the experts' torch path while adapters are on
    fused_moe_lora: Callable[..., torch.Tensor] | None = None
    # (layer, positions, hidden, residual | None, ctx) -> (hidden, residual) as a llama.DecoderLayer's
    # forward returns them, or None where the platform has no whole-layer form for this layer or step
    # (then its modules run): one call for a layer, where per-operator host work dominates (CPU decode)
    decoder_layer: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None


class UsesLayerKernels:
    """Mixin for layers with a fused path: `kernels` is None until a worker installs some."""

    kernels: LayerKernels | None = None

    def dense_kernel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     gated: bool = False) -> torch.Tensor | None:
        """x @ weight.T + bias (gated: of silu(gate) * up) by the installed `dense_linear`, or None
        where none is installed or it has nothing faster for this shape: the caller runs F.linear."""
        kernels = self.kernels
        if kernels is None or kernels.dense_linear is None:
            return None
        return kernels.dense_linear(x, weight, bias, gated)

    def router_forward(self, router: torch.nn.Module, hidden: torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """A mixture-of-experts router's logits: the installed `router_logits` on the router's own
        weight and bias (both operands in `dtype` when given), or the router module itself where no
        kernel is installed or a platform swapped the module for its own GEMM (the CPU's prepacked
        linear keeps no `weight`)."""
        kernel = self.kernels.router_logits if self.kernels is not None else None
        weight = getattr(router, "weight", None)
        if kernel is None or weight is None:
            return router(hidden)
        if dtype is not None:
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = getattr(router, "bias", None)
        return kernel(hidden, weight) if bias is None else kernel(hidden, weight, bias)

    def dense_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias: the installed `dense_linear` where it takes the shape, else F.linear."""
        out = self.dense_kernel(x, weight, bias)
        return F.linear(x, weight, bias) if out is None else out


def install_layer_kernels(model: torch.nn.Module, kernels: LayerKernels | None) -> int:
    """Give every layer of `model` that has a fused path these kernels (None: the torch code).
    CORECTL_FUSED_KERNELS=0 keeps the torch code, to measure what the kernels are worth.
    Returns how many layers took them."""
    if kernels is not None and not envs.fused_kernels_enabled():
        kernels = None
    layers = [m for m in model.modules() if isinstance(m, UsesLayerKernels)]
    for layer in layers:
        layer.kernels = kernels
    return len(layers) if kernels is not None else 0
