"""The Triton 4-bit GEMM (w4a16) under the interpreter against `w4a16_reference`, the dequantize-then-
matmul of the same operands: zero codes (AWQ/GPTQ, act-order included) and GGUF's float offsets, every
kernel form (GEMV and tl.dot tiles, split K) and column-tiled words; its argument checks and configs."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.gemm import w4a16_configs
from corectl.backends.triton.gemm.w4a16 import _packed_inputs, w4a16_gemm
from corectl.backends.triton.gemm.w4a16_configs import W4Config
from corectl.quantization.int4 import tile_words, untile_words, w4a16_reference
from support.close import assert_close
from support.quantized_layers import w4_operands


def _w4a16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 exactly up to summation order; half dtypes within their rounding of the output (and,
    act-order through tl.dot, of the dequantized weights)."""
    assert out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        assert_close(out, ref, 1e-2)


# Triton's interpreter multiplies bf16 tl.dot operands as raw 16-bit integers (3.9: errors ~1e10
# on plain loaded tiles): bf16 runs here only through GEMV; tests/gpu checks bf16 dots.
INTERPRETED_DOT_DTYPES = (torch.float32, torch.float16)


# Decode sizes 1..16 through the launcher's own choice (GEMV at M = 1, 16-row dots above), a
# prefill size; K = 200 is no multiple of any block (act-order allows any K = 8j).
@pytest.mark.parametrize("m", list(range(1, 17)) + [70])
@pytest.mark.parametrize("act_order", [False, True])
def test_triton_w4a16_matches_reference(m, act_order):
    k, group = (200, 8) if act_order else (192, 64)
    x, qweight, scales, zeros, g_idx, _ = w4_operands(m, k, 80, group, act_order)
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
    if dtype not in INTERPRETED_DOT_DTYPES and m > 1:
        pytest.skip("bf16 tl.dot is wrong under Triton's interpreter")
    x, qweight, scales, offsets, g_idx, _ = w4_operands(m, k, 48, 32, False, offsets=True)
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


GROUPINGS = [(32, False), (24, False), (32, True)]  # contiguous groups, groups of no block's size, act-order


def _config_cases():
    """Each config with each grouping and with zero codes and float offsets (the kernel's
    branches); the activation dtype turns with them, so that each config meets every dtype it runs
    (bf16 only through GEMV) and each dtype both zero codes and offsets. The dtype changes the
    rounding, not the branch: the full product re-ran the same code at ~0.5 s a case."""
    for config, form in W4_CONFIGS.items():
        dtypes = (torch.float32, torch.float16, torch.bfloat16) if form.gemv else INTERPRETED_DOT_DTYPES
        for i, (group, act_order) in enumerate(GROUPINGS):
            for offsets in (False, True):
                dtype = dtypes[(i + offsets * (len(dtypes) - 1)) % len(dtypes)]
                yield pytest.param(config, dtype, group, act_order, offsets,
                                   id=f"{config}-{str(dtype)[6:]}-g{group}{'-act' if act_order else ''}"
                                      f"-{'offsets' if offsets else 'zeros'}")


@pytest.mark.parametrize("config,dtype,group,act_order,offsets", list(_config_cases()))
def test_triton_w4a16_configs_match_reference(config, dtype, group, act_order, offsets):
    """Each config with contiguous groups (G = 24: blocks shrink to 8 inputs for GEMV, tl.dot falls
    back to gathering) and act-order, with zero codes or float offsets; scales (and offsets) in x's
    dtype as loaded."""
    m = 1 if W4_CONFIGS[config].gemv else 5
    x, qweight, scales, zeros, g_idx, _ = w4_operands(m, 192, 72, group, act_order, offsets)
    x, scales = x.to(dtype), scales.to(dtype)
    zeros = zeros.to(dtype) if offsets else zeros
    out = w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size=0 if act_order else group,
                     config=W4_CONFIGS[config])
    _w4a16_close(out, w4a16_reference(x, qweight, scales, zeros, g_idx))


@pytest.mark.parametrize("offset", [0, 1])
def test_triton_w4a16_gemv_reads_inputs_in_pairs_or_singly(offset):
    """16-bit rows that start 4-byte aligned are read two inputs a load; a view starting one input
    further is not, and is read one input a load; both agree with the reference, over three rows."""
    x, qweight, scales, zeros, g_idx, _ = w4_operands(3, 128, 48, 32, False, offsets=True)
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
    m = 1 if W4_CONFIGS[config].gemv else 5
    x, qweight, scales, offsets, g_idx, _ = w4_operands(m, 192, n, 32, False, offsets=True)
    tiles = tile_words(qweight, tile)
    assert tiles.shape == (-(-n // tile), 24, tile) and torch.equal(untile_words(tiles, n), qweight)
    out = w4a16_gemm(x, tiles, scales, offsets, g_idx, group_size=32, config=W4_CONFIGS[config])
    _w4a16_close(out, w4a16_reference(x, qweight, scales, offsets, g_idx))
    torch.testing.assert_close(w4a16_reference(x, tiles, scales, offsets, g_idx),
                               w4a16_reference(x, qweight, scales, offsets, g_idx))


def test_triton_w4a16_checks_its_inputs():
    x, qweight, scales, zeros, g_idx, _ = w4_operands(2, 64, 16, 16, False)
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
    """Decode splits K until a llama3-8b layer's grid covers an H100's 132 SMs several times, unless it
    has two programs an SM already; prefill tiles already do. On llama3-8b's layers the rule gives the
    H100 sweep's best launches (w4a16_configs.heuristic)."""
    o_proj = w4a16_configs.heuristic(1, 4096, 4096, 132)
    assert o_proj.gemv and (4096 // o_proj.block_n) * o_proj.split_k >= 132
    assert w4a16_configs.heuristic(4, 28672, 4096, 132).split_k >= 2
    assert w4a16_configs.heuristic(512, 4096, 4096, 132).split_k == 1
    sweep = {(1, 6144, 4096): 1, (1, 4096, 4096): 4, (1, 28672, 4096): 1, (1, 4096, 14336): 4,
             (16, 4096, 4096): 16, (16, 28672, 4096): 4, (16, 4096, 14336): 16}
    for (m, n, k), split in sweep.items():
        cfg = w4a16_configs.choose(m, n, k, torch.device("cpu"))
        expected = W4Config(1, 16, 512, split, 4, gemv=True) if m == 1 else W4Config(16, 128, 64, split, 4)
        assert cfg == expected, (m, n, k)
