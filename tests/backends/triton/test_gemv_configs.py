"""The decode GEMV's launch rule (gemv_configs): the H100 sweeps' winners on the shapes they measured,
valid launches on shapes nobody measured (odd N and K included), and results equal to F.linear."""
from __future__ import annotations

import pytest
import torch
import triton
from corectl.backends.triton.gemm.fp8_gemv import dense_gemv, fp8_w8a16_gemv
from corectl.backends.triton.gemm.gemv_configs import (
    DOT_M,
    MAX_M,
    GemvConfig,
    dense_decode_config,
    fp8_decode_config,
)
from corectl.loaders.presets import PRESETS
from corectl.quantization.fp8 import fp8_w8a16_reference, quantize_rows
from support.close import BF16_STEP

C = GemvConfig
# `python -m corectl.backends.triton.bench.fp8 --dense` on an H100 (2026-11-26): per (N, K) and M bucket,
# the best config where it beat F.linear by 3% (None: F.linear), llama3-8b's and qwen3-0.6b's layers.
DENSE_SWEEP = {
    (1024, 2048): {1: C(1, 8, 512, 1, 4, 3)},
    (1024, 3072): {1: C(1, 8, 512, 1, 4, 3)},
    (4096, 1024): {1: C(1, 16, 256, 1, 4, 3)},
    (4096, 4096): {1: C(1, 8, 512, 1, 4, 3), 2: C(16, 64, 128, 4, 4, 3), 4: C(16, 64, 128, 4, 4, 3),
                   8: C(16, 64, 128, 4, 4, 3)},
    (4096, 14336): {1: C(1, 8, 512, 1, 4, 3)},
    (6144, 1024): {1: C(1, 16, 256, 1, 4, 3)},
    (6144, 4096): {1: C(1, 8, 512, 1, 4, 3)},
    (28672, 4096): {1: C(1, 16, 1024, 1, 8, 3)},
    (128256, 4096): {1: C(1, 16, 1024, 1, 8, 3), 2: C(16, 16, 512, 1, 4, 3), 4: C(16, 16, 512, 1, 4, 3),
                     8: C(16, 16, 512, 1, 4, 3)},
    (151936, 1024): {1: C(1, 8, 512, 1, 4, 3), 2: C(16, 64, 128, 1, 4, 3), 4: C(16, 64, 128, 1, 4, 3)},
}
# The sweep's two winners the rule leaves (within the 1-7% by which cuBLAS trails at M = 2-8): qkv at
# M = 4 alone of its batches, and the qwen3-0.6b LM head's M = 8 without pipelined loads.
DENSE_LEFT = {(6144, 4096, 4): C(16, 32, 256, 1, 4, 3), (151936, 1024, 8): C(16, 64, 128, 1, 4, 1)}
# `python -m corectl.backends.triton.bench.fp8` (FP8 weights, 2026-11-25): llama3-8b's layers, M 1-16.
FP8_SWEEP = {
    (4096, 4096): {1: C(1, 8, 512, 1, 4, 3), **dict.fromkeys((2, 4, 8, 16), C(16, 64, 128, 4, 4, 3))},
    (4096, 14336): {1: C(1, 16, 1024, 1, 8, 3), **dict.fromkeys((2, 4, 8, 16), C(16, 64, 128, 4, 4, 3))},
    (6144, 4096): {1: C(1, 8, 512, 1, 4, 3), **dict.fromkeys((2, 4, 8, 16), C(16, 64, 128, 4, 4, 3))},
    (28672, 4096): {1: C(1, 8, 512, 1, 4, 3), **dict.fromkeys((2, 4, 8, 16), C(16, 64, 128, 1, 4, 3))},
}
# The down projections, which decode steps run gated (silu(gate) * up formed on load): the sweep kept a
# config only where it won in both forms.
GATED = {(4096, 14336), (1024, 3072)}
NEW_DENSE = ["mistral-7b", "qwen3-8b", "qwen3-14b", "gemma-2-9b", "llama-3.2-3b", "qwen2.5-7b", "mistral-nemo-12b"]


def test_rule_returns_the_sweeps_winners_on_the_shapes_they_measured():
    for (n, k), per_m in DENSE_SWEEP.items():
        for m in (1, 2, 4, 8):
            if (n, k, m) not in DENSE_LEFT:
                assert dense_decode_config(m, n, k, gated=(n, k) in GATED) == per_m.get(m), (n, k, m)
    for (n, k, m), winner in DENSE_LEFT.items():
        assert dense_decode_config(m, n, k) in (None, winner._replace(num_stages=3))
    for (n, k), per_m in FP8_SWEEP.items():
        for m, winner in per_m.items():
            assert fp8_decode_config(m, n, k) == winner, (n, k, m)
    # Per CUDA-graph bucket; none past the GEMV's rows; the gated down projection keeps F.linear at M > 1.
    assert dense_decode_config(3, 4096, 4096) == dense_decode_config(4, 4096, 4096)
    assert dense_decode_config(0, 4096, 4096) is None and dense_decode_config(MAX_M + 1, 128256, 4096) is None
    assert dense_decode_config(4, 4096, 4096, gated=True) is None


def _layer_shapes(cfg: dict) -> set[tuple[int, int]]:
    """(N, K) of a dense preset's projections and LM head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter), (cfg["vocab_size"], h)}


@pytest.mark.parametrize("name", NEW_DENSE)
def test_rule_launches_fill_the_sms_on_untuned_presets(name):
    """Every layer of the new presets takes the GEMV at batch 1 with a grid of at least one program
    per SM (132, the H100's), slices keeping two BLOCK_K steps, and valid tensor-core tiles above."""
    for n, k in _layer_shapes(PRESETS[name]):
        for m in (1, 2, 4, 8):
            for cfg in (dense_decode_config(m, n, k), fp8_decode_config(m, n, k)):
                if cfg is None:
                    continue
                assert m <= cfg.block_m and (cfg.block_m == 1 or cfg.block_n >= DOT_M), (n, k, m, cfg)
                assert cfg.split_k == 1 or k // cfg.split_k >= 2 * cfg.block_k
                if m == 1:
                    assert triton.cdiv(n, cfg.block_n) * cfg.split_k >= 132, (n, k, cfg)
        assert dense_decode_config(1, n, k) is not None


# Odd sizes (no dimension a multiple of its block), each reaching another branch of the rule at 132
# SMs: short rows narrowed to 32 x 128 and split in two; a 16x-wider-than-long LM head; long plain
# rows over few column tiles, split in four; FP8 rows of 8 KB and more (16 x 1024, split).
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 1000), (3, 213, 13), (5, 72, 4100), (1, 20, 8200)])
def test_rule_launches_equal_f_linear_on_odd_shapes(m, n, k, assert_close):
    weight = (torch.randn(n, k) * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    cfg = dense_decode_config(m, n, k)
    ref = x.float() @ weight.float().t()
    if cfg is not None:
        assert_close(dense_gemv(x, weight, None, cfg), ref, BF16_STEP, norm="max")
    fp8_weight, scale = quantize_rows(weight.float())
    got = fp8_w8a16_gemv(x.float(), fp8_weight, scale.view(-1))
    assert_close(got, fp8_w8a16_reference(x.float(), fp8_weight, scale.view(-1), None))
