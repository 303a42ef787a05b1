"""The FP8-weight decode GEMM (W8A16) against the dequantize-then-matmul fp32 reference."""
from __future__ import annotations

import pytest
import torch
import triton
from corectl.backends.triton.gemm import fp8_gemv
from corectl.backends.triton.elementwise.activation import silu_and_mul
from corectl.backends.triton.gemm.fp8_gemv import MAX_M, GemvConfig, fp8_w8a16_gemv
from corectl.backends.triton.gemm.gemv_configs import fp8_decode_config, small_n_config
from corectl.quantization.fp8 import GEMV_MAX_M, fp8_w8a16_reference, quantize_rows
from support.close import BF16_STEP

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
H100_SMS = 132


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    """Outputs of order one: weight rows ~ 1/sqrt(K) before e4m3 quantization."""
    x = torch.randn(m, k).to(dtype)
    weight, scale = quantize_rows(torch.randn(n, k) * k ** -0.5)
    return x, weight, scale.view(-1), torch.randn(n).to(dtype) if bias else None


def _gated_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    """A packed gate_up activation [M, 2K] for a weight of K inputs."""
    _, weight, scale, b = _case(m, n, k, dtype, bias)
    return torch.randn(m, 2 * k).to(dtype), weight, scale, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (1, 33, 1000), (2, 50, 77), (5, 64, 700), (MAX_M, 24, 520)])
def test_gemv_matches_dequantized_reference(m, n, k, dtype, bias, assert_close):
    x, weight, scale, b = _case(m, n, k, dtype, bias)
    assert_close(fp8_w8a16_gemv(x, weight, scale, b), fp8_w8a16_reference(x, weight, scale, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, MAX_M])
def test_gated_gemv_matches_gated_reference(m, dtype, assert_close):
    """bf16 is left to the bit-identity test below: the interpreter truncates bf16 casts where torch
    rounds, which biases the activation's two roundings across the whole sum."""
    x, weight, scale, b = _gated_case(m, 40, 300, dtype, True)
    assert_close(fp8_w8a16_gemv(x, weight, scale, b, gated=True), fp8_w8a16_reference(x, weight, scale, b, gated=True))


