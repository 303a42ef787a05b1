"""Quantized GEMMs and block decoders against dequantize-then-matmul references (fresh random
inputs each run): torch's packed int4 CPU GEMM as the GGUF/AWQ/GPTQ methods drive it, GGUF's
4-bit blocks against the gguf package's own dequantizer, AWQ/GPTQ packing, the FP8 reference and
the Triton 4-bit GEMM under the interpreter."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from corectl.backends.triton.gemm.w4a16_configs import W4Config
from corectl.loaders.gguf_blocks import Int4Groups, decode_int4_groups
from corectl.quantization.fp8 import (FP8_MAX, GEMV_KERNEL, GEMV_MAX_M, Fp8Config, Fp8LinearMethod,
                                      fp8_linear_reference, fp8_w8a16_reference, quantize_rows)
from corectl.quantization.scope import quantization_scope
from corectl.quantization.int4 import (AWQ_ORDER, dequantize_w4, pack_int32, tile_words, unpack_int32, untile_words,
                                       w4a16_reference)
from corectl.quantization.int4_cpu import int4_linear, pack_int4
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize


def test_cpu_int4pack_matches_dequantized_weights():
    n, k = 48, 128
    groups = Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.1 + 0.01,
                        torch.randn(n, k // 32) * 0.1)
    packed, scale_zero = pack_int4(groups.codes, groups.scales, groups.mins + 8 * groups.scales)
    x = torch.randn(5, k)
    bias = torch.randn(n)
    out = int4_linear(x, packed, scale_zero, 32, bias)
    # The GEMM runs on bf16 activations and bf16 scales: compare with the same rounding of inputs.
    ref = x.bfloat16().float() @ groups.dequantize().t() + bias
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0.0)


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
    out = fp8_linear_reference(x, wq, ws, None)
    ref = x @ w.t()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


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


def _w4_case(m: int, k: int, n: int, group: int, act_order: bool, offsets: bool = False):
    """Operands of the 4-bit GEMM; `offsets`: float offsets per group (GGUF) instead of zero codes."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    groups = k // group
    scales = torch.rand(groups, n) * 0.05 + 0.01
    zeros = torch.randn(groups, n) * 0.1 if offsets else torch.randint(0, 16, (groups, n), dtype=torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    return torch.randn(m, k), pack_int32(codes.t(), 0), scales, zeros, g_idx, codes


@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_reference_is_the_dequantized_matmul(act_order):
    x, qweight, scales, zeros, g_idx, codes = _w4_case(3, 64, 16, 16, act_order)
    ref = x @ dequantize_w4(codes, zeros, scales, g_idx).t()
    torch.testing.assert_close(w4a16_reference(x, qweight, scales, zeros, g_idx), ref)


def test_w4a16_reference_adds_float_offsets():
    x, qweight, scales, offsets, g_idx, codes = _w4_case(3, 64, 16, 32, False, offsets=True)
    g = g_idx.long()
    ref = x @ (codes.float() * scales[g].t() + offsets[g].t()).t()
    torch.testing.assert_close(w4a16_reference(x, qweight, scales, offsets, g_idx), ref)


def _w4a16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 exactly up to summation order; half dtypes within their rounding of the output (and,
    act-order through tl.dot, of the dequantized weights)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert error < 1e-2, error


# Triton's interpreter multiplies bf16 tl.dot operands as raw 16-bit integers (3.9: errors ~1e10
# on plain loaded tiles): bf16 runs here only through GEMV; tests/gpu checks bf16 dots.
INTERPRETED_DOT_DTYPES = (torch.float32, torch.float16)


# Decode sizes 1..16 through the launcher's own choice (GEMV at M = 1, 16-row dots above), a
# prefill size; K = 200 is no multiple of any block (act-order allows any K = 8j).
@pytest.mark.parametrize("m", list(range(1, 17)) + [70])
@pytest.mark.parametrize("act_order", [False, True])
def test_triton_w4a16_matches_reference(m, act_order):
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    k, group = (200, 8) if act_order else (192, 64)
    x, qweight, scales, zeros, g_idx, _ = _w4_case(m, k, 80, group, act_order)
    x = x.to(torch.bfloat16 if m == 1 else torch.float16)
    out = w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size=0 if act_order else group)
    _w4a16_close(out, w4a16_reference(x, qweight, scales, zeros, g_idx))


