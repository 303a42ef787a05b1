"""GGUF's int8 group formats (Q8_0, Q6_K, and the int4 types where a layer mixes them) on the
Triton 8-bit GEMM (interpreter), as GPUs serve them: the kernel against its reference, real blocks
decoded as the loader does against the gguf package's own dequantized weights at tensor-parallel
sizes 1 and 2, the served bytes as planned, and which layers a Q4_K_M-style file keeps as int8."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from corectl.backends.triton.gemm.w8a16 import W8Config, w8a16_gemm
from corectl.errors import ConfigError
from corectl.loaders.gguf_blocks import decode_int8_groups
from corectl.models.parallel import PackedLinear, RowParallelLinear
from corectl.quantization import quantization_scope
from corectl.quantization.gguf import GGUFConfig, GGUFInt4Method
from corectl.quantization.gguf_int8 import GGUFInt8Method, w8a16_reference
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from support.close import assert_close
from support.gguf_files import quantize_blocks
from support.quantized_layers import assert_row_parallel_sums, build_quantized_layer, finish_loading

N = 48
PREFIX = "model.layers.0.mlp.down_proj"


def _case(m: int, n: int, k: int, group: int, offsets: bool, dtype: torch.dtype):
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    mins = (torch.randn(n, k // group) * 0.01).to(dtype) if offsets else None
    return torch.randn(m, k).to(dtype), codes, scales, mins


# GEMV at M = 1 (K = 96: one partial 256-input block), tl.dot tiles above; bf16 only through GEMV
# (Triton's interpreter multiplies bf16 dot operands wrongly, tests/gpu covers them).
@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_w8a16_matches_reference(m, group, offsets, dtype):
    if dtype == torch.bfloat16 and m > 1:
        pytest.skip("bf16 tl.dot is wrong under Triton's interpreter")
    x, codes, scales, mins = _case(m, N, 96, group, offsets, dtype)
    out = w8a16_gemm(x, codes, scales, mins, group)
    assert out.dtype == dtype and out.shape == (m, N)
    assert_close(out, w8a16_reference(x, codes, scales, mins, group), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("cfg", [W8Config(1, 16, 64, 3, 4), W8Config(16, 32, 64, 2, 4)])
def test_triton_w8a16_split_k_sums_every_slice(cfg):
    """K = 320 in 64-input blocks split three (GEMV) or two (dot) ways: uneven slices, one partial."""
    m = cfg.block_m if cfg.block_m > 1 else 1
    x, codes, scales, mins = _case(m, 40, 320, 32, True, torch.float32)
    assert_close(w8a16_gemm(x, codes, scales, mins, 32, cfg), w8a16_reference(x, codes, scales, mins, 32), 1e-5)


def test_triton_w8a16_checks_its_inputs():
    x, codes, scales, mins = _case(2, 16, 64, 32, True, torch.float32)
    with pytest.raises(ValueError, match="group 24 must be"):
        w8a16_gemm(x, codes, scales, mins, 24)
    with pytest.raises(ValueError, match="scales must be"):
        w8a16_gemm(x, codes, scales[:, :1], mins, 32)
    with pytest.raises(ValueError, match="codes must be int8"):
        w8a16_gemm(x, codes.int(), scales, mins, 32)
    with pytest.raises(ValueError, match="x has 32 features"):
        w8a16_gemm(x[:, :32], codes, scales, mins, 32)


def _blocks(qtype: str, n: int, k: int) -> np.ndarray:
    return quantize_blocks((np.random.randn(n, k) * 0.1).astype(np.float32), GGMLQuantizationType[qtype])


def _reference(qtype: str, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(rows, GGMLQuantizationType[qtype]).reshape(rows.shape[0], -1).copy())


def _build(rank: int, world_size: int, make, prefix: str, dtype: torch.dtype, types: dict[str, str]):
    bound = GGUFConfig(tensor_types=types, kernel="w4a16").bind(("w4a16", "w8a16"), "cuda")
    layer = build_quantized_layer(bound, {"w4a16": None, "w8a16": w8a16_gemm}, make, prefix, dtype, rank,
                                  world_size)
    assert isinstance(layer.quant_method, GGUFInt8Method)
    return layer


def _finish(layer, prefix: str) -> None:
    finish_loading(layer, prefix)
    assert layer.w8_codes.dtype == torch.int8


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_row_parallel_int8_blocks_match_their_dequantized_weights(qtype, m, world_size):
    k = 512
    rows = _blocks(qtype, N, k)
    group = 16 if qtype == "Q6_K" else 32

    def loaded(rank: int):
        layer = _build(rank, world_size, lambda: RowParallelLinear(k, N, bias=False), PREFIX, torch.float32,
                       {f"{PREFIX}.weight": qtype})
        layer.weight.weight_loader(layer.weight, decode_int8_groups(qtype, rows, group))
        _finish(layer, PREFIX)
        assert layer.w8_offsets is None and layer.w8_scales.shape == (N, layer.in_features // group)
        return layer

    assert_row_parallel_sums(loaded, torch.randn(m, k), _reference(qtype, rows), world_size, 1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_packed_layer_mixing_q4_k_and_q6_k_keeps_int8_groups_of_16(world_size):
    """q and k in Q4_K, v in Q6_K (as Q4_K_M files store them): one int8 layer, groups of 16,
    with offsets (Q4_K's minimums); each rank keeps its rows of every shard."""
    shards, k = {"q": 64, "k": 32, "v": 32}, 256
    types = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    prefix = "model.layers.0.self_attn.qkv_proj"
    names = {f"model.layers.0.self_attn.{s}_proj.weight": types[s] for s in shards}
    rows = {s: _blocks(types[s], size, k) for s, size in shards.items()}
    x = torch.randn(3, 1, k)
    for rank in range(world_size):
        layer = _build(rank, world_size, lambda: PackedLinear(k, shards, bias=False, unit=16), prefix,
                       torch.float32, names)
        for shard, blocks in rows.items():
            layer.weight.weight_loader(layer.weight, decode_int8_groups(types[shard], blocks, 16), shard)
        _finish(layer, prefix)
        assert layer.w8_offsets is not None and layer.w8_scales.shape[1] == k // 16
        expected = torch.cat([x @ _reference(types[s], rows[s])[first:first + size].t()
                              for s, (_, size, first) in layer.shards.items()], -1)
        assert_close(layer.quant_method.apply(layer, x), expected, 1e-5)


def test_half_precision_models_keep_fp16_scales():
    rows = _blocks("Q6_K", N, 256)
    layer = _build(0, 1, lambda: RowParallelLinear(256, N, bias=False), PREFIX, torch.float16,
                   {f"{PREFIX}.weight": "Q6_K"})
    layer.weight.weight_loader(layer.weight, decode_int8_groups("Q6_K", rows, 16))
    _finish(layer, PREFIX)
    assert layer.w8_scales.dtype == torch.float16
    x = torch.randn(1, 256).half()
    assert_close(layer.quant_method.apply(layer, x), x.float() @ _reference("Q6_K", rows).t(), 1e-2)


def test_q4_k_m_layers_split_between_int4_and_int8_where_the_platform_has_w8a16():
    """A Q4_K_M-style file: q/k/gate/up/o in Q4_K, v and down in Q6_K. The attention's qkv mixes
    them (int8), the MLP's gate_up is int4 only, down is int8; without w8a16 (CPUs) the int8
    layers are dequantized."""
    layer_types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
                   "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}
    types = {f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight": t for p, t in layer_types.items()}
    types["model.embed_tokens.weight"] = "Q8_0"
    config = GGUFConfig(tensor_types=types, kept=frozenset(n for n, t in types.items() if ".layers." in n
                                                           and n.split(".")[-2] in ("o_proj", "gate_proj", "up_proj")))
    gpu = config.bind(("w4a16", "w8a16"), "cuda")
    assert set(gpu.int8_groups) == {n for n in types if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "down_proj")}
    assert set(gpu.int8_groups.values()) == {16}
    assert gpu.describe() == "gguf (Q4_K int4 layers via w4a16; Q4_K/Q6_K int8 layers via w8a16)"
    cpu = config.bind(("cpu_int4pack",), "cpu")
    assert cpu.int8_groups == {} and cpu.describe() == "gguf (Q4_K int4 layers via cpu_int4pack)"
    with quantization_scope(gpu, {"w4a16": None, "w8a16": w8a16_gemm}):
        down = RowParallelLinear(256, 64, bias=False)
        assert isinstance(gpu.linear_method("model.layers.0.mlp.down_proj", down), GGUFInt8Method)
        assert isinstance(gpu.linear_method("model.layers.0.self_attn.o_proj", down), GGUFInt4Method)
        assert cpu.linear_method("model.layers.0.mlp.down_proj", down) is None


def test_int8_layer_refuses_inputs_that_split_no_group():
    with quantization_scope(None, {"w8a16": w8a16_gemm}), pytest.raises(ConfigError, match="groups of 16"):
        GGUFInt8Method(16, False).create_weights(RowParallelLinear(40, 8, bias=False), torch.float32)