# Both kernel forms (the CUDA-core GEMV only serves M = 1), one split and three (K = 300: the
# last split is short, and no split is a whole number of 64-input blocks), each activation dtype.
# The bias is added after the gated sum (in the kernel's epilogue, or in the reduce pass when split):
# it alternates over the cases instead of doubling them, so each kernel form, split and dtype still
# runs with and without one.
@pytest.mark.parametrize("m,block_m", [(1, 1), (1, 16), (3, 16), (MAX_M, 16)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_gemv_is_the_gemv_of_silu_and_mul_to_the_bit(m, block_m, split_k, dtype):
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    bias = (block_m + m + split_k // 3 + dtypes.index(dtype)) % 2 == 1
    x, weight, scale, b = _gated_case(m, 37, 300, dtype, bias)
    config = GemvConfig(block_m, 32, 64, split_k, 4, 2)
    fused = fp8_w8a16_gemv(x, weight, scale, b, config=config, gated=True)
    assert torch.equal(fused, fp8_w8a16_gemv(silu_and_mul(x), weight, scale, b, config=config))


@pytest.mark.parametrize("m", [1, 3, MAX_M])
@pytest.mark.parametrize("config", [(16, 64, 3, 4, 2), (32, 128, 2, 4, 1), (16, 32, 8, 2, 3), (32, 64, 1, 4, 1)])
def test_split_k_partials_reduce_to_the_reference(m, config, assert_close):
    """K = 300 is not a multiple of any split's BLOCK_K steps; 8 splits of 32 leave one empty.
    The tensor-core tile also serves M = 1."""
    config = GemvConfig(16, *config)
    x, weight, scale, b = _case(m, 37, 300, torch.bfloat16, True)
    out = fp8_w8a16_gemv(x, weight, scale, b, config=config)
    assert_close(out, fp8_w8a16_reference(x, weight, scale, b))
    # The second pass sums the splits in order: repeated runs agree to the bit.
    assert torch.equal(out, fp8_w8a16_gemv(x, weight, scale, b, config=config))


def test_fp16_activations_and_strided_rows(assert_close):
    x, weight, scale, b = _case(4, 48, 200, torch.float16, True)
    wide = torch.zeros(4, 256, dtype=torch.float16)
    wide[:, :200] = x
    assert_close(fp8_w8a16_gemv(wide[:, :200], weight, scale, b), fp8_w8a16_reference(x, weight, scale, b))


def test_empty_inputs():
    x, weight, scale, b = _case(1, 8, 16, torch.float32, True)
    assert fp8_w8a16_gemv(x[:0], weight, scale, b).shape == (0, 8)
    out = fp8_w8a16_gemv(x[:, :0], weight[:, :0], scale, b)
    assert torch.equal(out, b.view(1, -1))


def test_launcher_names_the_bad_argument():
    x, weight, scale, b = _case(2, 16, 64, torch.float32, True)
    bad = {
        "x must be float32": (x.to(torch.int32), weight, scale, b),
        "weight must be a 2-D torch.float8_e4m3fn": (x, weight.float(), scale, b),
        f"at most {MAX_M} rows": (torch.randn(MAX_M + 1, 64), weight, scale, b),
        "weight must be \\[N, K\\] with K = 32": (x[:, :32], weight, scale, b),
        "weight rows must be contiguous": (x[:, :32], weight[:, ::2], scale, b),
        "w_scale must be a contiguous float32 \\[16\\]": (x, weight, scale.view(-1, 1), b),
        "w_scale must be": (x, weight, scale.half(), b),
        "bias must be \\[16\\]": (x, weight, scale, b[:8]),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            fp8_w8a16_gemv(*args)
    with pytest.raises(ValueError, match="gated x must be \\[M, 2K\\] \\(gate \\| up\\) with K = 64 "
                       "\\(weight \\(16, 64\\)'s inputs\\), got x \\(2, 64\\)"):
        fp8_w8a16_gemv(x, weight, scale, b, gated=True)
    with pytest.raises(ValueError, match="block_n must be >= 16"):
        fp8_w8a16_gemv(x, weight, scale, b, config=GemvConfig(16, 8, 64, 1, 4, 1))
    with pytest.raises(ValueError, match="block_m must be 1 \\(M = 1\\) or 16, and at least M = 2"):
        fp8_w8a16_gemv(x, weight, scale, b, config=GemvConfig(1, 16, 64, 1, 4, 1))


def test_kernel_and_method_agree_on_the_bound():
    assert MAX_M == GEMV_MAX_M


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_rule_gives_every_h100_sm_work(m, n, k):
    cfg = fp8_decode_config(m, n, k)
    assert triton.cdiv(n, cfg.block_n) * cfg.split_k >= H100_SMS
    assert k // cfg.split_k >= 2 * cfg.block_k and m <= cfg.block_m and (cfg.block_m == 1 or cfg.block_n >= 16)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("n", "k"), [(128, 2048), (40, 96)])
def test_dense_gemv_matches_torch(m, n, k):
    """The same kernel on an unscaled fp32 weight (a router's [E, H]): one launch at M = 1 with
    columns narrowed to give the SMs programs; the tl.dot path (IEEE fp32) above."""
    x, weight = torch.randn(m, k), torch.randn(n, k) / k ** 0.5
    torch.testing.assert_close(fp8_gemv.dense_gemv(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_dense_gemv_at_batch_1_is_one_unsplit_launch_over_narrow_columns(assert_close):
    cfg = small_n_config(1, 128, 2048)
    assert (cfg.block_m, cfg.split_k, cfg.block_n) == (1, 1, 2)
    x, weight = torch.randn(1, 300).to(torch.bfloat16), torch.randn(24, 300).to(torch.bfloat16)
    assert_close(fp8_gemv.dense_gemv(x, weight), x.float() @ weight.float().t(), BF16_STEP, norm="max")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,cfg", [(1, GemvConfig(1, 8, 64, 1, 4, 3)), (1, GemvConfig(1, 16, 32, 2, 4, 1)),
                                   (3, GemvConfig(16, 16, 64, 2, 4, 3)), (MAX_M, GemvConfig(16, 32, 32, 1, 4, 1))])
def test_dense_gemv_with_bias_and_gated_matches_torch(m, cfg, dtype, assert_close):
    """A dense layer's decode GEMM: the bias added once after a split-K reduction, and the gated form
    multiplying exactly what silu_and_mul stores (so it equals silu_and_mul then the GEMV)."""
    n, k = 40, 136
    weight, bias = (torch.randn(n, k) * k ** -0.5).to(dtype), torch.randn(n).to(dtype)
    x, gate_up = torch.randn(m, k).to(dtype), torch.randn(m, 2 * k).to(dtype)
    ref = x.float() @ weight.float().t() + bias.float()
    assert_close(fp8_gemv.dense_gemv(x, weight, bias, cfg), ref, 1e-5 if dtype == torch.float32 else BF16_STEP,
                 norm="max")
    gated = fp8_gemv.dense_gemv(gate_up, weight, bias, cfg, gated=True)
    torch.testing.assert_close(gated, fp8_gemv.dense_gemv(silu_and_mul(gate_up), weight, bias, cfg), rtol=0, atol=0)


def test_dense_gemv_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="share a dtype"):
        fp8_gemv.dense_gemv(torch.randn(1, 8), torch.randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="at most 8 rows"):
        fp8_gemv.dense_gemv(torch.randn(9, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"\[N, K\] with K = 8"):
        fp8_gemv.dense_gemv(torch.randn(1, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        fp8_gemv.dense_gemv(torch.randn(1, 8), torch.randn(4, 8), torch.randn(3))
    with pytest.raises(ValueError, match=r"gated x must be \[M, 2K\]"):
        fp8_gemv.dense_gemv(torch.randn(1, 8), torch.randn(4, 8), gated=True)
