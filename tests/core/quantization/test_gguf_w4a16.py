"""The GGUF method bound to the Triton 4-bit GEMM (interpreter), as on GPUs: real Q4_0, Q4_1 and
Q4_K blocks decoded as the loader does, repacked into w4a16's layout (codes as column-tiled words,
scales and float offsets [K/32, N]), against the gguf package's own dequantized weights, at
tensor-parallel sizes 1 and 2, holding exactly the bytes `served_bytes` planned."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from corectl.backends.triton.gemm.w4a16 import w4a16_gemm
from corectl.loaders.gguf_blocks import decode_int4_groups
from corectl.models.parallel import PackedLinear, RowParallelLinear
from corectl.quantization.gguf import GGUFConfig
from corectl.quantization.int4 import W4_TILE
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from support.close import assert_close
from support.gguf_files import quantize_blocks
from support.quantized_layers import assert_row_parallel_sums, build_quantized_layer, finish_loading

N = 64
# Q4_0/Q4_1 rows of 192 inputs split into 96 per rank (3 groups: no multiple of a 64-input
# block); Q4_K needs whole super-blocks of 256.
IN_FEATURES = {"Q4_0": 192, "Q4_1": 192, "Q4_K": 512}
PREFIX = "model.layers.0.mlp.down_proj"


def _blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, bytes per row]: random weights quantized to `qtype`."""
    return quantize_blocks((np.random.randn(n, k) * 0.1).astype(np.float32), GGMLQuantizationType[qtype])


def _reference(qtype: str, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(rows, GGMLQuantizationType[qtype]).reshape(rows.shape[0], -1).copy())


def _build(rank: int, world_size: int, make, prefix: str, dtype: torch.dtype):
    config = GGUFConfig(kept=frozenset({f"{prefix.rsplit('.', 1)[0]}.{p}.weight" for p in
                                        ("down_proj", "q_proj", "k_proj", "v_proj")}), kernel="w4a16")
    return build_quantized_layer(config, {"w4a16": w4a16_gemm}, make, prefix, dtype, rank, world_size)


def _finish(layer, prefix: str) -> None:
    finish_loading(layer, prefix)
    assert layer.w4_zeros.dtype == layer.w4_scales.dtype
    assert layer.w4_qweight.shape == (-(-layer.out_features // W4_TILE), layer.in_features // 8, W4_TILE)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 16, 70])
@pytest.mark.parametrize("qtype", list(IN_FEATURES))
def test_row_parallel_gguf_blocks_on_w4a16_match_their_dequantized_weights(qtype, m, world_size):
    k = IN_FEATURES[qtype]
    rows = _blocks(qtype, N, k)

    def loaded(rank: int):
        layer = _build(rank, world_size, lambda: RowParallelLinear(k, N, bias=False), PREFIX, torch.float32)
        layer.weight.weight_loader(layer.weight, decode_int4_groups(qtype, rows))
        _finish(layer, PREFIX)
        return layer

    assert_row_parallel_sums(loaded, torch.randn(m, k), _reference(qtype, rows), world_size, 1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_packed_column_parallel_shards_of_mixed_formats(world_size):
    """q, k and v in Q4_0, Q4_1 and Q4_K: each rank keeps its rows of every shard."""
    shards, k = {"q": 64, "k": 32, "v": 32}, 256
    types = {"q": "Q4_0", "k": "Q4_1", "v": "Q4_K"}
    rows = {s: _blocks(types[s], size, k) for s, size in shards.items()}
    x = torch.randn(3, 1, k)
    prefix = "model.layers.0.self_attn.qkv_proj"
    for rank in range(world_size):
        layer = _build(rank, world_size, lambda: PackedLinear(k, shards, bias=False, unit=16), prefix, torch.float32)
        for shard, blocks in rows.items():
            layer.weight.weight_loader(layer.weight, decode_int4_groups(types[shard], blocks), shard)
        _finish(layer, prefix)
        expected = torch.cat([x @ _reference(types[s], rows[s])[first:first + size].t()
                              for s, (_, size, first) in layer.shards.items()], -1)
        assert_close(layer.quant_method.apply(layer, x), expected, 1e-5)


def test_bf16_decode_serves_fp16_scales_and_offsets():
    """A bf16 model keeps scales and offsets in fp16, the file's precision (the served bytes say
    so): the decode GEMV stays within the rounding of its bf16 activations and output."""
    rows = _blocks("Q4_K", N, 256)
    layer = _build(0, 1, lambda: RowParallelLinear(256, N, bias=False), PREFIX, torch.bfloat16)
    layer.weight.weight_loader(layer.weight, decode_int4_groups("Q4_K", rows))
    _finish(layer, PREFIX)
    assert layer.w4_scales.dtype == layer.w4_zeros.dtype == torch.float16
    x = torch.randn(1, 256).bfloat16()
    out = layer.quant_method.apply(layer, x)
    assert out.dtype == torch.bfloat16
    assert_close(out, x.float() @ _reference("Q4_K", rows).t(), 1e-2)