# GGUF's layout (groups of 32, float offsets): decode and prefill sizes through the launcher's
# choice; K = 96 and 160 (odd group counts) are no multiple of its configs' 64-input blocks, which
# shrink to one group. bf16 only through GEMV (M = 1).
@pytest.mark.parametrize("m", [1, 3, 16, 70])
@pytest.mark.parametrize("k", [96, 160])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_w4a16_float_offsets_match_reference(m, k, dtype):
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    if dtype not in INTERPRETED_DOT_DTYPES and m > 1:
        pytest.skip("bf16 tl.dot is wrong under Triton's interpreter")
    x, qweight, scales, offsets, g_idx, _ = _w4_case(m, k, 48, 32, False, offsets=True)
    x, scales, offsets = x.to(dtype), scales.to(dtype), offsets.to(dtype)
    out = w4a16_gemm(x, qweight, scales, offsets, g_idx, group_size=32)
    _w4a16_close(out, w4a16_reference(x, qweight, scales, offsets, g_idx))


W4_CONFIGS = {  # every kernel form, K split unevenly (3 slices of 192 / 2, 4 or 7 inputs of a block)
    "gemv": W4Config(1, 64, 32, 3, 4, gemv=True),
    "gemv-wide-block": W4Config(1, 32, 128, 2, 4, gemv=True),  # 4 groups of 32 a block, or 8-input blocks
    "gemv-two-groups": W4Config(1, 16, 64, 1, 4, gemv=True),
    "dot": W4Config(16, 32, 64, 3, 4),
    "dot-prefill": W4Config(32, 64, 32, 1, 4),
}


@pytest.mark.parametrize("config", list(W4_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,act_order", [(32, False), (24, False), (32, True)])
@pytest.mark.parametrize("offsets", [False, True])
def test_triton_w4a16_configs_match_reference(config, dtype, group, act_order, offsets):
    """Each config with contiguous groups (G = 24: blocks shrink to 8 inputs for GEMV, tl.dot falls
    back to gathering) and act-order, in every activation dtype, with zero codes or float offsets;
    scales (and offsets) in x's dtype as loaded."""
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    if dtype not in INTERPRETED_DOT_DTYPES and not W4_CONFIGS[config].gemv:
        pytest.skip("bf16 tl.dot is wrong under Triton's interpreter")
    m = 1 if W4_CONFIGS[config].gemv else 5
    x, qweight, scales, zeros, g_idx, _ = _w4_case(m, 192, 72, group, act_order, offsets)
    x, scales = x.to(dtype), scales.to(dtype)
    zeros = zeros.to(dtype) if offsets else zeros
    out = w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size=0 if act_order else group,
                     config=W4_CONFIGS[config])
    _w4a16_close(out, w4a16_reference(x, qweight, scales, zeros, g_idx))


@pytest.mark.parametrize("offset", [0, 1])
def test_triton_w4a16_gemv_reads_inputs_in_pairs_or_singly(offset):
    """16-bit rows that start 4-byte aligned are read two inputs a load; a view starting one input
    further is not, and is read one input a load; both agree with the reference, over three rows."""
    from corectl.backends.triton.gemm.w4a16 import _packed_inputs, w4a16_gemm

    x, qweight, scales, zeros, g_idx, _ = _w4_case(3, 128, 48, 32, False, offsets=True)
    wide = torch.randn(3, 130).to(torch.bfloat16)
    wide[:, offset:offset + 128] = x.to(torch.bfloat16)
    x = wide[:, offset:offset + 128]
    assert _packed_inputs(x) == (offset == 0)
    scales, zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    out = w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size=32, config=W4Config(1, 16, 64, 1, 4, gemv=True))
    _w4a16_close(out, w4a16_reference(x, qweight, scales, zeros, g_idx))


