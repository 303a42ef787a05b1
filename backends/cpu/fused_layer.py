"""A Llama-family decoder layer on 4-bit GGUF weights as one C call (`fused_ops.c: decoder_layer`).

Why: after the fused operators (fused_ops.py) a batch-1 decode step of SmolLM2-135M was still mostly
Python: ~10 module calls, the wrappers' reshapes, views and allocations, and 8 ctypes calls a layer,
each a few microseconds, against ~40 us of GEMMs. Here a layer is one ctypes call over arguments built
once (the weights never move: `_plan`) and once per step (`_step`), and it runs the same C functions
as the module path, so both give the same bits.

It serves exactly the plain layer of `corectl.models.llama` (Llama, SmolLM2, Mistral without LoRA or
tensor parallelism): every projection the GGUF int4 method's grouped kernel (fp16 scale/min layout), no
biases, no q/k norms, whole-head rotary, attention the fused paged one. Anything else returns None and
the modules run.
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from corectl.models.kernels import LayerKernels
from corectl.models.layers import RMSNorm, RotaryEmbedding
from corectl.models.llama import DecoderAttention, DecoderLayer, GatedMLP
from corectl.quantization.gguf import GROUP, GGUFInt4Method
from corectl.quantization.int4_cpu import kernel_library

from . import fused_ops
from .fused_ops import fused_library

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Projection(ctypes.Structure):
    _fields_ = [("w", _P), ("sz", _P), ("n", _L), ("k", _L), ("group", _I)]


class _LayerPlan(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("norm1", _P), ("norm2", _P), ("cos", _P), ("sin", _P), ("eps1", _F), ("eps2", _F), ("scale", _F),
                ("hq", _I), ("hk", _I), ("d", _I), ("window", _L)]


class _StepPlan(ctypes.Structure):
    _fields_ = [("T", _L), ("positions", _P), ("slot_mapping", _P), ("seqs", _P), ("ends", _P), ("tables", _P),
                ("ldt", _L), ("bs", _I), ("threads", _I), ("gemm", _P)]


# layer -> its plan's call arguments, or None where the layer has no fused form (decided once)
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _projection(linear) -> _Projection | None:
    # No quant_method: a prepacked dense layer
    sz, method = getattr(linear, "scale_zero", None), getattr(linear, "quant_method", None)
    if (not isinstance(method, GGUFInt4Method) or method.gemm is not None or sz is None
            or sz.dtype != torch.float16 or linear.bias is not None or getattr(linear, "reduce_output", None)):
        return None
    return _Projection(linear.packed_weight.data_ptr(), sz.data_ptr(), linear.out_features, linear.in_features, GROUP)


def _plan(layer) -> _LayerPlan | None:
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer) is not DecoderLayer or type(attn) is not DecoderAttention or type(mlp) is not GatedMLP
            or not isinstance(mlp.act, torch.nn.SiLU) or attn.q_norm is not None
            or type(attn.rotary) is not RotaryEmbedding or attn.rotary.partial or attn.rotary.cos.dtype != torch.float32
            or attn.attn.sinks is not None or attn.attn.logits_soft_cap is not None
            or attn.attn.attention_chunk is not None
            or not all(type(n) is RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm))):
        return None
    projections = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in projections):
        return None
    norms = layer.input_layernorm, layer.post_attention_layernorm
    return _LayerPlan(*projections, norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
                      attn.rotary.cos.data_ptr(), attn.rotary.sin.data_ptr(), norms[0].eps, norms[1].eps,
                      attn.attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.sliding_window or 0)


def _step(positions: torch.Tensor, meta) -> _StepPlan:
    """The step's arguments, built by its first fused layer and kept on the attention metadata with
    the tensors they point into (built again for other positions: a drafter may share the metadata)."""
    if meta.fused_step is None or meta.fused_step[0] is not positions:
        tables, seqs, ends = meta.fused
        rows = positions.long().contiguous()
        gemm = ctypes.cast(kernel_library().grouped_gemm, _P).value
        meta.fused_step = (positions, rows, _StepPlan(
            rows.shape[0], rows.data_ptr(), meta.slot_mapping.data_ptr(), seqs.data_ptr(), ends.data_ptr(),
            tables.data_ptr(), tables.stride(0), meta.block_size, torch.get_num_threads(), gemm))
    return meta.fused_step[2]


def decoder_layer(layer, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx):
    """(MLP output, new residual) of `layer` as `DecoderLayer.forward` computes them, or None. A
    residual passed in becomes the new one in place (the layers hand it only to the next layer)."""
    plan = _plans.get(layer, False)
    if plan is False:
        plan = _plans[layer] = _plan(layer)
    meta = ctx.metadata
    if plan is None or getattr(meta, "fused", None) is None:
        return None
    cache = ctx.kv_caches[layer.self_attn.attn.layer_idx]
    if (cache.dtype not in fused_ops.KV_DTYPES or not cache.is_contiguous() or hidden.dtype != torch.float32
            or not hidden.is_contiguous() or not (residual is None or residual.is_contiguous())):
        return None
    out = torch.empty_like(hidden)
    first = residual is None
    residual = torch.empty_like(hidden) if first else residual
    fused_library().decoder_layer(ctypes.byref(plan), ctypes.byref(_step(positions, meta)), cache.data_ptr(),
                                  cache.numel(), cache.dtype == torch.float16, hidden.data_ptr(), residual.data_ptr(),
                                  first, out.data_ptr())
    return out, residual


@functools.lru_cache(maxsize=1)
def _kernels() -> LayerKernels:
    return LayerKernels(rms_norm=fused_ops.rms_norm, silu_and_mul=fused_ops.silu_and_mul,
                        rotary_embedding=fused_ops.rotary_embedding, decoder_layer=decoder_layer)


def cpu_layer_kernels(dtype: torch.dtype) -> LayerKernels | None:
    """The fused kernels for a model computing in `dtype`, or None (its torch code serves)."""
    if dtype != torch.float32 or fused_library() is None:
        return None
    return _kernels()
