"""The Triton kernels as the models' fused layer kernels (corectl.models.kernels.LayerKernels)."""
from __future__ import annotations

import functools

import torch
from corectl.models.kernels import LayerKernels
from torch.nn import functional as F

from .elementwise.activation import silu_and_mul
from .elementwise.rms_norm import rms_norm
from .elementwise.rotary import qk_norm_rotary, rotary_embedding
from .gemm.fp8_gemv import dense_gemv
from .gemm import padded_rows
from .gemm.gemv_configs import MAX_M, dense_decode_config
from .gemm.invariant import invariant_linear
from .lora import lora_expand, lora_shrink
from .lora.moe_lora import fused_moe_lora
from .lora.stacked import lora_stacked_linear
from .moe.fused_moe import fused_moe, topk_softmax


def _rotary_trusted(positions, q, k, cos, sin) -> None:
    # Positions come from the model runner, bounded by max_model_len; validating them would read
    # them back to the host (a sync per layer) and cannot run inside a CUDA graph capture.
    rotary_embedding(positions, q, k, cos, sin, check_indices=False)


def _qk_norm_rotary_trusted(positions, q, k, q_weight, k_weight, eps, cos, sin) -> None:
    qk_norm_rotary(positions, q, k, q_weight, k_weight, eps, cos, sin, check_indices=False)


def _routed_fused_moe(hidden, gate_up, down, router_logits, top_k, renormalize, gate_up_scale=None, down_scale=None):
    topk_weights, topk_ids = topk_softmax(router_logits, top_k, renormalize)
    return _prerouted_fused_moe(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale)


def _prerouted_fused_moe(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale=None, down_scale=None):
    # Expert ids come from a top-k over the router (always in range); checking them would be a host
    # sync per layer.
    return fused_moe(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale=gate_up_scale,
                     down_scale=down_scale, check_indices=False)


def _routed_fused_moe_lora(hidden, gate_up, down, router_logits, top_k, renormalize, lora, gate_up_scale=None,
                           down_scale=None):
    topk_weights, topk_ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_moe_lora(hidden, gate_up, down, topk_weights, topk_ids, lora, gate_up_scale=gate_up_scale,
                          down_scale=down_scale)


def _router_logits(hidden, weight, bias=None):
    # Decode-sized steps take the GEMV: cuBLAS's smallest kernel spends ~5 us on a 0.5 MB router
    # (H100, Qwen3-30B-A3B), most of a step's per-layer budget for it (gpt-oss's biased one: a
    # split-K GEMM and its reduce, 6 us).
    if hidden.shape[0] <= MAX_M:
        return dense_gemv(hidden, weight, bias)
    return F.linear(hidden, weight, bias)


def _dense_linear(x, weight, bias, gated):
    # The GEMV where its rule (gemv_configs) has it ahead of cuBLAS for this size and batch; cuBLAS on
    # zero-padded rows where graph capture timed that faster (padded_rows); the rest returns None and
    # runs F.linear.
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return None
    cfg = dense_decode_config(x.shape[0], *weight.shape, gated, x.device)
    if cfg is None:
        return None if gated else padded_rows.linear(x, weight, bias)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    return dense_gemv(x, weight, bias, cfg, gated)


@functools.lru_cache(maxsize=1)
def triton_layer_kernels() -> LayerKernels:
    return LayerKernels(rms_norm=rms_norm, silu_and_mul=silu_and_mul, rotary_embedding=_rotary_trusted,
                        qk_norm_rotary=_qk_norm_rotary_trusted, fused_moe=_routed_fused_moe,
                        fused_moe_routed=_prerouted_fused_moe, router_logits=_router_logits,
                        dense_linear=_dense_linear, lora_shrink=lora_shrink, lora_expand=lora_expand,
                        lora_stacked_linear=lora_stacked_linear, fused_moe_lora=_routed_fused_moe_lora)


def _invariant_dense_linear(x, weight, bias, gated):
    # Every dense GEMM, whatever its batch: the GEMV and cuBLAS both choose their work split by M.
    return invariant_linear(silu_and_mul(x) if gated else x, weight, bias)


@functools.lru_cache(maxsize=1)
def batch_invariant_layer_kernels() -> LayerKernels:
    """The kernels of `--batch-invariant`: the fused row-wise kernels (each row's result is its own
    whatever the row count) and the invariant GEMM for every dense linear and the LM head. MoE and
    LoRA have none here: the CUDA worker refuses them in this mode."""
    return LayerKernels(rms_norm=rms_norm, silu_and_mul=silu_and_mul, rotary_embedding=_rotary_trusted,
                        qk_norm_rotary=_qk_norm_rotary_trusted, dense_linear=_invariant_dense_linear)