@pytest.mark.parametrize("config", ["gemv", "gemv-wide-block", "dot"])
@pytest.mark.parametrize("n,tile", [(72, 16), (80, 32), (40, 8)])
def test_triton_w4a16_reads_column_tiles(config, n, tile):
    """Words as column tiles (N = 72 pads its last tile of 16; tiles wider and narrower than the
    config's column slice) give the plain layout's answer."""
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    m = 1 if W4_CONFIGS[config].gemv else 5
    x, qweight, scales, offsets, g_idx, _ = _w4_case(m, 192, n, 32, False, offsets=True)
    tiles = tile_words(qweight, tile)
    assert tiles.shape == (-(-n // tile), 24, tile) and torch.equal(untile_words(tiles, n), qweight)
    out = w4a16_gemm(x, tiles, scales, offsets, g_idx, group_size=32, config=W4_CONFIGS[config])
    _w4a16_close(out, w4a16_reference(x, qweight, scales, offsets, g_idx))
    torch.testing.assert_close(w4a16_reference(x, tiles, scales, offsets, g_idx),
                               w4a16_reference(x, qweight, scales, offsets, g_idx))


def test_triton_w4a16_checks_its_inputs():
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    x, qweight, scales, zeros, g_idx, _ = _w4_case(2, 64, 16, 16, False)
    with pytest.raises(ValueError, match="qweight must be"):
        w4a16_gemm(x[:, :56], qweight, scales, zeros, g_idx[:56])
    with pytest.raises(ValueError, match="g_idx values"):
        w4a16_gemm(x, qweight, scales, zeros, g_idx + 4)
    with pytest.raises(ValueError, match="group_size 32 must be"):
        w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size=32)
    with pytest.raises(ValueError, match="group_size 16 needs g_idx"):
        w4a16_gemm(x, qweight, scales, zeros, g_idx.flip(0), group_size=16)
    with pytest.raises(ValueError, match="gemv only with block_m 1"):
        W4Config(16, 64, 64, 1, 4, gemv=True)


def test_w4a16_configs_cover_the_sms_at_decode():
    """Decode splits K until a llama3-8b layer's grid covers an H100's 132 SMs several times;
    prefill tiles already do, and table entries win over the heuristic."""
    from corectl.backends.triton.gemm import w4a16_configs as configs

    o_proj = configs.heuristic(1, 4096, 4096, 132)
    assert o_proj.gemv and (4096 // o_proj.block_n) * o_proj.split_k >= 132
    assert configs.heuristic(4, 28672, 4096, 132).split_k >= 2
    assert configs.heuristic(512, 4096, 4096, 132).split_k == 1
    assert [configs.m_bucket(m) for m in (1, 2, 16, 17, 4096)] == [1, 4, 16, 64, 512]
    entry = W4Config(1, 512, 64, 8, 8, gemv=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(configs.TABLE, (1, 4096, 4096), entry)
        assert configs.choose(1, 4096, 4096, torch.device("cpu")) == entry
        assert configs.choose(1, 4096, 4096, torch.device("cpu"), gathered=True) != entry


def test_triton_fp8_row_quantizer_matches_reference():
    from corectl.backends.triton.gemm.fp8_quant import quantize_rows_fp8

    x = torch.randn(5, 300) * torch.rand(5, 1) * 10
    x[0, :4] = torch.tensor([0.0, 1e-4, -3e-3, 7e-3])  # zero and e4m3 subnormals (after scaling)
    got, got_scale = quantize_rows_fp8(x)
    expected, expected_scale = quantize_rows(x)
    torch.testing.assert_close(got_scale, expected_scale)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
