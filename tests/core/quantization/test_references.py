"""The quantized math of core against dequantize-then-matmul references (fresh random inputs each
run): torch's packed int4 CPU GEMM as the GGUF/AWQ/GPTQ methods drive it, GGUF's 4-bit blocks
against the gguf package's own dequantizer, AWQ/GPTQ packing, the 4-bit and FP8 references and the
FP8 method's choice of kernel. The Triton kernels' own tests are in tests/backends/triton."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from corectl.loaders.gguf_blocks import Int4Groups, decode_int4_groups
from corectl.quantization.fp8 import (FP8_MAX, GEMV_KERNEL, GEMV_MAX_M, Fp8Config, Fp8LinearMethod,
                                      fp8_linear_reference, fp8_w8a16_reference, quantize_rows)
from corectl.quantization.scope import quantization_scope
from corectl.quantization.int4 import AWQ_ORDER, dequantize_w4, pack_int32, unpack_int32, w4a16_reference
from corectl.quantization.int4_cpu import int4_linear, pack_int4
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from support.close import assert_close
from support.quantized_layers import w4_operands


def test_cpu_int4pack_matches_dequantized_weights():
    n, k = 48, 128
    groups = Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.1 + 0.01,
                        torch.randn(n, k // 32) * 0.1)
    packed, scale_zero = pack_int4(groups.codes, groups.scales, groups.mins + 8 * groups.scales)
    x = torch.randn(5, k)
    bias = torch.randn(n)
    out = int4_linear(x, packed, scale_zero, 32, bias)
    # The kernel runs on fp32 activations and fp16 scales (torch's fallback on bf16 ones): compare with
    # bf16-rounded inputs, within what either rounding gives.
    ref = x.bfloat16().float() @ groups.dequantize().t() + bias
    assert out.dtype == x.dtype
    assert_close(out, ref, 0.05, norm="max")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_int4_blocks_decode_like_gguf(qtype):
    kind = GGMLQuantizationType[qtype]
    values = np.random.randn(6, 96).astype(np.float32)
    blocks = quantize(values, kind)
    decoded = decode_int4_groups(qtype, blocks.reshape(6, -1))
    assert int(decoded.codes.max()) < 16
    np.testing.assert_allclose(decoded.dequantize().numpy(), dequantize(blocks, kind).reshape(6, 96), atol=1e-5)


def test_gguf_q4_k_blocks_decode_like_gguf():
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, size=(3 * 2, 144), dtype=np.uint8)
    # d and dmin: finite positive halves (random bytes could spell NaN or inf)
    blocks[:, 0:4] = np.abs(rng.standard_normal((6, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(6, 4)
    rows = blocks.reshape(3, -1)
    decoded = decode_int4_groups("Q4_K", rows)
    expected = dequantize(rows, GGMLQuantizationType.Q4_K).reshape(3, 512)
    np.testing.assert_allclose(decoded.dequantize().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim,order", [(0, tuple(range(8))), (1, AWQ_ORDER)])
def test_int32_packing_round_trips(dim, order):
    codes = torch.randint(0, 16, (16, 24), dtype=torch.uint8)
    words = pack_int32(codes, dim, order)
    assert words.dtype == torch.int32 and words.shape[dim] == codes.shape[dim] // 8
    assert torch.equal(unpack_int32(words, dim, order), codes)


def test_awq_order_puts_column_two_in_the_second_nibble():
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8)
    word = int(pack_int32(codes, 1, AWQ_ORDER)) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)


def test_fp8_fast_accumulation_is_on_unless_switched_off(monkeypatch):
    """`fp8_gemm_scaled_mm` passes this to `_scaled_mm` (tests/gpu runs both settings)."""
    from corectl import envs

    monkeypatch.delenv("CORECTL_FP8_FAST_ACCUM", raising=False)
    assert envs.fp8_fast_accum() is True
    for off in ("0", "false", "no"):
        monkeypatch.setenv("CORECTL_FP8_FAST_ACCUM", off)
        assert envs.fp8_fast_accum() is False


def test_fp8_rows_round_trip_within_e4m3_precision():
    x = torch.randn(7, 64) * torch.rand(7, 1) * 10
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((7,), FP8_MAX))
    # e4m3 rounds to within 2**-4 relative (3 mantissa bits), and below 2**-6 (subnormals, in
    # steps of 2**-9) to within 2**-10 of the row's scale.
    assert ((q.float() * scale - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10).all()


def test_fp8_reference_linear_is_close_to_dense():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    wq, ws = quantize_rows(w)
    assert_close(fp8_linear_reference(x, wq, ws, None), x @ w.t(), 0.1, norm="max")


def test_fp8_method_runs_decode_batches_on_the_w8a16_kernel_when_provided():
    """Up to GEMV_MAX_M rows take the worker's W8A16 kernel (x not quantized); more rows, or no
    kernel, the W8A8 GEMM."""
    weight, scale = quantize_rows(torch.randn(32, 64))
    layer = SimpleNamespace(weight=weight, weight_scale=scale.view(-1), bias=torch.randn(32))
    calls = []

    def gemv(x, w, s, bias):
        calls.append(x.shape[0])
        return fp8_w8a16_reference(x, w, s, bias)

    with quantization_scope(None, {GEMV_KERNEL: gemv}):
        method = Fp8LinearMethod(Fp8Config(kernel="fp8_reference"))
    plain = Fp8LinearMethod(Fp8Config(kernel="fp8_reference"))
    decode, prefill = torch.randn(1, 3, 64), torch.randn(GEMV_MAX_M + 1, 64)
    out = method.apply(layer, decode)
    assert calls == [3] and out.shape == (1, 3, 32)
    torch.testing.assert_close(out, fp8_w8a16_reference(decode.view(3, 64), weight, scale, layer.bias).view(1, 3, 32))
    torch.testing.assert_close(plain.apply(layer, decode), fp8_linear_reference(decode, weight, scale, layer.bias))
    torch.testing.assert_close(method.apply(layer, prefill), fp8_linear_reference(prefill, weight, scale, layer.bias))
    assert calls == [3]


@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_M])
def test_fp8_method_fuses_silu_and_mul_into_the_w8a16_kernel(m):
    """`apply_gated` of a packed gate_up is `apply` of silu_and_mul's output, to the bit (the Triton
    kernels, interpreted); steps the W8A16 kernel does not take, or no such kernel, have no fused form."""
    from corectl.backends.triton.elementwise.activation import silu_and_mul
    from corectl.backends.triton.gemm.fp8_gemv import fp8_w8a16_gemv

    weight, scale = quantize_rows(torch.randn(32, 64))
    layer = SimpleNamespace(weight=weight, weight_scale=scale.view(-1), bias=torch.randn(32).bfloat16())
    with quantization_scope(None, {GEMV_KERNEL: fp8_w8a16_gemv}):
        method = Fp8LinearMethod(Fp8Config(kernel="fp8_reference"))
    gate_up = torch.randn(1, m, 128).bfloat16()
    fused = method.apply_gated(layer, gate_up)
    assert fused.shape == (1, m, 32)
    assert torch.equal(fused, method.apply(layer, silu_and_mul(gate_up.view(m, 128)).view(1, m, 64)))
    assert method.apply_gated(layer, torch.randn(GEMV_MAX_M + 1, 128).bfloat16()) is None
    assert Fp8LinearMethod(Fp8Config(kernel="fp8_reference")).apply_gated(layer, gate_up) is None


@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_reference_is_the_dequantized_matmul(act_order):
    x, qweight, scales, zeros, g_idx, codes = w4_operands(3, 64, 16, 16, act_order)
    ref = x @ dequantize_w4(codes, zeros, scales, g_idx).t()
    torch.testing.assert_close(w4a16_reference(x, qweight, scales, zeros, g_idx), ref)


def test_w4a16_reference_adds_float_offsets():
    x, qweight, scales, offsets, g_idx, codes = w4_operands(3, 64, 16, 32, False, offsets=True)
    g = g_idx.long()
    ref = x @ (codes.float() * scales[g].t() + offsets[g].t()).t()
    torch.testing.assert_close(w4a16_reference(x, qweight, scales, offsets, g_idx), ref)
