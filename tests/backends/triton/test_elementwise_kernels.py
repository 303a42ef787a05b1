"""RMSNorm (+ residual), SiLU-and-mul and rotary embedding against their torch references."""
import pytest
import torch
from corectl.backends.triton.elementwise.activation import silu_and_mul
from corectl.backends.triton.reference import (
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from corectl.backends.triton.elementwise.rms_norm import rms_norm
from corectl.backends.triton.elementwise.rotary import qk_norm_rotary, rotary_embedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, assert_close):
    x = torch.randn(7, 72).to(dtype)
    weight = torch.randn(72).to(dtype)
    # bf16: the normed row and the weight product are each rounded (HF order).
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), roundings=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual(dtype, assert_close):
    x, residual = torch.randn(7, 72).to(dtype), torch.randn(7, 72).to(dtype)
    weight = torch.randn(72).to(dtype)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert_close(new_residual, ref_residual)
    # The rounded residual feeds the norm, so its step propagates into the output.
    assert_close(out, ref_out, roundings=4)


def _assert_rounds_like(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp16 converts with correct rounding even in the interpreter, so the kernel must reproduce
    the reference's rounding steps: all but a few borderline elements (fp32 summation order) equal.
    A borderline element may land one fp16 step away in each of two roundings, so up to 2 ulp."""
    torch.testing.assert_close(out, ref, rtol=2.0 ** -9, atol=1e-5)
    assert (out != ref).float().mean() <= 0.01, f"{(out != ref).sum().item()} of {out.numel()} elements differ"


def test_rms_norm_rounds_like_hugging_face():
    x, residual = torch.randn(32, 72).half(), torch.randn(32, 72).half()
    weight = torch.randn(72).half()
    _assert_rounds_like(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    _assert_rounds_like(out, ref_out)


def test_rms_norm_rejects_mismatches():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight has 4 elements but rows of x have 8"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight and x must share a dtype"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match=r"residual must be torch.float32 \(3, 8\)"):
        rms_norm(x, torch.ones(8), 1e-6, residual=torch.randn(2, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1500])
def test_silu_and_mul(dtype, inter, assert_close):
    x = (2 * torch.randn(5, 2 * inter)).to(dtype)
    # bf16: silu(gate) and the product are each rounded (HF order).
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), roundings=3)


def test_silu_and_mul_rounds_like_hugging_face():
    x = (2 * torch.randn(32, 2 * 72)).half()
    _assert_rounds_like(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="odd width 7"):
        silu_and_mul(torch.randn(2, 7))


def _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q and k as the model produces them: strided views into one packed qkv projection."""
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width).to(dtype)
    q = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_in_place_on_strided_views(dtype, rot_dim, assert_close):
    qkv, q, k = _qkv_views(9, 6, 2, 32, dtype)
    max_pos = 64
    # Unrelated halves (HF stores equal ones) so the test pins which half multiplies which.
    cos, sin = torch.randn(max_pos, rot_dim).to(dtype), torch.randn(max_pos, rot_dim).to(dtype)
    positions = torch.randint(0, max_pos, (9,))
    v_before = qkv[:, 6 * 32 + 2 * 32:].clone()
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cos, sin)
    rotary_embedding(positions, q, k, cos, sin)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, 6 * 32 + 2 * 32:], v_before)


def test_rotary_rejects_bad_positions_and_widths():
    _, q, k = _qkv_views(3, 6, 2, 16, torch.float32)
    cos = sin = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"positions values must lie in \[0, 8\), found range \[0, 8\]"):
        rotary_embedding(torch.tensor([0, 8, 2]), q, k, cos, sin)
    with pytest.raises(ValueError, match="positions must be int64, int32"):
        rotary_embedding(torch.tensor([0.0, 1.0, 2.0]), q, k, cos, sin)
    with pytest.raises(ValueError, match=r"rot_dim\) must be even and in \(0, head_dim=16\]"):
        rotary_embedding(torch.tensor([0, 1, 2]), q, k, torch.randn(8, 32), torch.randn(8, 32))
    with pytest.raises(ValueError, match="q and k must share a dtype"):
        rotary_embedding(torch.tensor([0, 1, 2]), q, k.bfloat16(), cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_equals_norms_then_rotation(dtype, assert_close):
    qkv, q, k = _qkv_views(9, 6, 2, 32, dtype)
    q_weight, k_weight = torch.randn(32).to(dtype), torch.randn(32).to(dtype)
    cos, sin = torch.randn(64, 32).to(dtype), torch.randn(64, 32).to(dtype)
    positions = torch.randint(0, 64, (9,))
    v_before = qkv[:, 8 * 32:].clone()
    ref_q, ref_k = rotary_embedding_ref(positions, rms_norm_ref(q, q_weight, 1e-6), rms_norm_ref(k, k_weight, 1e-6),
                                        cos, sin)
    # The unfused kernels on copies: the fused launch must round exactly as they do in sequence.
    two_step_q, two_step_k = q.clone(), k.clone()
    normed_q = rms_norm(two_step_q.reshape(-1, 32), q_weight, 1e-6).view(9, 6, 32)
    normed_k = rms_norm(two_step_k.reshape(-1, 32), k_weight, 1e-6).view(9, 2, 32)
    rotary_embedding(positions, normed_q, normed_k, cos, sin)
    qk_norm_rotary(positions, q, k, q_weight, k_weight, 1e-6, cos, sin)
    for out, ref, two_step in ((q, ref_q, normed_q), (k, ref_k, normed_k)):
        if dtype == torch.float32:
            assert_close(out, ref)
            assert_close(out, two_step)
            continue
        # The normed row and the weight product are rounded before the rotation subtracts products
        # of them: a step off there (the fused kernel sums a row's squares as two halves, the norm
        # kernel in one pass, so rstd can differ in its last bit) moves a (possibly cancelled)
        # result by steps of the inputs' magnitude, not of its own.
        for expected in (ref, two_step):
            torch.testing.assert_close(out.float(), expected.float(), rtol=0,
                                       atol=3 * torch.finfo(dtype).eps * expected.abs().amax().item())
    assert torch.equal(qkv[:, 8 * 32:], v_before)


def test_qk_norm_rotary_rejects_partial_rotation_and_bad_weights():
    _, q, k = _qkv_views(3, 6, 2, 16, torch.float32)
    positions, weight = torch.tensor([0, 1, 2]), torch.randn(16)
    with pytest.raises(ValueError, match="cos_cache width must be head_dim=16, got 8"):
        qk_norm_rotary(positions, q, k, weight, weight, 1e-6, torch.randn(8, 8), torch.randn(8, 8))
    with pytest.raises(ValueError, match=r"k_weight must be torch.float32 \[16\]"):
        qk_norm_rotary(positions, q, k, weight, torch.randn(8), 1e-6, torch.randn(8, 16), torch.randn(8, 16))
