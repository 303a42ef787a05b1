"""The mixture-of-experts layer's parts: routing, the torch path, per-expert loading and TP slices."""
from __future__ import annotations

import pytest
import torch
from corectl.distributed import TensorParallel, parallel_state
from corectl.errors import ConfigError
from corectl.models.moe import FusedMoE, fused_moe_torch, load_moe_weights, select_experts
from corectl.models.parallel import check_tensor_parallel
from torch.nn import functional as F
from transformers import Qwen3MoeConfig


def build_as(rank: int, world_size: int, make):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel_state, "_state", TensorParallel(rank, world_size))
        return make()


def per_token_moe(hidden, gate_up, down, weights, ids):
    """One token and one chosen expert at a time: the definition the batched path must meet."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = F.linear(hidden[t], gate_up[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, down[e])
    return out


def test_select_experts_takes_the_top_k_and_renormalises_on_request():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = logits.softmax(-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, same_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))


def test_torch_path_equals_the_per_token_definition():
    torch.manual_seed(0)  # fixed inputs: the fp32 sums meet assert_close's tolerance whatever ran before
    num_experts, hidden_size, inter, top_k = 6, 16, 8, 3
    hidden = torch.randn(11, hidden_size)
    gate_up, down = torch.randn(num_experts, 2 * inter, hidden_size), torch.randn(num_experts, hidden_size, inter)
    weights, ids = select_experts(torch.randn(11, num_experts), top_k, renormalize=True)
    torch.testing.assert_close(fused_moe_torch(hidden, gate_up, down, weights, ids),
                               per_token_moe(hidden, gate_up, down, weights, ids))


def checkpoint_experts(num_experts: int, hidden_size: int, inter: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(num_experts):
        tensors[f"layer.experts.{e}.gate_proj.weight"] = torch.randn(inter, hidden_size)
        tensors[f"layer.experts.{e}.up_proj.weight"] = torch.randn(inter, hidden_size)
        tensors[f"layer.experts.{e}.down_proj.weight"] = torch.randn(hidden_size, inter)
    return tensors


class Holder(torch.nn.Module):
    def __init__(self, num_experts, hidden_size, inter):
        super().__init__()
        self.layer = torch.nn.Module()
        self.layer.experts = FusedMoE(num_experts, hidden_size, inter, top_k=2, renormalize=False)


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_loads_its_rows_of_every_expert_and_the_partial_sums_add_up(world_size):
    num_experts, hidden_size, inter = 4, 8, 6
    tensors = checkpoint_experts(num_experts, hidden_size, inter)
    ranks = [build_as(r, world_size, lambda: Holder(num_experts, hidden_size, inter)) for r in range(world_size)]
    for holder in ranks:
        filled = load_moe_weights(holder, tensors.items(), lambda name: False)
        assert filled == {"layer.experts.gate_up_proj", "layer.experts.down_proj"}
    rows = inter // world_size
    for r, holder in enumerate(ranks):
        experts = holder.layer.experts
        assert experts.gate_up_proj.shape == (num_experts, 2 * rows, hidden_size)
        held = slice(r * rows, (r + 1) * rows)
        for e in range(num_experts):
            assert torch.equal(experts.gate_up_proj[e, :rows], tensors[f"layer.experts.{e}.gate_proj.weight"][held])
            assert torch.equal(experts.gate_up_proj[e, rows:], tensors[f"layer.experts.{e}.up_proj.weight"][held])
            assert torch.equal(experts.down_proj[e], tensors[f"layer.experts.{e}.down_proj.weight"][:, held])
    full_gate_up = torch.stack([torch.cat([tensors[f"layer.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                                for e in range(num_experts)])
    full_down = torch.stack([tensors[f"layer.experts.{e}.down_proj.weight"] for e in range(num_experts)])
    hidden = torch.randn(5, hidden_size)
    weights, ids = select_experts(torch.randn(5, num_experts), 2, renormalize=False)
    # The sum of the ranks' outputs (what the all-reduce does) is the whole layer's output.
    total = sum(fused_moe_torch(hidden, h.layer.experts.gate_up_proj, h.layer.experts.down_proj, weights, ids)
                for h in ranks)
    torch.testing.assert_close(total, fused_moe_torch(hidden, full_gate_up, full_down, weights, ids))


def test_a_missing_expert_leaves_its_parameter_unfilled_and_a_wrong_shape_is_refused():
    tensors = checkpoint_experts(3, 8, 4)
    del tensors["layer.experts.2.up_proj.weight"]
    assert load_moe_weights(Holder(3, 8, 4), tensors.items(), lambda name: False) == {"layer.experts.down_proj"}
    tensors["layer.experts.2.up_proj.weight"] = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"expert 2 up_proj: expected \(4, 8\)"):
        load_moe_weights(Holder(3, 8, 4), tensors.items(), lambda name: False)
    with pytest.raises(ValueError, match="names expert 7; the model has 3 experts"):
        load_moe_weights(Holder(3, 8, 4), [("layer.experts.7.down_proj.weight", torch.randn(8, 4))], lambda n: False)


def test_a_tensor_parallel_size_that_does_not_split_the_experts_is_refused():
    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            moe_intermediate_size=18)
    check_tensor_parallel(config, 2)
    with pytest.raises(ConfigError, match="expert MLP width 18"):
        check_tensor_parallel(config, 4)


def fp8_checkpoint_experts(tensors: dict[str, torch.Tensor], per_channel: bool):
    """The experts as an FP8 checkpoint stores them (e4m3, `weight_scale` per row or per matrix,
    a static `input_scale` the method reads past) and the dequantized weights they encode."""
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()).float() / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        stem = name.removesuffix(".weight")
        quantized.update({name: q, f"{stem}.weight_scale": scale, f"{stem}.input_scale": torch.tensor(0.1)})
        dequantized[name] = q.float() * scale
    return quantized, dequantized


def fp8_holder(config, num_experts, hidden_size, inter):
    from corectl.quantization import bind_linear_methods, quantization_scope

    with quantization_scope(config):
        holder = Holder(num_experts, hidden_size, inter)
        assert holder.layer.experts.gate_up_proj.is_meta  # the method allocates the experts
        assert bind_linear_methods(holder, config, torch.float32, torch.device("cpu")) == 1
    return holder


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("world_size", [1, 2])
def test_fp8_experts_load_each_ranks_e4m3_rows_and_scales_exactly(world_size, per_channel):
    from corectl.quantization import process_loaded_weights
    from corectl.quantization.fp8 import Fp8Config

    num_experts, hidden_size, inter = 4, 16, 8
    quantized, dequantized = fp8_checkpoint_experts(checkpoint_experts(num_experts, hidden_size, inter), per_channel)
    config = Fp8Config(serialized=True, kernel="fp8_reference")
    ranks = [build_as(r, world_size, lambda: fp8_holder(config, num_experts, hidden_size, inter))
             for r in range(world_size)]
    for holder in ranks:
        filled = load_moe_weights(holder, quantized.items(), lambda name: False)
        assert filled == {f"layer.experts.{p}" for p in ("gate_up_proj", "down_proj", "gate_up_proj_scale",
                                                         "down_proj_scale")}
        process_loaded_weights(holder)
    rows = inter // world_size
    for r, holder in enumerate(ranks):
        experts, held = holder.layer.experts, slice(r * rows, (r + 1) * rows)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        gate_up = experts.gate_up_proj.float() * experts.gate_up_proj_scale[..., None]
        down = experts.down_proj.float() * experts.down_proj_scale[..., None]
        for e in range(num_experts):
            assert torch.equal(gate_up[e, :rows], dequantized[f"layer.experts.{e}.gate_proj.weight"][held])
            assert torch.equal(gate_up[e, rows:], dequantized[f"layer.experts.{e}.up_proj.weight"][held])
            assert torch.equal(down[e], dequantized[f"layer.experts.{e}.down_proj.weight"][:, held])
    # The ranks' partial outputs (the method's, before the all-reduce) add up to the dequantized
    # layer's output (W8A16: x is not quantized).
    hidden, logits = torch.randn(5, hidden_size), torch.randn(5, num_experts)
    weights, ids = select_experts(logits, 2, renormalize=False)
    full_gate_up = torch.stack([torch.cat([dequantized[f"layer.experts.{e}.{p}.weight"]
                                           for p in ("gate_proj", "up_proj")]) for e in range(num_experts)])
    full_down = torch.stack([dequantized[f"layer.experts.{e}.down_proj.weight"] for e in range(num_experts)])
    total = sum(h.layer.experts.quant_method.apply(h.layer.experts, hidden, logits) for h in ranks)
    expected = fused_moe_torch(hidden, full_gate_up, full_down, weights, ids)
    # fp32 sums in another order (per rank, the scale applied after the sum): a few ulps of the largest
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_fp8_on_the_fly_quantizes_each_experts_rows_after_loading():
    from corectl.quantization import process_loaded_weights
    from corectl.quantization.fp8 import Fp8Config, quantize_rows

    tensors = checkpoint_experts(3, 16, 8)
    holder = fp8_holder(Fp8Config(kernel="fp8_reference"), 3, 16, 8)
    assert holder.layer.experts.gate_up_proj.dtype == torch.float32  # dense until loaded
    load_moe_weights(holder, tensors.items(), lambda name: False)
    dense_down = holder.layer.experts.down_proj.detach().clone()
    process_loaded_weights(holder)
    experts = holder.layer.experts
    for e in range(3):
        expected, scale = quantize_rows(dense_down[e])
        assert torch.equal(experts.down_proj[e].view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(experts.down_proj_scale[e], scale.view(-1))
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale.shape == (3, 16)


def test_fp8_checkpoint_missing_an_experts_scale_leaves_the_scale_unfilled():
    from corectl.quantization.fp8 import Fp8Config

    quantized, _ = fp8_checkpoint_experts(checkpoint_experts(3, 16, 8), per_channel=True)
    del quantized["layer.experts.1.down_proj.weight_scale"]
    holder = fp8_holder(Fp8Config(serialized=True, kernel="fp8_reference"), 3, 16, 8)
    filled = load_moe_weights(holder, quantized.items(), lambda name: False)
    assert "layer.experts.down_proj_scale" not in filled and "layer.experts.down_proj" in filled


def test_sparse_moe_block_takes_the_router_kernel_where_the_gate_keeps_its_weight():
    """With layer kernels the router's logits come from `router_logits(hidden, gate.weight)`; a
    platform that swapped the gate for a module without `weight` keeps the module's GEMM."""
    import dataclasses

    from corectl.backends.cpu.prepack import PrepackedLinear
    from corectl.models.kernels import LayerKernels
    from corectl.models.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(hidden_size=16, num_experts=4, top_k=2, intermediate_size=8, renormalize=True)
    block.experts.set_quant_method(None, torch.float32, torch.device("cpu"))
    for param in block.parameters():
        param.data.normal_()
    hidden = torch.randn(3, 16)
    reference = block(hidden)
    calls = []

    def router(x, weight):
        calls.append(weight)
        return F.linear(x, weight)

    block.kernels = dataclasses.replace(LayerKernels(None, None, None), router_logits=router)
    torch.testing.assert_close(block(hidden), reference)
    assert len(calls) == 1 and calls[0] is block.gate.weight

    block.gate = PrepackedLinear(block.gate)  # the CPU worker's swap: no `weight` left
    torch.testing.assert_close(block(hidden), reference)
    assert len(calls) == 1
