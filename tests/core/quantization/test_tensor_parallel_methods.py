"""Every quantization method at tensor-parallel sizes 1, 2 and 4: each rank's layer loads its slice
of the checkpoint tensors (packed words, group scales, per-shard scales, g_idx) and computes its
part of the dense layer's output: the shard rows of a column-parallel qkv layer, the partial sum
of a row-parallel layer over its input columns. Built rank by rank under that rank's state, as in
tests/core/distributed/test_parallel_layers.py (nothing collective runs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from corectl.backends.triton.gemm.w4a16 import w4a16_gemm
from corectl.errors import ConfigError
from corectl.loaders.gguf_blocks import Int4Groups
from corectl.models.parallel import PackedLinear, RowParallelLinear
from corectl.quantization import layer_bytes
from corectl.quantization.fp8 import CompressedTensorsFp8Config, Fp8Config
from corectl.quantization.gguf import GGUFConfig
from corectl.quantization.int4 import AWQConfig, GPTQConfig
from support.close import assert_close
from support.quant_checkpoints import AWQ_ORDER, pack_nibbles, quantize_int4
from support.quantized_layers import assert_row_parallel_sums, build_quantized_layer

HIDDEN, HEAD_DIM, GROUP = 128, 16, 32
SHARDS = {"q": 4 * HEAD_DIM, "k": 2 * HEAD_DIM, "v": 2 * HEAD_DIM}


def _w4_tensors(method: str, w: torch.Tensor, act_order: bool):
    k = w.shape[1]
    g_idx = np.arange(k) // GROUP
    if act_order:
        g_idx = g_idx[np.random.default_rng(1).permutation(k)]
    codes, zeros, scales, dequant = quantize_int4(w, g_idx, k // GROUP)
    out = {"scales": torch.from_numpy(scales)}
    if method == "awq":
        out.update(qweight=pack_nibbles(codes.T, AWQ_ORDER), qzeros=pack_nibbles(zeros, AWQ_ORDER))
    else:
        by_input = codes.T.reshape(k // 8, 8, -1).transpose(0, 2, 1).reshape(k // 8, -1)
        out.update(qweight=pack_nibbles(by_input, list(range(8))), qzeros=pack_nibbles(zeros - 1, list(range(8))),
                   g_idx=torch.from_numpy(g_idx.astype(np.int32)))
    return out, dequant


def _fp8_tensors(w: torch.Tensor, per_channel: bool):
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448.0).float()
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def _gguf_tensors(w: torch.Tensor):
    n, k = w.shape
    groups = Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.02,
                        torch.randn(n, k // 32) * 0.05)
    return {"weight": groups}, groups.dequantize()


_GGUF_NAMES = frozenset(f"model.layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                "self_attn.v_proj", "mlp.down_proj"))
CASES = {
    "gguf": (GGUFConfig(kept=_GGUF_NAMES, kernel="cpu_int4pack"), _gguf_tensors, 0.02),
    "awq": (AWQConfig(group_size=GROUP, kernel="cpu_int4pack"), lambda w: _w4_tensors("awq", w, False), 0.02),
    "gptq": (GPTQConfig(group_size=GROUP, kernel="cpu_int4pack"), lambda w: _w4_tensors("gptq", w, False), 0.02),
    "gptq-act-order": (GPTQConfig(group_size=GROUP, desc_act=True, kernel="cpu_int4pack"),
                       lambda w: _w4_tensors("gptq", w, True), 0.02),
    # The Triton 4-bit GEMM (interpreter) in the layout the method repacks for it.
    "awq-w4a16": (AWQConfig(group_size=GROUP, kernel="w4a16"), lambda w: _w4_tensors("awq", w, False), 1e-3),
    "gptq-act-order-w4a16": (GPTQConfig(group_size=GROUP, desc_act=True, kernel="w4a16"),
                             lambda w: _w4_tensors("gptq", w, True), 1e-3),
    "gguf-w4a16": (GGUFConfig(kept=_GGUF_NAMES, kernel="w4a16"), _gguf_tensors, 1e-3),
    "fp8-tensor": (Fp8Config(serialized=True, kernel="fp8_reference"), lambda w: _fp8_tensors(w, False), 0.08),
    "ct-fp8-channel": (CompressedTensorsFp8Config(serialized=True, per_channel=True, kernel="fp8_reference"),
                       lambda w: _fp8_tensors(w, True), 0.08),
    "fp8-on-the-fly": (Fp8Config(kernel="fp8_reference"), lambda w: ({"weight": w}, w), 0.08),
}


def _build(rank: int, world_size: int, config, make, prefix: str):
    return build_quantized_layer(config, {"w4a16": w4a16_gemm}, make, prefix, torch.float32, rank, world_size)


def _finish(layer, prefix: str) -> None:
    """Repack the loaded layer; it then holds the bytes its method stated from the shapes alone
    (what `corectl plan` counts), but where an act-order rank's inputs do not form whole groups: a
    dense weight on the CPU, the gathering path without a permutation under w4a16
    (`W4LinearMethod.served_bytes` says why that is planned as packed)."""
    planned = layer.quant_method.served_bytes(layer)
    layer.check_loaded(prefix)
    layer.quant_method.process_weights_after_loading(layer)
    if not hasattr(layer, "dense_weight") and getattr(layer, "w4_group_size", None) != 0:
        assert layer_bytes(layer) == planned


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_column_parallel_rank_outputs(case, world_size):
    config, make_tensors, tol = CASES[case]
    prefix = "model.layers.0.self_attn.qkv_proj"
    full = {name: make_tensors(torch.randn(rows, HIDDEN) * 0.1) for name, rows in SHARDS.items()}
    x = torch.randn(3, HIDDEN)
    for rank in range(world_size):
        layer = _build(rank, world_size, config,
                       lambda: PackedLinear(HIDDEN, SHARDS, bias=False, unit=HEAD_DIM), prefix)
        params = dict(layer.named_parameters())
        for shard, (tensors, _) in full.items():
            for name, tensor in tensors.items():
                params[name].weight_loader(params[name], tensor, shard)
        _finish(layer, prefix)
        expected = torch.cat([x @ full[s][1][first:first + size].t() for s, (_, size, first) in layer.shards.items()], 1)
        assert_close(layer.quant_method.apply(layer, x), expected, tol, norm="max")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_row_parallel_partial_sums_rebuild_the_output(case, world_size):
    config, make_tensors, tol = CASES[case]
    prefix = "model.layers.0.mlp.down_proj"
    tensors, dense = make_tensors(torch.randn(64, HIDDEN) * 0.1)

    def loaded(rank: int):
        layer = _build(rank, world_size, config, lambda: RowParallelLinear(HIDDEN, 64, bias=False), prefix)
        params = dict(layer.named_parameters())
        for name, tensor in tensors.items():
            params[name].weight_loader(params[name], tensor)
        _finish(layer, prefix)
        return layer

    assert_row_parallel_sums(loaded, torch.randn(3, HIDDEN), dense, world_size, tol, norm="max")


def test_packed_shards_with_different_act_orders_are_refused():
    config = GPTQConfig(group_size=GROUP, desc_act=True, kernel="cpu_int4pack")
    prefix = "model.layers.0.self_attn.qkv_proj"
    layer = _build(0, 1, config, lambda: PackedLinear(HIDDEN, SHARDS, bias=False, unit=HEAD_DIM), prefix)
    g_idx = layer.g_idx
    g_idx.weight_loader(g_idx, torch.arange(HIDDEN, dtype=torch.int32) // GROUP, "q")
    with pytest.raises(ConfigError, match="disagree on a shared tensor"):
        g_idx.weight_loader(g_idx, torch.arange(HIDDEN - 1, -1, -1, dtype=torch.int32) // GROUP, "k")
